"""Saving and loading: cs classes load as registered classes; enabled models load
back as their original class, without callscope."""

import subprocess
import sys

import keras
import numpy as np
import pytest
from conftest import BACKEND
from models_for_tests import Outer

import callscope as cs

X = np.arange(8, dtype="float32").reshape(4, 2)
Y = X.sum(axis=1, keepdims=True)


def _roundtrip(model, tmp_path, **kwargs):
    path = str(tmp_path / "model.keras")
    model.save(path)
    return keras.saving.load_model(path, **kwargs), path


def test_enabled_stock_models_load_back_as_their_original_class(tmp_path):
    inputs = keras.Input((2,))
    functional = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    sequential = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    for model in (functional, sequential):
        original = type(model)
        cs.enable(model)
        model.register_context_args("debugging")
        model.compile(optimizer="adam", loss="mse")
        model.fit(X, Y, debugging=True, epochs=1, verbose=0)
        loaded, path = _roundtrip(model, tmp_path)
        assert type(loaded) is original
        assert not isinstance(loaded, cs.ContextMixin)
        np.testing.assert_allclose(loaded.predict(X, verbose=0), model.predict(X, verbose=0))
        assert loaded.compiled
    # And without callscope imported at all.
    code = (
        "import keras, numpy as np;"
        f"m = keras.saving.load_model({path!r});"
        "print(type(m).__name__, m.predict(np.ones((1, 2)), verbose=0).shape)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"KERAS_BACKEND": BACKEND, "PATH": ""}, check=True)
    assert out.stdout.split()[-3:] == ["Sequential", "(1,", "1)"]
    assert "callscope" not in out.stderr


@keras.saving.register_keras_serializable(package="callscope_tests")
class SimpleMLP(cs.Model):
    def __init__(self, units=4, name="simple_mlp", **kwargs):
        super().__init__(name=name, **kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(units, activation="relu")
        self.out = keras.layers.Dense(1)
        self.register_context_args("debugging")

    def call(self, x, training=None):
        return self.out(self.hidden(x))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def test_cs_model_subclass_and_sequential_load_back(tmp_path):
    model = SimpleMLP(units=3)
    model.compile(optimizer="adam", loss="mse")
    model.fit(X, Y, debugging=True, epochs=1, verbose=0)
    loaded, _ = _roundtrip(model, tmp_path)
    assert type(loaded) is SimpleMLP and loaded.units == 3
    assert loaded.context_args == {"debugging": "static"}
    np.testing.assert_allclose(loaded.predict(X, debugging=True, verbose=0),
                               model.predict(X, verbose=0), rtol=1e-6)

    seq = cs.Sequential([keras.Input((1,)), Outer()])
    seq.register_context_args("foo_mode")
    seq.compile(loss="mse")
    loaded, _ = _roundtrip(seq, tmp_path, custom_objects={"Outer": Outer})
    assert type(loaded) is cs.Sequential
    loaded.register_context_args("foo_mode")
    np.testing.assert_allclose(loaded.predict(np.ones((1, 1)), foo_mode=True, verbose=0), [[2.0]])


def test_functional_cs_model_loads_back_and_does_not_rebase_cs_model(tmp_path):
    inputs = keras.Input((2,))
    functional = cs.Model(inputs, keras.layers.Dense(1)(inputs))
    assert isinstance(functional, cs.Functional)
    loaded, _ = _roundtrip(functional, tmp_path)
    assert type(loaded) is cs.Functional
    np.testing.assert_allclose(loaded.predict(X, verbose=0), functional.predict(X, verbose=0))
    # The next subclass-style cs.Model is still a plain subclassed model.
    assert cs.Model.__bases__ == (cs.ContextMixin, keras.Model)
    model = SimpleMLP()
    assert not isinstance(model, cs.Functional)
    assert model.predict(X, verbose=0).shape == (4, 1)


def test_subclass_built_the_functional_way_like_the_jax_guide():
    class CustomModel(cs.Model):
        pass

    inputs = keras.Input((2,))
    model = CustomModel(inputs, keras.layers.Dense(1)(inputs))
    model2 = CustomModel(inputs, keras.layers.Dense(1)(inputs))
    assert isinstance(model, cs.Functional) and isinstance(model2, cs.Functional)
    assert cs.Model.__bases__ == (cs.ContextMixin, keras.Model)
    model.register_context_args("debugging")
    model.compile(optimizer="adam", loss="mse")
    model.fit(X, Y, debugging=True, epochs=1, verbose=0)


@pytest.mark.parametrize("kind", ["sequential", "subclassed"])
def test_enable_on_a_loaded_model(tmp_path, kind):
    if kind == "sequential":
        model = keras.Sequential([keras.Input((1,)), Outer()])
    else:
        model = SimpleMLP()
        model(X)
    model.compile(optimizer="sgd", loss="mse")
    if kind == "subclassed":
        model.fit(X, Y, epochs=1, verbose=0)  # builds the optimizer's variables
    loaded, _ = _roundtrip(model, tmp_path, custom_objects={"Outer": Outer})
    cs.enable(loaded)
    name = "foo_mode" if kind == "sequential" else "debugging"
    loaded.register_context_args(name)
    x = np.ones((1, 1)) if kind == "sequential" else X
    expected = model.predict(x, verbose=0) + (1.0 if kind == "sequential" else 0.0)
    np.testing.assert_allclose(loaded.predict(x, verbose=0, **{name: True}), expected, rtol=1e-6)
