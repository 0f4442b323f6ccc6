"""User-overridden train_step/test_step get the value, in each backend's own style."""

import keras
import numpy as np
import pytest
from conftest import BACKEND
from models_for_tests import Probe

import callscope as cs

X = np.arange(12, dtype="float32").reshape(4, 3)
Y = X.sum(axis=1, keepdims=True)


def _backend_style_model():
    """The custom `train_step` from Keras's 'customizing fit' guide, per backend."""

    class Base(cs.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)
            self.probe = Probe()
            self.step_values = []
            self.register_context_args("debugging")

        def call(self, x):
            return self.probe(self.dense(x))

    if BACKEND == "tensorflow":
        import tensorflow as tf

        class Custom(Base):
            def train_step(self, data):
                self.step_values.append(cs.current("debugging"))
                x, y = data
                with tf.GradientTape() as tape:
                    y_pred = self(x, training=True)
                    loss = self.compute_loss(y=y, y_pred=y_pred)
                grads = tape.gradient(loss, self.trainable_variables)
                self.optimizer.apply(grads, self.trainable_variables)
                return {"my_loss": loss}

    elif BACKEND == "torch":
        import torch

        class Custom(Base):
            def train_step(self, data):
                self.step_values.append(cs.current("debugging"))
                x, y = data
                self.zero_grad()
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
                loss.backward()
                with torch.no_grad():
                    self.optimizer.apply([v.value.grad for v in self.trainable_weights],
                                         self.trainable_weights)
                return {"my_loss": loss}

    else:
        import jax

        class Custom(Base):
            def compute_loss_and_updates(self, tv, ntv, x, y, training=False):
                y_pred, ntv = self.stateless_call(tv, ntv, x, training=training)
                return self.compute_loss(x, y, y_pred), ntv

            def train_step(self, state, data):
                self.step_values.append(cs.current("debugging"))
                tv, ntv, ov, mv = state
                x, y = data
                grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
                (loss, ntv), grads = grad_fn(tv, ntv, x, y, training=True)
                tv, ov = self.optimizer.stateless_apply(ov, grads, tv)
                return {"my_loss": loss}, (tv, ntv, ov, mv)

    return Custom()


def test_backend_style_train_step_gets_the_value():
    model = _backend_style_model()
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    history = model.fit(X, Y, debugging=True, epochs=1, batch_size=4, verbose=0)
    assert history.history["my_loss"] == pytest.approx([1e4])
    assert set(model.step_values) == {True}
    assert True in model.probe.seen
    model.step_values.clear()
    history = model.fit(X, Y, epochs=1, batch_size=4, verbose=0)
    assert history.history["my_loss"] == pytest.approx([0.0])
    assert set(model.step_values) == {None}


@pytest.mark.skipif(BACKEND != "jax", reason="stateless_call steps are the JAX style")
def test_stateless_call_propagates_context_and_training():
    seen = []

    class Spy(keras.layers.Layer):
        def call(self, x, training=None):
            seen.append(training)
            return x

    class Net(cs.Model):  # its call declares neither `training` nor `debugging`
        def __init__(self):
            super().__init__()
            self.spy, self.probe = Spy(), Probe(seen)
            self.register_context_args("debugging")

        def call(self, x):
            return self.probe(self.spy(x))

    model = Net()
    model(X)
    seen.clear()
    tv = [v.value for v in model.trainable_variables]
    ntv = [v.value for v in model.non_trainable_variables]
    out, _ = model.stateless_call(tv, ntv, X, debugging=True, training=True)
    np.testing.assert_allclose(np.asarray(out), X + 100)
    assert seen == [True]  # the Spy's `training`
    assert model.probe.seen[-1] is True
    with cs.context(debugging=True):
        out, _ = model.stateless_call(tv, ntv, X)
    np.testing.assert_allclose(np.asarray(out), X + 100)
