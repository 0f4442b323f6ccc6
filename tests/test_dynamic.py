"""Dynamic context arguments: numbers and arrays as tensors, never retracing."""

import re

import keras
import numpy as np
import pytest
from conftest import BACKEND, numpy

import callscope as cs

X = np.arange(8, dtype="float32").reshape(4, 2)


@cs.context_args("temperature")
class Divide(keras.layers.Layer):
    def __init__(self, traces=None, **kwargs):
        super().__init__(**kwargs)
        self.traces = [] if traces is None else traces

    def call(self, x, temperature=None):
        self.traces.append(1)
        if temperature is None:
            return x
        assert keras.ops.is_tensor(temperature) or isinstance(temperature, np.ndarray)
        return x / keras.ops.cast(temperature, x.dtype)


def _model(traces):
    model = cs.Sequential([keras.Input((2,)), keras.layers.Dense(3, kernel_initializer="ones"),
                           Divide(traces)])
    model.register_context_args("temperature", dynamic=True)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    return model


@pytest.mark.parametrize("jit_compile", [False, True] if BACKEND != "torch" else [False])
def test_changing_a_dynamic_value_never_retraces(jit_compile):
    traces = []
    model = _model(traces)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", jit_compile=jit_compile)
    base = model.predict(X, verbose=0)
    traced = None
    for t in [1.0, 2.0, 4.0, 0.5, 3.0]:
        np.testing.assert_allclose(model.predict(X, temperature=t, verbose=0), base / t, rtol=1e-6)
        np.testing.assert_allclose(model.predict_on_batch(X, temperature=t), base / t, rtol=1e-6)
        expected = np.mean((base / t - base) ** 2)
        loss = model.evaluate(X, base, temperature=t, verbose=0)
        assert loss == pytest.approx(expected, rel=1e-5)
        traced = len(traces) if traced is None else traced
    if BACKEND == "tensorflow" or (BACKEND == "jax" and jit_compile):
        assert len(traces) == traced  # no trace after the first value
    # Not passing the value returns to the layer's own default.
    np.testing.assert_allclose(model.predict(X, verbose=0), base)


def test_dynamic_values_reach_fit_and_arrays_work():
    traces = []
    model = _model(traces)
    base = model.predict(X, verbose=0)
    t = np.array([1.0, 2.0, 4.0], "float32")
    history = model.fit(X, base / t, temperature=t, epochs=1, verbose=0)
    assert history.history["loss"][0] == pytest.approx(0.0, abs=1e-8)
    np.testing.assert_allclose(numpy(model(X, temperature=t)), base / t, rtol=1e-6)
    with cs.context(temperature=t * 2):
        np.testing.assert_allclose(model.predict(X, verbose=0), base / (t * 2), rtol=1e-6)


def test_a_dynamic_value_keeps_its_first_shape():
    model = _model([])
    model.predict(X, temperature=2.0, verbose=0)
    with pytest.raises(ValueError, match=r"keeps the shape of its first value, \(\)"):
        model.predict(X, temperature=np.ones(3), verbose=0)


def test_a_bfloat16_dynamic_value_is_a_number():
    # Its numpy kind is 'V' (ml_dtypes): a check for numbers must take it.
    model = _model([])
    base = model.predict(X, verbose=0)
    half = keras.ops.convert_to_tensor(np.float32(2.0), dtype="bfloat16")
    np.testing.assert_allclose(model.predict(X, temperature=half, verbose=0), base / 2.0,
                               rtol=1e-6)


@pytest.mark.parametrize("first, later, error, problem", [
    (1, 0.5, TypeError, "a float64 value cannot be held as int"),
    (np.int32(1), 2**40, ValueError, "the value does not fit in int32"),
    (True, 2, TypeError, "a int64 value cannot be held as bool"),
    (2.0, 1e40, ValueError, "the value overflows float32"),
])
def test_a_dynamic_value_keeps_its_first_dtype_and_refuses_a_lossy_cast(first, later, error,
                                                                        problem):
    # Cast silently, 0.5 ran as 0 and 2**40 as 0 (or wrapped), True held 2, 1e40 ran as inf.
    model = _model([])
    base = model.predict(X, verbose=0)
    np.testing.assert_allclose(model.predict(X, temperature=first, verbose=0), base / first,
                               rtol=1e-6)
    message = (rf"`temperature` keeps the dtype of its first value, .*{problem}.*"
               rf"Received: temperature={re.escape(repr(later))}$")
    with pytest.raises(error, match=message):
        model.predict(X, temperature=later, verbose=0)
    with pytest.raises(error, match=message):
        with cs.context(temperature=later):
            model.evaluate(X, base, verbose=0)
    with pytest.raises(error, match=message):  # a direct call passed it on as it was
        model(X, temperature=later)
    with pytest.raises(error, match=message):
        with cs.context(temperature=later):
            model(X)
    # What fits is held exactly, and the model runs on after a refusal.
    fits = True if isinstance(first, bool) else 3
    np.testing.assert_allclose(model.predict(X, temperature=fits, verbose=0), base / fits,
                               rtol=1e-6)


