"""One compiled function per static value: no retrace when switching, no stale trace."""

import math
import re
import warnings

import keras
import numpy as np
import pytest
from conftest import BACKEND

import callscope as cs

X = np.arange(8, dtype="float32").reshape(4, 2)
Y = X.sum(axis=1, keepdims=True)


def _counting_model(jit_compile="auto"):
    traces = []

    @cs.context_args("mode")
    class Scale(keras.layers.Layer):
        def call(self, x, mode=None):
            traces.append(mode)  # runs in Python once per trace (jax, tf)
            return x * {None: 1.0, "double": 2.0, "triple": 3.0}.get(mode, -1.0)

    @cs.context_args("mode")
    class Net(cs.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)
            self.scale = Scale()

        def call(self, x):
            return self.scale(self.dense(x))

    net = Net()
    net.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", jit_compile=jit_compile)
    return net, traces


def _builds(model):
    """Counts how many compiled functions Keras makes (every backend)."""
    counts = {"predict": 0, "test": 0, "train": 0}
    for kind in counts:
        original = getattr(model, f"make_{kind}_function")

        def make(*args, _kind=kind, _original=original, **kwargs):
            if getattr(model, f"{_kind}_function") is None:
                counts[_kind] += 1
            return _original(*args, **kwargs)

        setattr(model, f"make_{kind}_function", make)
    return counts


@pytest.mark.parametrize("jit_compile", [False, True] if BACKEND != "torch" else [False])
def test_switching_values_never_retraces_and_never_reuses_the_wrong_trace(jit_compile):
    net, traces = _counting_model(jit_compile)
    builds = _builds(net)
    modes = [None, "double", None, "triple", "double", None, "triple"] * 2
    for mode in modes:
        out = net.predict(X, mode=mode, verbose=0)
        np.testing.assert_allclose(out, Y * {None: 1, "double": 2, "triple": 3}[mode])
    assert builds["predict"] == 3
    if BACKEND == "tensorflow" or (BACKEND == "jax" and jit_compile):
        # One trace per value (the symbolic build adds one default-valued call).
        assert sorted(set(traces), key=str) == sorted({None, "double", "triple"}, key=str)
        assert traces.count("double") == 1 and traces.count("triple") == 1
    for mode in ["double", None, "triple"] * 2:
        expected = (Y * {None: 1, "double": 2, "triple": 3}[mode] - Y) ** 2
        assert net.evaluate(X, Y, mode=mode, verbose=0) == pytest.approx(expected.mean())
    assert builds["test"] == 3


def test_torch_compile_gives_the_right_values_per_key():
    if BACKEND != "torch":
        pytest.skip("torch.compile is the torch backend's jit_compile")
    net, _ = _counting_model(jit_compile=True)
    for mode in ["double", None, "triple", "double", None]:
        out = net.predict(X, mode=mode, verbose=0)
        np.testing.assert_allclose(out, Y * {None: 1, "double": 2, "triple": 3}[mode])


def test_compile_again_clears_the_cache():
    net, traces = _counting_model()
    builds = _builds(net)
    net.predict(X, mode="double", verbose=0)
    net.predict(X, verbose=0)
    net.compile(optimizer="sgd", loss="mse")
    net.predict(X, mode="double", verbose=0)
    net.predict(X, verbose=0)
    assert builds["predict"] == 4


@pytest.mark.filterwarnings("ignore:Layer InputLayer does not have a `quantize` method")
def test_quantize_drops_every_keys_functions():
    # Keras drops its own compiled functions when `quantize` changes a layer; on
    # TF, a key's function compiled before (a context value, a capture) went on
    # running the float kernels: predict(mode="a") gave the float model's output.
    x = np.random.default_rng(0).normal(size=(8, 6)).astype("float32")
    keras.utils.set_random_seed(1)
    model = cs.Sequential([keras.Input((6,)), keras.layers.Dense(8, name="d1"),
                           keras.layers.Dense(3, name="d2")], name="s")
    model.compile(optimizer="sgd", loss="mse")
    model.register_context_args("mode")
    floats = model.predict(x, mode="a", verbose=0)
    with cs.capture(model, "s/d1"):
        model.predict(x, verbose=0)
    model.quantize("int8")
    quantized = keras.ops.convert_to_numpy(model(x))
    assert np.abs(quantized - floats).max() > 1e-3  # (else the test could not tell)
    np.testing.assert_array_equal(model.predict(x, mode="a", verbose=0), quantized)
    with cs.capture(model, "s/d1") as cap:
        model.predict(x, verbose=0)
    np.testing.assert_array_equal(
        cap["s/d1:output"], keras.ops.convert_to_numpy(model.get_layer("d1")(x)))


