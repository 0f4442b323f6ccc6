"""Sweeps never recompile: patch values and found histogram ranges are step inputs."""

import warnings

import keras
import numpy as np
import pytest
from conftest import BACKEND, numpy
from test_compiled_keys import _builds

import callscope as cs

POSITIONS, FEATURES, ROWS = 64, 4, 8
rng = np.random.default_rng(3)
X = rng.normal(size=(ROWS, POSITIONS, FEATURES)).astype("float32")
TRACES = []  # the block's `call` runs in Python once per trace (JAX, TensorFlow)


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(FEATURES, activation="tanh")

    def call(self, x):
        TRACES.append(1)
        return self.dense(x)


def _model():
    model = cs.Sequential([keras.Input((POSITIONS, FEATURES)), Block(name="block"),
                           keras.layers.Flatten(name="flat"), keras.layers.Dense(3, name="head")],
                          name="net")
    model.compile(loss="mse")
    model.predict(X, verbose=0)  # the plain function, before counting
    return model


def _reference(model, hidden):
    """The head of the model on `hidden` (the block's output), in numpy."""
    kernel, bias = (numpy(v) for v in model.get_layer("head").weights)
    return hidden.reshape(len(hidden), -1) @ kernel + bias


def _block(model, x):
    kernel, bias = (numpy(v) for v in model.get_layer("block").dense.weights)
    return np.tanh(x @ kernel + bias)


def _zero_position(h, values):  # defined once: the same function is the same key
    keep = keras.ops.arange(POSITIONS) != values["position"]
    return h * keras.ops.cast(keep, h.dtype)[None, :, None]


def _sweep(model, patch_of):
    """Predicts once per position under `patch_of(position)`; counts compiles."""
    builds = _builds(model)
    TRACES.clear()
    outputs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no eviction
        for position in range(POSITIONS):
            patches, values = patch_of(position)
            with cs.patch(model, patches, values=values):
                outputs.append(model.predict(X, batch_size=ROWS, verbose=0))
    return outputs, builds


def _check_compiled_once(builds):
    assert builds["predict"] == 1
    if BACKEND in ("jax", "tensorflow"):
        assert len(TRACES) == 1  # torch runs its steps eagerly: builds are its compiles


def test_a_sweep_of_values_compiles_once():
    model = _model()
    outputs, builds = _sweep(
        model, lambda p: ({"net/block": _zero_position}, {"position": p}))
    _check_compiled_once(builds)
    hidden = _block(model, X)
    for position in (0, 17, 63):
        zeroed = hidden.copy()
        zeroed[:, position] = 0.0
        np.testing.assert_allclose(outputs[position], _reference(model, zeroed),
                                   rtol=1e-5, atol=1e-5)
    assert len(model._cs_table()) == 1


class _Ablation:
    def zero_position(self, h, values):
        return _zero_position(h, values)

    def zero_from(self, h, batch, values):  # a batch patch too
        return _zero_position(h, values)


@pytest.mark.parametrize("method", ["zero_position", "zero_from"])
def test_a_sweep_by_a_bound_method_compiles_once(method):
    # `ablation.zero_position` is a new object at each access: keyed by identity, it
    # compiled once per scope (64 compiles, evicted with warnings after 8).
    model, ablation = _model(), _Ablation()
    outputs, builds = _sweep(
        model, lambda p: ({"net/block": getattr(ablation, method)}, {"position": p}))
    _check_compiled_once(builds)
    zeroed = _block(model, X)
    zeroed[:, 63] = 0.0
    np.testing.assert_allclose(outputs[63], _reference(model, zeroed), rtol=1e-5, atol=1e-5)
    # Another object's method is another function: its own key.
    with cs.patch(model, {"net/block": getattr(_Ablation(), method)}, values={"position": 1}):
        model.predict(X, verbose=0)
    assert builds["predict"] == 2


def test_a_sweep_of_patch_arrays_compiles_once():
    model = _model()
    clean = _block(model, X[::-1].copy())  # another run's activations

    def splice(position):
        array = _block(model, X)
        array[:, position] = clean[:, position]
        return {"net/block": array}, None

    outputs, builds = _sweep(model, splice)
    _check_compiled_once(builds)
    hidden = _block(model, X)
    for position in (0, 40, 63):
        spliced = hidden.copy()
        spliced[:, position] = clean[:, position]
        np.testing.assert_allclose(outputs[position], _reference(model, spliced),
                                   rtol=1e-5, atol=1e-5)


def test_a_run_assigns_its_inputs_once_not_per_step():
    model = _model()
    with cs.patch(model, {"net/block": _zero_position}, values={"position": 3}):
        model.predict(X, batch_size=2, verbose=0)  # 4 steps
        first = model._cs.assigned
        model.predict(X, batch_size=2, verbose=0)
    if BACKEND == "jax":  # JAX: placed beside each batch, once per run
        assert first == 0 and model._cs.assigned == 0
    else:
        assert (first, model._cs.assigned) == (1, 2)


def test_a_new_shape_or_function_is_a_new_key():
    model = _model()
    builds = _builds(model)
    with cs.patch(model, {"net/block": _zero_position}, values={"position": 1}):
        model.predict(X, verbose=0)
    with cs.patch(model, {"net/block": _zero_position}, values={"position": np.array([5])}):
        model.predict(X, verbose=0)  # another shape: its own key, the same values
    assert builds["predict"] == 2
    with cs.patch(model, {"net/block": lambda h, values: h}, values={"position": 1}):
        model.predict(X, verbose=0)  # another function
    assert builds["predict"] == 3


