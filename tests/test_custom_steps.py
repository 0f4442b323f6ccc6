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


def _dynamic_step_model(traces):
    """A custom `test_step` that reads a dynamic value with `cs.current` in its own
    code (outside any layer call) and scales the loss by it, per backend style."""

    class Net(cs.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)
            self.register_context_args("temperature", dynamic=True)

        def call(self, x):
            return self.dense(x)

    if BACKEND == "jax":
        class Custom(Net):
            def test_step(self, state, data):  # the stateless JAX style
                traces.append("test")
                tv, ntv, mv = state
                x, y = data
                t = cs.current("temperature")
                y_pred, ntv = self.stateless_call(tv, ntv, x)
                loss = keras.ops.mean((y_pred - y) ** 2) * t
                return {"scaled": loss, "t": keras.ops.mean(t)}, (tv, ntv, mv)
    else:
        class Custom(Net):
            def test_step(self, data):
                traces.append("test")
                x, y = data
                t = cs.current("temperature")
                loss = keras.ops.mean((self(x) - y) ** 2) * t
                return {"scaled": loss, "t": keras.ops.mean(t)}

    return Custom()


def test_dynamic_value_read_in_own_step_code():
    """`cs.current(<dynamic name>)` in a custom step's own code is the call's value
    (on JAX the value lives in the step's state: Keras's loop purges the variable),
    with no retrace per value, from an argument, a scope and fit's validation."""
    traces = []
    model = _dynamic_step_model(traces)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    error = float(np.mean((X.sum(axis=1, keepdims=True) - Y - 1.0) ** 2))
    y = Y + 1.0
    for t in (2.0, 5.0):
        logs = model.evaluate(X, y, temperature=t, batch_size=4, verbose=0, return_dict=True)
        assert logs["t"] == pytest.approx(t)
        assert logs["scaled"] == pytest.approx(t * error, rel=1e-6)
        if t == 2.0:
            traced = len(traces)  # (a tf.function traces twice at its first call)
    if BACKEND != "torch":  # torch runs its steps eagerly: a call per step, not a trace
        assert len(traces) == traced, traces
    with cs.context(temperature=3.0):
        logs = model.evaluate(X, y, batch_size=4, verbose=0, return_dict=True)
    assert logs["t"] == pytest.approx(3.0)
    history = model.fit(X, y, temperature=0.5, validation_data=(X, y), batch_size=4,
                        epochs=1, verbose=0)
    assert history.history["val_t"] == pytest.approx([0.5])
    assert history.history["val_scaled"] == pytest.approx([0.5 * error], rel=1e-6)
    if BACKEND != "torch":  # torch runs its steps eagerly: a call per step, not a trace
        assert len(traces) == traced, traces