@pytest.mark.parametrize("size", [None, 0, -1, 2.5, True])
def test_a_cache_size_the_table_cannot_keep_is_refused(size):
    # None failed on a bare `int()` at a new key; 0 and -1 silently meant 1.
    net, _ = _counting_model()
    net.context_cache_size = size
    with pytest.raises(ValueError, match=r"`context_cache_size` is how many distinct "
                       r"non-default keys .*a whole number, 1 or more .*Received: "
                       rf"context_cache_size={re.escape(repr(size))}$"):
        net.predict(X, mode="double", verbose=0)
    net.context_cache_size = 1
    np.testing.assert_allclose(net.predict(X, mode="double", verbose=0),
                               net.predict(X, verbose=0) * 2, rtol=1e-6)


def test_the_cache_is_bounded_and_evicts_with_a_warning():
    net, _ = _counting_model()
    net.context_cache_size = 2
    builds = _builds(net)
    net.predict(X, mode="double", verbose=0)
    net.predict(X, mode="triple", verbose=0)
    with pytest.warns(UserWarning, match="context_cache_size=2"):
        net.predict(X, mode="other", verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        net.predict(X, mode="triple", verbose=0)  # still cached: no warning
    assert builds["predict"] == 3
    with pytest.warns(UserWarning, match="evicted") as caught:
        net.predict(X, mode="double", verbose=0)  # evicted before: rebuilt
    assert builds["predict"] == 4
    # The warning names the user's line, whatever the entry point's depth.
    evictions = [w for w in caught if "evicted" in str(w.message)]
    assert {w.filename for w in evictions} == {__file__}, [(w.filename, w.lineno)
                                                            for w in evictions]
    with pytest.warns(UserWarning, match="evicted") as caught:
        net.predict_on_batch(X, mode="other")
    assert {w.filename for w in caught if "evicted" in str(w.message)} == {__file__}


def test_unused_model_leaves_keras_functions_in_place():
    model = cs.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(loss="mse")
    model.predict(X, verbose=0)
    first = model.predict_function
    model.predict(X, verbose=0)
    assert model.predict_function is first is not None


def test_minus_zero_and_zero_select_their_own_functions():
    # -0.0 == 0.0, yet a layer can tell them apart (copysign, 1 / x): one key each.
    @cs.context_args("offset")
    class Sign(keras.layers.Layer):
        def call(self, x, offset=None):
            first = offset[0] if isinstance(offset, tuple) else offset
            return x if offset is None else x * math.copysign(1.0, first)

    model = cs.Sequential([keras.Input((2,)), Sign(name="sign")], name="seq")
    model.register_context_args("offset")
    for offset in (0.0, -0.0, 0.0, (-0.0, 1)):
        sign = math.copysign(1.0, offset if isinstance(offset, float) else offset[0])
        np.testing.assert_array_equal(model.predict(X, offset=offset, verbose=0), X * sign)
        with cs.context(offset=offset):
            np.testing.assert_array_equal(model.predict(X, verbose=0), X * sign)


def _typed_model():
    """A layer that tells values apart by type (`isinstance`), as user code may."""
    @cs.context_args("cfg")
    class ByType(keras.layers.Layer):
        def call(self, x, cfg=None):
            return x * float(getattr(cfg, "factor", 1))

    model = cs.Sequential([keras.Input((2,)), ByType(name="by_type")], name="seq")
    model.register_context_args("cfg")
    return model


def test_a_namedtuple_and_a_tuple_of_equal_items_select_their_own_functions():
    # `(1, 2) == Cfg(1, 2)`: they shared one key, and the tuple ran Cfg's trace.
    import collections

    cfg = collections.namedtuple("Cfg", "factor other")
    other = collections.namedtuple("Other", "a b")
    model = _typed_model()
    for value, factor in ((cfg(100, 2), 100), ((100, 2), 1), (other(100, 2), 1),
                          (cfg(100, 2), 100)):
        np.testing.assert_array_equal(model.predict(X, cfg=value, verbose=0), X * factor)


def test_equal_members_of_two_classes_of_one_name_select_their_own_functions():
    import enum

    def make(factor):
        class Mode(enum.IntEnum):
            X = 1

        Mode.factor = property(lambda self: factor)
        return Mode

    first, second = make(10), make(20)
    assert first.X == second.X and first.__qualname__ == second.__qualname__
    model = _typed_model()
    for member, factor in ((first.X, 10), (second.X, 20), (first.X, 10)):
        np.testing.assert_array_equal(model.predict(X, cfg=member, verbose=0), X * factor)


def test_a_static_value_that_may_change_is_refused_and_immutable_ones_are_keys():
    class Cfg:  # hashed by identity, changed after its first trace
        factor = 2.0

    model = _typed_model()
    with pytest.raises(TypeError, match=r"`cfg` is static \(the model's context arguments: "
                       r"cfg \(static\)\).*A value of type Cfg is hashed by identity.*"
                       r"frozen dataclass.*"
                       r"Received: cfg=<test_compiled_keys"):
        model.predict(X, cfg=Cfg(), verbose=0)
    with pytest.raises(TypeError, match=r"Received: cfg=\(1, \[2\]\)$"):
        model.predict(X, cfg=(1, [2]), verbose=0)  # the value passed, not its item
    for value in (frozenset({"a"}), b"a", 1j, ("a", frozenset({1})), np.dtype("float32"),
                  keras.activations.relu, keras.layers.Dense):
        np.testing.assert_array_equal(model.predict(X, cfg=value, verbose=0), X)


def test_a_dataclass_is_keyed_by_the_type_and_value_of_every_field():
    """A frozen dataclass's own `==` merges `Cfg(0.0)` and `Cfg(-0.0)`, `Cfg(1)`
    and `Cfg(True)`: the second value of each pair ran the trace of the first (on
    torch, eagerly, with the first value). Keyed by its compared fields as a
    namedtuple is (a `compare=False` field, a cache, is left out, as `==` leaves
    it); a compared field that cannot be a key (NaN, a list) is refused, and so
    is a dataclass that is not frozen (changed after its trace, it ran with the
    value it had then), naming the value passed."""
    import dataclasses
    import math

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        v: object
        cache: dict = dataclasses.field(default_factory=dict, compare=False)

    @dataclasses.dataclass(unsafe_hash=True)
    class Mutable:
        v: float

    @cs.context_args("cfg")
    class Branching(keras.layers.Layer):
        def call(self, x, cfg=None):
            if cfg is None:
                return x
            if isinstance(cfg.v, bool):
                return x * 0.0 if cfg.v else x
            return x * math.copysign(1.0, cfg.v)

    model = cs.Sequential([keras.Input((2,)), Branching(name="b")], name="seq")
    model.register_context_args("cfg")
    for value, factor in ((Cfg(0.0), 1.0), (Cfg(-0.0), -1.0), (Cfg(1), 1.0),
                          (Cfg(True), 0.0), (Cfg(-0.0, {"a": [1]}), -1.0)):
        np.testing.assert_array_equal(model.predict(X, cfg=value, verbose=0), X * factor,
                                      err_msg=repr(value))
    with pytest.raises(ValueError, match=r"NaN cannot select.*Received: cfg=.*Cfg\(v"):
        model.predict(X, cfg=Cfg(float("nan")), verbose=0)
    with pytest.raises(TypeError, match=r"must be hashable.*Received: cfg=.*Cfg\(v"):
        model.predict(X, cfg=Cfg([1.0]), verbose=0)
    with pytest.raises(TypeError, match=r"a Mutable can change after its trace.*"
                       r"frozen=True.*Received: cfg=.*Mutab"):
        model.predict(X, cfg=Mutable(5.0), verbose=0)


def test_values_hashed_by_value_are_keys_by_value():
    import collections
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Frozen:  # hashed by value: equal configs, one key
        factor: float

    class Rounded(float):  # its own repr rounds: the key is the float's
        def __repr__(self):
            return f"{float(self):.1f}"

    traces = []

    @cs.context_args("cfg")
    class Counted(keras.layers.Layer):
        def call(self, x, cfg=None):
            traces.append(1)
            return x if cfg is None else x * float(getattr(cfg, "factor", cfg))

    model = cs.Sequential([keras.Input((2,)), Counted(name="counted")], name="seq")
    model.register_context_args("cfg")
    for value, factor in ((Frozen(3.0), 3.0), (Frozen(3.0), 3.0), (Frozen(4.0), 4.0),
                          (Rounded(2.01), 2.01), (Rounded(2.02), 2.02)):
        np.testing.assert_allclose(model.predict(X, cfg=value, verbose=0), X * factor,
                                   rtol=1e-6)
    # A namedtuple class made per call is one key by its name and fields (its
    # class object was a key each call: a trace per call, evicted past the bound).
    for _ in range(3):
        value = collections.namedtuple("Cfg", "factor")(5.0)
        np.testing.assert_allclose(model.predict(X, cfg=value, verbose=0), X * 5.0)
    if BACKEND != "torch":  # (torch runs `call` eagerly every step)
        before = len(traces)
        for value in (Frozen(3.0), Rounded(2.02), collections.namedtuple("Cfg", "factor")(5.0)):
            model.predict(X, cfg=value, verbose=0)
        assert len(traces) == before