def test_a_direct_call_checks_a_dynamic_value_as_the_entry_points_do():
    # Before any entry point made the variable, too: on JAX 2**40 ran as 0, and
    # everywhere 1e39 as inf and a new shape as it came.
    model = _model([])
    base = numpy(model(X))
    if BACKEND == "jax":  # (its ints are int32)
        with pytest.raises(ValueError, match=r"the value does not fit in int32.*"
                                             r"Received: temperature=1099511627776$"):
            model(X, temperature=2**40)
    with pytest.raises(ValueError, match=r"the value overflows float32.*temperature=1e\+39$"):
        model(X, temperature=1e39)
    with pytest.raises(TypeError, match=r"takes a number, a bool or an array of them.*"
                                        r"Received: temperature='hot'"):
        model(X, temperature="hot")
    np.testing.assert_allclose(numpy(model(X, temperature=2.0)), base / 2.0, rtol=1e-6)
    model.predict(X, temperature=2.0, verbose=0)
    with pytest.raises(ValueError, match=r"keeps the shape of its first value, \(\)"):
        model(X, temperature=np.ones(3))
    state = ([v.value for v in model.trainable_variables],
             [v.value for v in model.non_trainable_variables])
    with pytest.raises(ValueError, match=r"the value overflows float32"):
        model.stateless_call(*state, X, temperature=1e39)
    np.testing.assert_allclose(numpy(model.stateless_call(*state, X, temperature=4.0)[0]),
                               base / 4.0, rtol=1e-6)
    # A tensor goes as it is: a gradient with respect to it stays connected (a
    # first version of the check made it an array, cut from the graph).
    total = float(np.sum(base))
    if BACKEND == "jax":
        import jax

        grad = jax.grad(lambda t: keras.ops.sum(model(X, temperature=t)))(2.0)
    elif BACKEND == "tensorflow":
        import tensorflow as tf

        t = tf.Variable(2.0)
        with tf.GradientTape() as tape:
            out = keras.ops.sum(model(X, temperature=t))
        grad = tape.gradient(out, t)
    else:
        import torch

        t = torch.tensor(2.0, requires_grad=True)
        keras.ops.sum(model(X, temperature=t)).backward()
        grad = t.grad
    assert float(numpy(grad)) == pytest.approx(-total / 4.0, rel=1e-5)  # d (sum/t) / dt
    # The value a direct call gives a layer is the one `predict` gives it.
    np.testing.assert_allclose(numpy(model(X, temperature=np.float64(4.0))),
                               model.predict(X, temperature=np.float64(4.0), verbose=0))


def test_dynamic_variables_stay_out_of_saved_weights(tmp_path):
    model = _model([])
    model.predict(X, temperature=2.0, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path, custom_objects={"Divide": Divide})
    np.testing.assert_allclose(loaded.predict(X, verbose=0), model.predict(X, verbose=0))


def test_a_dynamic_int_out_of_range_of_the_same_width_is_refused():
    # int8 -1 held as uint8 came back as -1 through a cast and back, so it ran as 255.
    model = _model([])
    base = model.predict(X, verbose=0)
    model.predict(X, temperature=np.uint8(3), verbose=0)
    with pytest.raises(ValueError, match=r"does not fit in uint8.*Received: temperature=-1$"):
        model.predict(X, temperature=np.int8(-1), verbose=0)
    np.testing.assert_allclose(model.predict(X, temperature=np.int8(5), verbose=0), base / 5,
                               rtol=1e-6)


@cs.context_args("temperature")
class SeenTemperature(keras.layers.Layer):
    """Multiplies by the value, noting its dtype."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dtypes = []

    def call(self, x, temperature=None):
        self.dtypes.append(keras.backend.standardize_dtype(temperature.dtype))
        return x * temperature


class MixedNet(cs.Model):
    def __init__(self):
        super().__init__()
        self.dense, self.seen = keras.layers.Dense(3, kernel_initializer="ones"), SeenTemperature()
        self.register_context_args("temperature", dynamic=True)

    def call(self, x):
        return self.seen(self.dense(x))


def test_a_dynamic_value_has_one_dtype_in_every_entry_point_under_mixed_precision():
    """A subclassed model's call casts a float value to its compute dtype, as
    Keras's `__call__` casts its arguments. On JAX, fit and predict call the model
    through `stateless_call`, which casts none: the layer got float32 there and
    float16 in a direct call, so its output (and captures) changed dtype."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        model = MixedNet()
        model.compile(optimizer="sgd", loss="mse")
        want = (X @ np.ones((2, 3), "float32") * 2.0).astype("float16")
        direct = numpy(model(X, temperature=2.0))
        predicted = model.predict(X, temperature=2.0, verbose=0)
        with cs.capture(model, "*seen*") as cap:
            model.fit(X, want, temperature=2.0, epochs=1, verbose=0)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    assert set(model.seen.dtypes) == {"float16"}, model.seen.dtypes
    assert direct.dtype == predicted.dtype == np.float16
    np.testing.assert_allclose(predicted, direct)
    np.testing.assert_allclose(direct, want, rtol=1e-3)
    assert {str(v.dtype) for v in cap.values()} == {"float16"}


def test_an_int_that_overflows_a_float16_dynamic_value_is_refused():
    # An int value was not checked against a float dtype: 70000 into a float16
    # variable read inf.
    from callscope import _engine

    with pytest.raises(ValueError, match=r"the value overflows float16"):
        _engine._held_as("t", np.array(70000), np.dtype("float16"))
    assert _engine._held_as("t", np.array(300), np.dtype("float16")) == 300
