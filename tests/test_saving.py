"""Saving and loading: `cs.Model(inputs, outputs)` and `cs.Sequential` save as the
stock Keras classes and load anywhere; enabled models load back as their original
class, without callscope; `cs.Model` subclasses load as registered classes."""

import json
import re
import subprocess
import sys
import zipfile

import keras
import numpy as np
import pytest
from conftest import BACKEND
from models_for_tests import HalvesWhenDebugging, Outer

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
    assert type(loaded) is keras.Sequential
    assert type(cs.enable(loaded)) is type(seq)
    loaded.register_context_args("foo_mode")
    np.testing.assert_allclose(loaded.predict(np.ones((1, 1)), foo_mode=True, verbose=0), [[2.0]])


def test_functional_cs_model_loads_back_and_does_not_rebase_cs_model(tmp_path):
    inputs = keras.Input((2,))
    functional = cs.Model(inputs, keras.layers.Dense(1)(inputs))
    assert isinstance(functional, cs.Functional)
    loaded, _ = _roundtrip(functional, tmp_path)
    assert type(loaded) is keras.Model(inputs, inputs).__class__  # the stock Functional
    assert isinstance(cs.enable(loaded), cs.Functional) and type(loaded) is type(functional)
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


# ----------------------------------------------------------------------------
# Files anyone can load: cs.Model(inputs, outputs) and cs.Sequential save as stock
# ----------------------------------------------------------------------------
@keras.saving.register_keras_serializable(package="callscope_tests")
@cs.context_args("debugging")
class Shift(keras.layers.Layer):
    """Adds 100 when `debugging`."""

    def call(self, x, debugging=None):
        return x + 100.0 if debugging else x


def _stock_mlp(make, with_shift=False):
    """The same small MLP, built with `make` ("keras", "cs") the functional or the
    Sequential way; fitted, so its file holds the optimizer's state. Made-up names
    (the optimizer's, the input layer's) restart, so two builds have one config."""
    keras.utils.clear_session()
    lib = keras if make == "keras" else cs
    hidden = [keras.layers.Dense(3, activation="relu", name="hidden"),
              keras.layers.Dense(1, name="out")] + ([Shift(name="shift")] if with_shift else [])
    keras.utils.set_random_seed(1)
    if make.endswith("sequential"):
        lib = keras if make == "keras_sequential" else cs
        model = lib.Sequential([keras.Input((2,)), *hidden], name="mlp")
    else:
        inputs = keras.Input((2,))
        x = inputs
        for layer in hidden:
            x = layer(x)
        model = lib.Model(inputs, x, name="mlp")
    model.compile(optimizer="sgd", loss="mse")
    model.fit(X, Y, epochs=1, batch_size=2, verbose=0)
    return model


def _header(path):
    config = json.loads(zipfile.ZipFile(path).read("config.json"))
    return {key: config[key] for key in ("module", "class_name", "registered_name")}


@pytest.fixture
def no_custom_objects():
    """`keras.saving.get_custom_objects().clear()`, undone afterwards."""
    objects = keras.saving.get_custom_objects()
    saved = dict(objects)
    objects.clear()
    yield
    objects.update(saved)


@pytest.mark.parametrize("kind", ["functional", "sequential"])
def test_cs_models_save_as_the_stock_class(tmp_path, kind):
    stock = _stock_mlp("keras" if kind == "functional" else "keras_sequential")
    ours = _stock_mlp("cs" if kind == "functional" else "cs_sequential")
    assert isinstance(ours, cs.Functional if kind == "functional" else cs.Sequential)
    stock.save(tmp_path / "stock.keras")
    ours.save(tmp_path / "ours.keras")
    expected = ({"module": "keras.src.models.functional", "class_name": "Functional",
                 "registered_name": "Functional"} if kind == "functional" else
                {"module": "keras", "class_name": "Sequential", "registered_name": None})
    assert _header(tmp_path / "stock.keras") == expected
    assert _header(tmp_path / "ours.keras") == expected
    # The whole config is the stock one, compile config included (but for the
    # `id()` of objects the config shares, such as a dtype policy).
    def read(name):
        text = zipfile.ZipFile(tmp_path / name).read("config.json").decode()
        return json.loads(re.sub(r'"shared_object_id": \d+', '"shared_object_id": 0', text))

    assert read("ours.keras") == read("stock.keras")


