"""cs.Model and cs.Sequential are drop-ins: stock Keras programs give the same numbers."""

import keras
import numpy as np
import pytest
from conftest import BACKEND, numpy

import callscope as cs

rng = np.random.default_rng(0)
X = rng.normal(size=(32, 4)).astype("float32")
Y = (X @ rng.normal(size=(4, 1))).astype("float32")


def _sequential(base):
    keras.utils.set_random_seed(1)
    return base([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                 keras.layers.Dropout(0.1), keras.layers.Dense(1)])


def _functional(base):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    return base(inputs, keras.layers.Dense(1)(keras.layers.BatchNormalization()(hidden)))


def _subclassed(base):
    class MLP(base):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(8, activation="relu")
            self.dropout = keras.layers.Dropout(0.1)
            self.out = keras.layers.Dense(1)

        def call(self, x, training=None):
            return self.out(self.dropout(self.hidden(x), training=training))

    keras.utils.set_random_seed(1)
    return MLP()


BUILDERS = {
    "sequential": (_sequential, keras.Sequential, cs.Sequential),
    "functional": (_functional, keras.Model, cs.Model),
    "subclassed": (_subclassed, keras.Model, cs.Model),
}


def _train(model):
    keras.utils.set_random_seed(2)
    logger = []
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    history = model.fit(
        X, Y, validation_split=0.25, epochs=3, batch_size=8, verbose=0,
        callbacks=[keras.callbacks.EarlyStopping(patience=5),
                   keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: logger.append(e))],
    )
    return history.history, logger, model.predict(X, verbose=0), model.evaluate(X, Y, verbose=0)


@pytest.mark.parametrize("kind", BUILDERS)
def test_fit_with_callbacks_gives_the_same_numbers_as_stock_keras(kind):
    build, stock_base, cs_base = BUILDERS[kind]
    stock = _train(build(stock_base))
    ours = _train(build(cs_base))
    assert stock[0].keys() == ours[0].keys()
    for key in stock[0]:
        np.testing.assert_allclose(ours[0][key], stock[0][key], rtol=1e-5, err_msg=key)
    assert ours[1] == stock[1] == [0, 1, 2]
    np.testing.assert_allclose(ours[2], stock[2], rtol=1e-5)
    np.testing.assert_allclose(ours[3], stock[3], rtol=1e-5)


@pytest.mark.parametrize("base", [keras.Sequential, cs.Sequential])
def test_masking_works_as_in_stock_keras(base):
    tokens = np.array([[3, 5, 0, 0], [2, 0, 0, 0]])
    keras.utils.set_random_seed(3)
    model = base([keras.Input((4,), dtype="int32"),
                  keras.layers.Embedding(10, 3, mask_zero=True),
                  keras.layers.GlobalAveragePooling1D()])
    out = model.predict(tokens, verbose=0)
    embedding = numpy(model.layers[0].embeddings)
    np.testing.assert_allclose(out[0], embedding[[3, 5]].mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(out[1], embedding[2], rtol=1e-6)


def _grads(model, x, y, loss_fn):
    """One eager gradient step in the backend's own style (a custom training loop)."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return loss, tape.gradient(loss, model.trainable_variables)
    if BACKEND == "torch":
        model.zero_grad()
        loss = loss_fn(y, model(x, training=True))
        loss.backward()
        return loss, [v.value.grad for v in model.trainable_variables]
    import jax

    def compute(tv, ntv):
        y_pred, ntv = model.stateless_call(tv, ntv, x, training=True)
        return loss_fn(y, y_pred)

    tv = [v.value for v in model.trainable_variables]
    ntv = [v.value for v in model.non_trainable_variables]
    loss, grads = jax.value_and_grad(compute)(tv, ntv)
    return loss, grads


@pytest.mark.parametrize("kind", ["sequential", "subclassed"])
def test_custom_training_loop_matches_stock_keras(kind):
    build, stock_base, cs_base = BUILDERS[kind]
    results = []
    for base in (stock_base, cs_base):
        model = build(base)
        model(X[:1])
        optimizer = keras.optimizers.SGD(0.1)
        loss_fn = keras.losses.MeanSquaredError()
        losses = []
        for step in range(3):
            keras.utils.set_random_seed(step)
            loss, grads = _grads(model, X, Y, loss_fn)
            optimizer.apply(grads, model.trainable_variables)
            losses.append(float(numpy(loss)))
        results.append(losses)
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5)