def test_values_are_checked():
    model = _model()
    with pytest.raises(TypeError, match="none does.*Received: values=\\['position'\\]"):
        with cs.patch(model, {"net/block": lambda h: h}, values={"position": 1}):
            pass
    with pytest.raises(TypeError, match="takes `values`.*Received: values=None"):
        with cs.patch(model, {"net/block": _zero_position}):
            pass
    with pytest.raises(TypeError, match="numbers and arrays.*Received: values\\['p'\\]='a'"):
        with cs.patch(model, {"net/block": _zero_position}, values={"p": "a"}):
            pass
    with pytest.raises(ValueError, match="int32.*Received: values\\['p'\\] with range"):
        with cs.patch(model, {"net/block": _zero_position}, values={"p": 2**40}):
            pass


def test_values_reach_a_patch_that_takes_the_batch_and_an_eager_call():
    model = _model()

    def shift(h, batch, values):  # row i of the data gets i * values["step"]
        rows = keras.ops.cast(keras.ops.arange(batch.rows) + batch.start, h.dtype)
        return h * 0.0 + keras.ops.reshape(rows, (-1, 1, 1)) * values["step"]

    with cs.patch(model, {"net/block": shift}, values={"step": 0.5}):
        out = model.predict(X, batch_size=3, verbose=0)
    hidden = np.broadcast_to(np.arange(ROWS, dtype="float32")[:, None, None] * 0.5, X.shape)
    np.testing.assert_allclose(out, _reference(model, hidden), rtol=1e-5, atol=1e-5)
    with cs.patch(model, {"net/block": _zero_position}, values={"position": 5}):
        eager = numpy(model(X))
    zeroed = _block(model, X)
    zeroed[:, 5] = 0.0
    np.testing.assert_allclose(eager, _reference(model, zeroed), rtol=1e-5, atol=1e-5)


def _times(h, values):
    return h * values["s"]


def _ops_times(h, values):
    return keras.ops.multiply(h, values["s"])


def _misspelled(h, values):
    return h * values["scale"]


def _refuses(h, values):
    raise ValueError("my own check failed")


def test_int_values_at_a_float_point():
    """`h * values["s"]` with s=2, held as int32: JAX and torch promote; TensorFlow
    refuses, and says which values and how to fix it, compiled and eager."""
    model = _model()
    doubled = _reference(model, _block(model, X) * 2.0)
    for call in (lambda: model.predict(X, verbose=0), lambda: numpy(model(X))):
        with cs.patch(model, {"net/block": _times}, values={"s": 2}):
            if BACKEND == "tensorflow":
                with pytest.raises(TypeError, match=r"(?s)The patch of `net/block` raised .*"
                                                    r"does not promote.*keras.ops.multiply.*"
                                                    r"Received: values with dtypes "
                                                    r"\{'s': 'int32'\}"):
                    call()
            else:
                np.testing.assert_allclose(call(), doubled, rtol=1e-5, atol=1e-5)
        with cs.patch(model, {"net/block": _ops_times}, values={"s": 2}):
            np.testing.assert_allclose(call(), doubled, rtol=1e-5, atol=1e-5)
        # The patch's own errors stay its own, whatever the values' dtypes.
        with cs.patch(model, {"net/block": _misspelled}, values={"s": 2}):
            with pytest.raises(KeyError, match="scale"):
                call()
        with cs.patch(model, {"net/block": _refuses}, values={"s": 2}):
            with pytest.raises(ValueError, match="my own check"):
                call()
    # Nothing stays: unpatched again.
    np.testing.assert_allclose(model.predict(X, verbose=0), _reference(model, _block(model, X)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["predict", "evaluate"])
def test_histogram_ranges_found_from_first_batches_share_one_compile(method):
    model = _model()
    builds = _builds(model)
    kind = {"predict": "predict", "evaluate": "test"}[method]
    captures, traces = [], []
    for scale in (1.0, 7.5, 0.25):
        TRACES.clear()
        x = X * scale
        with cs.capture(model, "net/block", reduce="hist", bins=6) as cap:
            if method == "predict":
                model.predict(x, batch_size=ROWS, verbose=0)
            else:
                model.evaluate(x, np.zeros((ROWS, 3)), batch_size=ROWS, verbose=0)
        captures.append((x, cap))
        traces.append(len(TRACES))
    assert builds[kind] == 1
    if BACKEND in ("jax", "tensorflow"):
        # After the first capture, only the eager pass that finds each one's range
        # (Keras's JAX evaluate traces its first call twice, captured or not).
        assert traces[1:] == [1, 1]
    for x, cap in captures:  # each with its own edges
        hidden = numpy(model.get_layer("block")(x))  # the stock layer, eagerly
        edges = cap.hist_edges("net/block:output/hist")
        lo, hi = hidden.min(), hidden.max()
        np.testing.assert_allclose(edges[[0, -1]], [lo, hi], rtol=1e-6)
        np.testing.assert_array_equal(cap["net/block:output/hist"],
                                      np.histogram(hidden, 6, (lo, hi))[0])
    assert not np.allclose(captures[0][1].hist_edges("net/block:output/hist"),
                           captures[1][1].hist_edges("net/block:output/hist"))
