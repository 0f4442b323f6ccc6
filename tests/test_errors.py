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
