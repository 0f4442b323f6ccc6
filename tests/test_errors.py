"""Bad input gets an error that names what was expected, what was received, and the fix."""

import keras
import numpy as np
import pytest

import callscope as cs

X = np.ones((2, 2), "float32")


@pytest.fixture
def model():
    model = cs.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.register_context_args("debugging")
    model.register_context_args("temperature", dynamic=True)
    model.compile(loss="mse")
    return model


@pytest.mark.parametrize("method", ["predict", "fit", "evaluate", "predict_on_batch",
                                    "train_on_batch", "test_on_batch", "__call__"])
def test_unregistered_name_is_a_type_error_naming_the_fix(model, method):
    args = (X,) if method in ("predict", "predict_on_batch", "__call__") else (X, X[:, :1])
    with pytest.raises(TypeError) as info:
        getattr(model, method)(*args, debuging=True)
    message = str(info.value)
    assert "`debuging`" in message
    assert "registered: debugging, temperature" in message
    assert "register_context_args('debuging')" in message
    assert "Received: debuging=" in message


def test_tensor_for_a_static_name_points_to_dynamic(model):
    for value in (np.array(True), keras.ops.ones(())):
        with pytest.raises(TypeError, match=r"dynamic=True.*Received: debugging=") as info:
            model.predict(X, debugging=value, verbose=0)
        assert "register_context_args('debugging', dynamic=True)" in str(info.value)


def test_unhashable_value_names_the_argument(model):
    expected = r"`debugging` must be hashable.*Received: debugging=\[1, 2\]"
    with pytest.raises(TypeError, match=expected):
        model.predict(X, debugging=[1, 2], verbose=0)
    with pytest.raises(TypeError, match="`debugging`"):
        with cs.context(debugging={"a": 1}):
            model.predict(X, verbose=0)


def test_tuples_of_static_values_are_keys(model):
    out = model.predict(X, debugging=("a", 1, None), verbose=0)
    assert out.shape == (2, 1)


def test_registration_errors():
    model = cs.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="Received: name='training'"):
        model.register_context_args("training")
    with pytest.raises(ValueError, match="identifiers"):
        model.register_context_args("not a name")
    model.register_context_args("mode")
    with pytest.raises(ValueError, match="already registered as static"):
        model.register_context_args("mode", dynamic=True)
    with pytest.raises(TypeError, match="Received: model=Dense"):
        cs.enable(keras.layers.Dense(1))
    with pytest.raises(TypeError, match="decorates a Keras Layer"):
        cs.context_args("x")(object)


class _Sows(keras.layers.Layer):
    def __init__(self, make, **kwargs):
        super().__init__(**kwargs)
        self.make = make

    def call(self, x):
        cs.sow(self, "v", self.make(x))
        return x


@pytest.mark.parametrize("kind", ["tuple", "dict", "str", "ndarray"])
@pytest.mark.parametrize("reduce", [None, "mean"])
def test_sowing_anything_but_one_tensor_is_a_type_error(kind, reduce):
    # It gave backend-dependent AttributeErrors, or one statistic over a tuple's
    # tensors stacked together.
    make = {"tuple": lambda x: (x, 2 * x), "dict": lambda x: {"a": x},
            "str": lambda x: "hi", "ndarray": lambda x: np.array(["a", "b"])}[kind]
    model = cs.Sequential([keras.Input((2,)), _Sows(make, name="s")], name="m")
    for call in (lambda: model.predict(X, verbose=0), lambda: model(X)):
        with pytest.raises(TypeError) as info:
            with cs.capture(model, reduce=reduce):
                call()
        message = str(info.value)
        assert f"cs.sow records one tensor, and `m/s/v` was given a {kind}" in message
        assert f"Received: value={kind}" in message
        assert ("under a name of its own" in message) == (kind in ("tuple", "dict"))
    np.testing.assert_allclose(model.predict(X, verbose=0), X)  # off: passed through
    # Not recorded nor patched, it is passed through too; discovery lists it.
    dense = cs.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="d"),
                           _Sows(make, name="s")], name="m")
    with cs.capture(dense, "m/d", reduce=reduce) as cap, cs.patch(dense, {"m/d": lambda h: h}):
        dense.predict(X, verbose=0)
    assert list(cap) == ["m/d:output" if reduce is None else "m/d:output/mean"]
    assert "m/s/v" in cs.points(dense, X)


@pytest.mark.parametrize("value", [3.0, 7, np.arange(3.0)], ids=["float", "int", "array"])
def test_a_sown_number_or_numpy_array_is_recorded_as_a_tensor(value):
    model = cs.Sequential([keras.Input((2,)), _Sows(lambda x: value, name="s")], name="m")
    with cs.capture(model) as cap, cs.capture(model, reduce="mean") as stats:
        model.predict(np.ones((6, 2), "float32"), batch_size=2, verbose=0)  # 3 steps
    expected = np.concatenate([np.reshape(value, (-1,))] * 3)
    np.testing.assert_allclose(cap["m/s/v:output"], expected)
    # float64 is floatx, as Keras converts its inputs: one dtype on every backend.
    assert cap["m/s/v:output"].dtype == ("int32" if isinstance(value, int) else "float32")
    assert stats["m/s/v:output/mean"] == pytest.approx(np.mean(value))


class _Slices(keras.layers.Layer):
    def call(self, x):
        k = cs.sow(self, "k", 1)  # a Python int the layer goes on using
        return x[:, :k]


def test_a_capture_never_changes_what_sow_returns():
    # sow gave the converted tensor back: a static slice bound became a tracer (JAX
    # raised), and a float64 array came back as float32.
    model = cs.Sequential([keras.Input((2,)), _Slices(name="s")], name="m")
    with cs.capture(model, "m/s/k") as cap:
        out = model.predict(X, batch_size=1, verbose=0)
    np.testing.assert_allclose(out, X[:, :1])
    np.testing.assert_array_equal(cap["m/s/k:output"], [1, 1])
