"""Context arguments reach nested layers from every entry point, on every model kind."""

import threading

import keras
import numpy as np
import pytest
from conftest import BACKEND, numpy
from models_for_tests import Deep, Outer, make_models

import callscope as cs

X = np.arange(12, dtype="float32").reshape(4, 3)
Y = X.sum(axis=1, keepdims=True)
KINDS = ["subclassed", "sequential", "functional", "enabled"]


def _compiled(kind, jit_compile):
    model = make_models([])[kind]
    model.compile(optimizer="sgd", loss="mse", jit_compile=jit_compile)
    return model


@pytest.mark.parametrize("jit_compile", [False, "auto"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_entry_point_honours_the_value_and_returns_to_default(kind, jit_compile):
    model = _compiled(kind, jit_compile)
    on, off = Y + 100.0, Y

    np.testing.assert_allclose(numpy(model(X, debugging=True)), on)
    np.testing.assert_allclose(numpy(model(X)), off)
    np.testing.assert_allclose(model.predict(X, debugging=True, verbose=0), on)
    np.testing.assert_allclose(model.predict(X, verbose=0), off)
    np.testing.assert_allclose(model.predict_on_batch(X, debugging=True), on)
    np.testing.assert_allclose(model.predict_on_batch(X), off)
    # The loss is (100)^2 when the flag is on, and 0 when it is off.
    assert model.evaluate(X, Y, debugging=True, verbose=0) == pytest.approx(1e4)
    assert model.evaluate(X, Y, verbose=0) == pytest.approx(0.0)
    assert model.test_on_batch(X, Y, debugging=True) == pytest.approx(1e4)
    assert model.test_on_batch(X, Y) == pytest.approx(0.0)
    with cs.context(debugging=True):
        np.testing.assert_allclose(model.predict(X, verbose=0), on)
        assert model.evaluate(X, Y, verbose=0) == pytest.approx(1e4)
        # An explicit keyword wins over the scope.
        np.testing.assert_allclose(model.predict(X, debugging=False, verbose=0), off)
    np.testing.assert_allclose(model.predict(X, verbose=0), off)


@pytest.mark.parametrize("kind", KINDS)
def test_fit_and_train_on_batch_use_the_value_including_validation(kind):
    model = make_models([])[kind]
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    history = model.fit(X, Y, debugging=True, epochs=2, batch_size=2, verbose=0,
                        validation_data=(X, Y))
    assert history.history["loss"] == pytest.approx([1e4, 1e4])
    assert history.history["val_loss"] == pytest.approx([1e4, 1e4])
    history = model.fit(X, Y, epochs=1, verbose=0, validation_data=(X, Y))
    assert history.history["loss"] == pytest.approx([0.0])
    assert history.history["val_loss"] == pytest.approx([0.0])
    assert model.train_on_batch(X, Y, debugging=True) == pytest.approx(1e4)
    assert model.train_on_batch(X, Y) == pytest.approx(0.0)


def test_first_seed_example_on_every_entry_point():
    seq = cs.Sequential([Outer()])
    seq.register_context_args("foo_mode")  # public: no underscore needed
    x = np.array([[1.0], [2.0]])
    np.testing.assert_allclose(numpy(seq(x, foo_mode=True)), x + 1)
    np.testing.assert_allclose(seq.predict(x, foo_mode=True, verbose=0), x + 1)
    np.testing.assert_allclose(seq.predict_on_batch(x, foo_mode=True), x + 1)
    seq.compile(loss="mse")
    assert seq.evaluate(x, x + 1, foo_mode=True, verbose=0) == pytest.approx(0.0)
    assert seq.test_on_batch(x, x + 1, foo_mode=True) == pytest.approx(0.0)
    assert seq.evaluate(x, x + 1, verbose=0) == pytest.approx(1.0)
    np.testing.assert_allclose(seq.predict(x, verbose=0), x)


def test_register_after_the_model_was_called():
    seq = cs.Sequential([Outer()])
    seq.predict(np.ones((1, 1)), verbose=0)
    seq.register_context_args("foo_mode")
    np.testing.assert_allclose(seq.predict(np.ones((1, 1)), foo_mode=True, verbose=0), [[2.0]])


def test_current_reads_the_value_in_call_steps_and_callbacks():
    seen = {"step": [], "callback": [], "call": []}

    @cs.context_args("mode")
    class Net(cs.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            seen["call"].append(cs.current("mode", default="none"))
            return self.dense(x)

        def predict_step(self, *args):  # (data), or (state, data) on JAX
            seen["step"].append(cs.current("mode"))
            return super().predict_step(*args)

    class Record(keras.callbacks.Callback):
        def on_predict_batch_end(self, batch, logs=None):
            seen["callback"].append(cs.current("mode"))

    net = Net()
    net.predict(X, mode="probe", verbose=0, callbacks=[Record()])
    assert set(seen["step"]) == {"probe"}
    assert set(seen["call"]) == {"probe"}
    assert set(seen["callback"]) == {"probe"}
    assert cs.current("mode") is None


def test_nothing_leaks_to_the_next_call_or_to_another_thread():
    model = make_models([])["subclassed"]
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    model.fit(X, Y, debugging=True, epochs=1, verbose=0)
    np.testing.assert_allclose(model.predict(X, verbose=0), Y)

    results = {}

    def other_thread():
        results["current"] = cs.current("debugging")
        results["predict"] = model.predict(X, verbose=0)

    # (Read by no call: the thread sees no scope, and the scope says so.)
    with pytest.warns(UserWarning, match="no call inside it looked up"), cs.context(debugging=True):
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert results["current"] is None
    np.testing.assert_allclose(results["predict"], model.predict(X, verbose=0))
    assert np.all(results["predict"] < 100)


def test_nested_cs_models_and_functional_submodels_receive_the_value():
    seen = []
    inner = make_models(seen)["functional"]
    outer_inputs = keras.Input((3,))
    outer = cs.Model(outer_inputs, inner(outer_inputs))
    outer.register_context_args("debugging")
    np.testing.assert_allclose(outer.predict(X, debugging=True, verbose=0), Y + 100)
    np.testing.assert_allclose(outer.predict(X, verbose=0), Y)


def test_layer_registered_the_seed_way_inside_a_subclassed_model():
    class Net(cs.Model):
        def __init__(self):
            super().__init__()
            self.outer = Outer()
            self.register_context_args("foo_mode")

        def call(self, x):
            return self.outer(x)

    net = Net()
    net.compile(loss="mse")
    x = np.array([[1.0], [2.0]], "float32")
    np.testing.assert_allclose(net.predict(x, foo_mode=True, verbose=0), x + 1)
    assert net.evaluate(x, x + 1, foo_mode=True, verbose=0) == pytest.approx(0.0)


def test_training_still_reaches_layers_in_fit():
    # Keras only passes `training` when the model's own call declares it; on JAX
    # 3.15.1 it is lost entirely in stateless_call. The polyfill enters it.
    seen = []

    class Spy(keras.layers.Layer):
        def call(self, x, training=None):
            seen.append(training)
            return x

    class Net(cs.Model):
        def __init__(self):
            super().__init__()
            self.spy = Spy()
            self.dense = keras.layers.Dense(1)
            self.register_context_args("debugging")

        def call(self, x, training=None):
            return self.dense(self.spy(x))

    net = Net()
    net.compile(optimizer="sgd", loss="mse")
    seen.clear()
    net.fit(X, Y, epochs=1, verbose=0)
    assert True in seen, (BACKEND, seen)


def test_overrides_that_take_no_callbacks_run_as_stock_does():
    """On JAX callscope gave every `fit`/`evaluate`/`predict` its gate callbacks, so
    an enabled model whose class overrides `evaluate(self, x, y, verbose,
    return_dict)` failed on a plain `evaluate(x, y)` ("unexpected keyword argument
    'callbacks'"), where stock Keras runs it."""
    class Narrow(keras.Sequential):
        def evaluate(self, x, y, verbose=0, return_dict=False):
            return super().evaluate(x, y, verbose=verbose, return_dict=return_dict)

        def predict(self, x, verbose=0):
            return super().predict(x, verbose=verbose)

        def fit(self, x, y, epochs=1, verbose=0):
            return super().fit(x, y, epochs=epochs, verbose=verbose)

    model = cs.enable(Narrow([keras.Input((3,)), Deep([])]))
    model.register_context_args("debugging")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    assert model.evaluate(X, Y) == pytest.approx(0.0)
    with cs.context(debugging=True):
        assert model.evaluate(X, Y) == pytest.approx(1e4)
        np.testing.assert_allclose(model.predict(X), Y + 100.0)
        assert model.fit(X, Y).history["loss"] == pytest.approx([1e4])
    with pytest.raises(TypeError, match=r"cs.capture\(log=...\) logs through a callback of "
                       r"`fit`, and the model's class overrides `fit\(\)` without "
                       r"`callbacks`.* Received: fit\(self, x, y, epochs=1, verbose=0\)"):
        with cs.capture(model, reduce="mean", log=True):
            model.fit(X, Y)


def test_an_evaluate_override_passing_kwargs_on_takes_keras_arguments():
    """keras_hub's Tasks override `evaluate(self, x, y, batch_size, sample_weight,
    **kwargs)`: `verbose`, `return_dict` and the `steps` of fit's validation were
    refused as unknown context names, so no Task could fit with validation."""
    class PassesOn(keras.Sequential):
        def evaluate(self, x=None, y=None, batch_size=None, sample_weight=None, **kwargs):
            return super().evaluate(x=x, y=y, batch_size=batch_size,
                                    sample_weight=sample_weight, **kwargs)

        def predict(self, x, **kwargs):
            return super().predict(x, **kwargs)

    model = cs.enable(PassesOn([keras.Input((3,)), Deep([])]))
    model.register_context_args("debugging")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    assert model.evaluate(X, Y, verbose=0, return_dict=True) == {"loss": pytest.approx(0.0)}
    assert model.evaluate(X, Y, 2, None, debugging=True, verbose=0) == pytest.approx(1e4)
    history = model.fit(X, Y, debugging=True, epochs=1, batch_size=2, verbose=0,
                        validation_data=(X, Y))
    assert history.history["val_loss"] == pytest.approx([1e4])
    np.testing.assert_allclose(model.predict(X, debugging=True, batch_size=2, verbose=0),
                               Y + 100.0)
    # A word neither the override nor Keras's own method takes is still refused
    # with callscope's error, naming the registered names.
    for method in (model.evaluate, model.predict):
        with pytest.raises(TypeError, match=r"unexpected keyword argument `debuging`.*"
                           r"registered: debugging"):
            method(X, debuging=True, verbose=0)

    # An override that leaves out what Keras's own takes (and fit's validation
    # passes) was told to register `sample_weight` as a context argument.
    class LeavesOut(keras.Sequential):
        def evaluate(self, x=None, y=None, verbose="auto"):
            return super().evaluate(x, y, verbose=verbose)

    model = cs.enable(LeavesOut([keras.Input((3,)), Deep([])]))
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    with pytest.raises(TypeError, match=r"unexpected keyword argument `sample_weight`: Keras's "
                       r"own `evaluate\(\)` takes it, but the model's class overrides "
                       r"`evaluate\(\)` without it \(`fit`'s validation passes every one of "
                       r"them\)\. Let the override take `\*\*kwargs` and pass them on"):
        model.fit(X, Y, epochs=1, verbose=0, validation_data=(X, Y))