def test_files_load_after_custom_objects_are_cleared(tmp_path, no_custom_objects):
    for kind in ("cs", "cs_sequential"):
        model = _stock_mlp(kind)
        path = tmp_path / f"{kind}.keras"
        model.save(path)
        loaded = keras.saving.load_model(path)
        assert type(loaded).__module__.startswith("keras.")
        assert not isinstance(loaded, cs.ContextMixin)
        np.testing.assert_allclose(loaded.predict(X, verbose=0), model.predict(X, verbose=0),
                                   rtol=1e-6)
        assert loaded.compiled and int(loaded.optimizer.iterations) == 2


def test_files_load_in_a_process_that_never_imports_callscope(tmp_path):
    paths, expected = [], []
    for kind in ("cs", "cs_sequential"):
        model = _stock_mlp(kind)
        paths.append(str(tmp_path / f"{kind}.keras"))
        model.save(paths[-1])
        expected.append(model.predict(X, verbose=0))
    out = str(tmp_path / "predictions.npz")
    code = (
        "import sys, numpy as np, keras\n"
        f"x = np.arange(8, dtype='float32').reshape(4, 2)\n"
        f"models = [keras.saving.load_model(p) for p in {paths!r}]\n"
        f"np.savez({out!r}, *[m.predict(x, verbose=0) for m in models])\n"
        "assert 'callscope' not in sys.modules, 'callscope was imported'\n"
        "print([(type(m).__name__, int(m.optimizer.iterations)) for m in models])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={"KERAS_BACKEND": BACKEND, "PATH": ""}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[('Functional', 2), ('Sequential', 2)]"
    got = np.load(out)
    for i, want in enumerate(expected):
        np.testing.assert_allclose(got[f"arr_{i}"], want, rtol=1e-6)


@pytest.mark.parametrize("kind", ["cs", "cs_sequential"])
def test_enable_after_load_restores_context_args_and_training(tmp_path, kind):
    model = _stock_mlp(kind, with_shift=True)
    model.register_context_args("debugging")
    plain = model.predict(X, verbose=0)
    np.testing.assert_allclose(model.predict(X, debugging=True, verbose=0), plain + 100.0,
                               rtol=1e-6)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    # The names do not travel in the file (stock Keras would refuse unknown config
    # keys), so they are registered again, as the README says.
    model = cs.enable(loaded)
    assert type(model) is type(_stock_mlp(kind)) and model.context_args == {}
    model.register_context_args("debugging")
    np.testing.assert_allclose(model.predict(X, verbose=0), plain, rtol=1e-6)
    np.testing.assert_allclose(model.predict(X, debugging=True, verbose=0), plain + 100.0,
                               rtol=1e-6)
    # The compile config and the optimizer state came with the file.
    assert model.compiled and int(model.optimizer.iterations) == 2
    model.fit(X, Y, debugging=True, epochs=1, batch_size=2, verbose=0)
    assert int(model.optimizer.iterations) == 4


def _as_saved_by_earlier_callscope(path):
    """Rewrites a file's header the way callscope wrote it before its models saved
    as the stock classes (checked against a file written then): module
    `callscope._model`, registered name `callscope>Functional`/`callscope>Sequential`."""
    with zipfile.ZipFile(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    config = json.loads(members["config.json"])
    config.update(module="callscope._model", registered_name=f"callscope>{config['class_name']}")
    members["config.json"] = json.dumps(config).encode()
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)


@pytest.mark.parametrize("kind", ["cs", "cs_sequential"])
def test_files_saved_by_earlier_versions_still_load(tmp_path, kind):
    model = _stock_mlp(kind)
    path = tmp_path / "old.keras"
    model.save(path)
    _as_saved_by_earlier_callscope(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded) is type(model)
    np.testing.assert_allclose(loaded.predict(X, verbose=0), model.predict(X, verbose=0),
                               rtol=1e-6)
    # Saved again, it is a stock file.
    loaded.save(tmp_path / "again.keras")
    assert _header(tmp_path / "again.keras")["module"].startswith("keras")


def test_export_serves_the_default_and_an_endpoint_serves_a_value(tmp_path):
    # `model.export` traces in a tf.function of its own: a scope value raises
    # there, and an endpoint that passes the value exports it.
    model = cs.Sequential([keras.Input((4,)), HalvesWhenDebugging(name="b0")], name="seq")
    model.register_context_args("debugging")
    x = np.random.default_rng(0).normal(size=(2, 4)).astype("float32")
    plain = model.predict(x, verbose=0)
    if BACKEND == "torch":  # Keras 3.15.1's torch export fails for a stock model too
        stock = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        with pytest.raises(Exception, match="dynamic_shapes"):
            stock.export(str(tmp_path / "stock"), verbose=False)
        return
    import tensorflow as tf

    model.export(str(tmp_path / "plain"), verbose=False)
    served = tf.saved_model.load(str(tmp_path / "plain"))  # held: serve needs its variables
    np.testing.assert_allclose(served.serve(x), plain, rtol=1e-6)
    with pytest.raises(RuntimeError, match=r"`debugging` is set in the caller's scope.*pass "
                                           r"the value to the model's call"):
        with cs.context(debugging=True):
            model.export(str(tmp_path / "scoped"), verbose=False)
    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.add_endpoint("serve", lambda v: model(v, debugging=True),
                         input_signature=[tf.TensorSpec((None, 4), tf.float32)])
    archive.write_out(str(tmp_path / "debugging"), verbose=False)
    served = tf.saved_model.load(str(tmp_path / "debugging"))
    np.testing.assert_allclose(served.serve(x), plain * 0.5, rtol=1e-6)


def _user_trace(model, x):
    """The backend's way to turn the model into code that runs without it."""
    if BACKEND == "torch":  # records the ops that ran, for `torch.jit.save`
        import torch

        traced = torch.jit.trace(model, (torch.tensor(x),), check_trace=False)
        return lambda v: traced(torch.tensor(v)).detach().numpy()
    if BACKEND == "jax":
        import jax

        traced = jax.jit(lambda v: model(v))
        traced(x)
        return lambda v: np.asarray(traced(v))
    import tensorflow as tf

    traced = tf.function(lambda v: model(v))
    traced(x)
    return lambda v: traced(v).numpy()


def test_a_users_trace_under_a_scope_is_refused_and_without_one_serves_plain_values():
    # `torch.jit.trace` under a `cs.patch` or `cs.context` kept the patch or the
    # value in the traced module, which served it outside any scope (after
    # `torch.jit.save` and `load` too), with no error: callscope took the trace for
    # an eager call. It is refused as `jax.jit` and `tf.function` are.
    model = cs.Sequential([keras.Input((4,)), HalvesWhenDebugging(name="b0")], name="seq")
    model.register_context_args("debugging")
    x = np.random.default_rng(0).normal(size=(3, 4)).astype("float32")
    plain = model.predict(x, verbose=0)
    for scope, error in ((lambda: cs.patch(model, {"seq/b0": lambda v: v * 0 + 7}),
                          r"cs.patch cannot record or intervene inside a function it did "
                          r"not compile"),
                         (lambda: cs.capture(model, "seq/b0"), r"cs.capture cannot record"),
                         (lambda: cs.context(debugging=True),
                          r"`debugging` is set in the caller's scope")):
        with pytest.raises(RuntimeError, match=error):
            with scope():
                _user_trace(model, x)
    if BACKEND == "torch":  # (a direct value is checked in a trace as in a call)
        import torch

        model.register_context_args("temperature", dynamic=True)
        model.predict(x, temperature=np.int8(1), verbose=0)
        with pytest.raises(ValueError, match=r"the value does not fit in int8"):
            torch.jit.trace(lambda t: model(t, temperature=300), (torch.tensor(x),),
                            check_trace=False)
    np.testing.assert_allclose(_user_trace(model, x)(x * 2), model.predict(x * 2, verbose=0),
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_user_trace(model, x)(x), plain, rtol=1e-6, atol=1e-6)
