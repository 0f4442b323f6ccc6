"""Bad input gets an error that names what was expected, what was received, and the fix."""

import dataclasses
import functools
import re
import typing

import keras
import numpy as np
import pytest
from conftest import BACKEND, numpy
from models_for_tests import HalvesWhenDebugging, ScalesWhenDebugging

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
    assert message.endswith("Received: debuging=True")


# (torch.compile's dynamo warns so as the refusal leaves the frame it traces.)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("mode", ["compiled", "jit_compile", "run_eagerly"])
def test_a_scope_value_its_loss_reads_names_the_model_that_must_register_it(mode):
    # It said "read inside a compiled function" and "Call `outer = cs.enable(outer)`",
    # for a callscope model's own step, compiled or eager, and its loss.
    class Net(cs.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.d = keras.layers.Dense(1)

        def call(self, x):
            return self.d(x)

    def loss(y_true, y_pred):
        return keras.ops.mean((y_true - y_pred) ** 2) * cs.current("foo", default=1.0)

    model = Net(name="net")
    model.compile(optimizer="sgd", loss=loss, run_eagerly=mode == "run_eagerly",
                  jit_compile=mode == "jit_compile")
    for method in ("fit", "evaluate"):  # the first builds and traces; the second does not
        with cs.context(foo=3.0):
            with pytest.raises(cs.StrayValueError) as caught:
                getattr(model, method)(X, X[:, :1], verbose=0)
        message = str(caught.value)
        assert "read in a step of the callscope model `net`" in message, message
        assert "`model.register_context_args('foo')` on `net`" in message
        assert "cs.enable" not in message and "Received: foo=3.0" in message
    model.register_context_args("foo")
    with cs.context(foo=3.0):
        model.evaluate(X, X[:, :1], verbose=0)  # the fix it names


def test_a_name_an_inner_model_registers_and_the_outer_does_not_names_the_outer():
    inner = cs.Sequential([keras.Input((2,)), HalvesWhenDebugging()], name="inner")
    inner.register_context_args("debugging")
    outer = cs.Sequential([keras.Input((2,)), inner], name="outer")
    with cs.context(debugging=True):
        with pytest.raises(cs.StrayValueError) as caught:
            outer.predict(X, verbose=0)
    message = str(caught.value)
    assert "read in a step of the callscope model `outer`" in message, message
    assert "`model.register_context_args('debugging')` on `outer`" in message
    assert "cs.enable" not in message
    outer.register_context_args("debugging")  # the fix it names
    with cs.context(debugging=True):
        np.testing.assert_allclose(outer.predict(X, verbose=0),
                                   outer.predict(X, verbose=0, debugging=False) / 2)


def test_tensor_for_a_static_name_points_to_dynamic(model):
    for value in (np.array(True), keras.ops.ones(())):
        with pytest.raises(TypeError, match=r"dynamic=True.*Received: debugging=") as info:
            model.predict(X, debugging=value, verbose=0)
        assert "register_context_args('debugging', dynamic=True)" in str(info.value)
    # A numpy scalar: said as numpy says it (numpy 2 calls its bool `bool`), with the fix.
    with pytest.raises(TypeError, match=r"`debugging=value.item\(\)`. Received: "
                                        r"debugging=np.True_$"):
        model.predict(X, debugging=np.bool_(True), verbose=0)
    with pytest.raises(TypeError, match=r"Received: debugging=<numpy.ndarray of shape \(2,\)>"):
        model.predict(X, debugging=np.zeros(2), verbose=0)


def test_a_static_name_that_an_enclosing_model_registers_dynamic_names_both():
    # It told the user to register the name with dynamic=True on the model they
    # called, which had done so; the inner model that had not went unnamed.
    class Inner(cs.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.scales = ScalesWhenDebugging()
            self.register_context_args("temp")  # static

        def call(self, x):
            return self.scales(x)

    class Outer(cs.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.inner = Inner()
            self.register_context_args("temp", dynamic=True)

        def call(self, x):
            return self.inner(x)

    with pytest.raises(TypeError, match=r"`temp` is static on `Inner` \(registered without "
                       r"`dynamic=True`\), but its value reached it as a tensor from its "
                       r"caller.*`register_context_args\('temp', dynamic=True\)` on `Inner` "
                       r"too, or static on all. Received: temp="):
        Outer().predict(X, temp=2.0, verbose=0)


def test_unhashable_value_names_the_argument(model):
    expected = r"`debugging` must be hashable.*Received: debugging=\[1, 2\]"
    with pytest.raises(TypeError, match=expected):
        model.predict(X, debugging=[1, 2], verbose=0)
    with pytest.raises(TypeError, match="`debugging`"):
        with cs.context(debugging={"a": 1}):
            model.predict(X, verbose=0)


def test_a_bound_method_of_an_object_hashed_by_identity_is_refused():
    # It is hashed and compared by its object's identity: after `scaler.k = 5`,
    # JAX and TF ran the function traced for k=2 ([2, 2], no warning).
    @cs.context_args("act")
    class Apply(keras.layers.Layer):
        def call(self, x, act=None):
            return x if act is None else act(x)

    class Scaler:
        def __init__(self, k):
            self.k = k

        def apply(self, t):
            return t * self.k

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        k: float
        runs: typing.ClassVar[list] = [0]

        def apply(self, t):
            self.runs[0] += 1
            return t * self.k

        @classmethod
        def triple(cls, t):
            return t * 3.0

    inp = keras.Input((2,))
    model = cs.Model(inp, Apply()(inp))
    model.register_context_args("act")
    scaler = Scaler(2.0)
    refused = (r"`act` is static.*a bound method \(`.*Scaler.apply`\) is keyed by its "
               r"object, a Scaler, which can change after its trace.*Received: act=")
    for value in (scaler.apply, (scaler.apply, 1)):
        with pytest.raises(TypeError, match=refused):
            model.predict(X, act=value, verbose=0)
    with pytest.raises(TypeError, match=refused):
        with cs.context(act=scaler.apply):
            model.predict(X, verbose=0)
    # A method of an object hashed by value, and a classmethod, are static values;
    # methods of equal objects share one trace (a method compares its object by
    # identity: each new Frozen(2.0) traced again).
    runs = []  # Python runs of Frozen.apply: one per trace on JAX and TF
    for value, factor in ((Frozen(2.0).apply, 2.0), (Frozen(2.0).apply, 2.0),
                          (Frozen(5.0).apply, 5.0), (Frozen.triple, 3.0)):
        np.testing.assert_allclose(model.predict(X, act=value, verbose=0), X * factor)
        runs.append(Frozen.runs[0])
    assert runs[1] == (runs[0] * 2 if BACKEND == "torch" else runs[0]), runs
    # The NaN inside a method's object is refused as NaN.
    with pytest.raises(ValueError, match="NaN cannot select a compiled function"):
        model.predict(X, act=Frozen(float("nan")).apply, verbose=0)


@pytest.mark.parametrize("value", ["hot", {"a": 1.0}, [1.0, None]])
def test_a_dynamic_value_that_is_not_numbers_names_what_it_takes(model, value):
    # It said "keeps the dtype of its first value, <U3 ... a <U3 value cannot be
    # held as <U3".
    with pytest.raises(TypeError, match=r"`temperature` takes a number, a bool or an array "
                       rf"of them.*Received: temperature={re.escape(repr(value))} \(numpy dtype "):
        model.predict(X, temperature=value, verbose=0)


def test_tuples_of_static_values_are_keys(model):
    out = model.predict(X, debugging=("a", 1, None), verbose=0)
    assert out.shape == (2, 1)


def test_registration_errors():
    model = cs.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="Received: name='training'"):
        model.register_context_args("training")
    with pytest.raises(ValueError, match="identifiers"):
        model.register_context_args("not a name")
    with pytest.raises(ValueError, match="propagated by Keras.*Received: name='training'"):
        cs.context_args("training")  # (its value would be kept from the layers after it)
    model.register_context_args("mode")
    with pytest.raises(ValueError, match="already registered as static"):
        model.register_context_args("mode", dynamic=True)
    with pytest.raises(TypeError, match="Received: model=Dense"):
        cs.enable(keras.layers.Dense(1))
    with pytest.raises(TypeError, match="decorates a Keras Layer"):
        cs.context_args("flag")(object)
    # A name of an entry point's parameter took the call's own argument, on every
    # backend: `fit(epochs=3)` ran 1 epoch, `fit(verbose=0)` printed a progress bar,
    # `fit(batch_size=2)` ran one batch, `fit(x, y)` took the data as the value.
    for name in ("epochs", "batch_size", "verbose", "x", "callbacks", "steps", "mask",
                 "inputs"):
        with pytest.raises(ValueError, match=rf"`{name}` is .*Name the context argument "
                                             rf"otherwise.*Received: a context argument "
                                             rf"registered as name='{name}'"):
            model.register_context_args(name)
        with pytest.raises(ValueError, match=rf"declared as name='{name}'"):
            cs.context_args(name)
    assert set(model.context_args) == {"mode"}
    with pytest.raises(ValueError, match=r"`evaluate\(\.\.\., steps=\.\.\.\)` would set it"):
        model.register_context_args("steps")


class _Sows(keras.layers.Layer):
    def __init__(self, make, **kwargs):
        super().__init__(**kwargs)
        self.make = make

    def call(self, x):
        cs.sow(self, "v", self.make(x))
        return x


@pytest.mark.parametrize("kind", ["tuple", "dict", "str", "ndarray", "complex"])
@pytest.mark.parametrize("reduce", [None, "mean"])
def test_sowing_anything_but_one_tensor_is_a_type_error(kind, reduce):
    # It gave backend-dependent AttributeErrors, or one statistic over a tuple's
    # tensors stacked together; a numpy array of strings or complex numbers did not
    # say its dtype, and read as if no array were taken.
    make = {"tuple": lambda x: (x, 2 * x), "dict": lambda x: {"a": x},
            "str": lambda x: "hi", "ndarray": lambda x: np.array(["a", "b"]),
            "complex": lambda x: np.array([1 + 2j])}[kind]
    model = cs.Sequential([keras.Input((2,)), _Sows(make, name="s")], name="m")
    for call in (lambda: model.predict(X, verbose=0), lambda: model(X)):
        with pytest.raises(TypeError) as info:
            with cs.capture(model, reduce=reduce):
                call()
        message = str(info.value)
        given = {"ndarray": "ndarray of dtype <U1",
                 "complex": "ndarray of dtype complex128"}.get(kind, kind)
        assert f"cs.sow records one tensor, and `m/s/v` was given a {given}" in message
        assert f"Received: value={given}" in message
        assert ("under a name of its own" in message) == (kind in ("tuple", "dict"))
        assert ("convert other values to a tensor first" in message) == (
            kind not in ("tuple", "dict"))
    np.testing.assert_allclose(model.predict(X, verbose=0), X)  # off: passed through
    # Not recorded nor patched, it is passed through too; discovery lists it.
    dense = cs.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="d"),
                           _Sows(make, name="s")], name="m")
    with cs.capture(dense, "m/d", reduce=reduce) as cap, cs.patch(dense, {"m/d": lambda h: h}):
        dense.predict(X, verbose=0)
    assert list(cap) == ["m/d:output" if reduce is None else "m/d:output/mean"]
    assert "m/s/v" in cs.points(dense, X)


def test_sowing_a_keras_tensor_while_building_a_functional_model_is_refused():
    # Nothing runs that line when the model is called: it recorded nothing, silently.
    sows = _Sows(lambda x: x, name="s")
    inputs = keras.Input((2,))
    hidden = keras.layers.Dense(2, name="d")(inputs)
    with pytest.raises(ValueError, match=r"`cs.sow` was given a symbolic KerasTensor: .*"
                       r"Received: name='h', value=<KerasTensor shape=\(None, 2\)"):
        cs.sow(sows, "h", hidden)
    # A layer that sows inside its `call`, built into a functional model, records.
    model = cs.Model(inputs, sows(hidden), name="m")
    with cs.capture(model, "m/s/v") as cap:
        model.predict(X, verbose=0)
    np.testing.assert_allclose(cap["m/s/v:output"],
                               keras.ops.convert_to_numpy(model.get_layer("d")(X)), rtol=1e-6)


@pytest.mark.parametrize("value", [3.0, 7, np.arange(3.0), np.float64(3.5), np.int64(7)],
                         ids=["float", "int", "array", "np.float64", "np.int64"])
def test_a_sown_number_or_numpy_array_is_recorded_as_a_tensor(value):
    model = cs.Sequential([keras.Input((2,)), _Sows(lambda x: value, name="s")], name="m")
    with cs.capture(model) as cap, cs.capture(model, reduce="mean") as stats:
        model.predict(np.ones((6, 2), "float32"), batch_size=2, verbose=0)  # 3 steps
    expected = np.concatenate([np.reshape(value, (-1,))] * 3)
    np.testing.assert_allclose(cap["m/s/v:output"], expected)
    # float64 is floatx, as Keras converts its inputs: one dtype on every backend.
    # (np.float64 is a Python float too: TF kept float64.) A numpy int keeps its
    # width where the backend holds it: int64 on TF and torch, int32 on JAX.
    wide = "int32" if BACKEND == "jax" else "int64"
    assert cap["m/s/v:output"].dtype == ("int32" if type(value) is int else wide
                                         if isinstance(value, np.int64) else "float32")
    assert stats["m/s/v:output/mean"] == pytest.approx(np.mean(value))


def test_a_sown_integer_the_backend_cannot_hold_is_refused():
    """JAX (without `jax_enable_x64`) holds numpy's int64 as int32: 2**40 + 1 read 1."""
    value = np.array([2**40 + 1, 3], np.int64)
    model = cs.Sequential([keras.Input((2,)), _Sows(lambda x: value, name="s")], name="m")
    if BACKEND != "jax":
        with cs.capture(model) as cap:
            model(X)
        np.testing.assert_array_equal(cap["m/s/v:output"], value)
        return
    with pytest.raises(ValueError, match=r"cs.sow of `m/s/v` was given int64 values from 3 "
                                         r"to 1099511627777, and jax holds them as int32.*"
                                         r"Received: value of dtype int64, min=3, "
                                         r"max=1099511627777"):
        with cs.capture(model):
            model(X)


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


class _AddsInPlace(keras.layers.Layer):
    """Changes its input in place on torch (`+=` on a torch tensor), and sows a
    value it then changes in place too."""

    def call(self, x):
        x += 1.0
        h = cs.sow(self, "h", x * 3.0)
        h *= 2.0
        return h


# torch.compile's dynamo warns from inside its trace of a captured train step where a
# tensor that needs a gradient was changed in place (torch 2.13.0; not without the
# capture); what it computes is right.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("method", ["predict", "fit"])
def test_a_record_changed_in_place_later_is_refused_or_kept_as_recorded(method, jit_compile):
    # torch updated `x += 1` in the recorded tensor itself: the capture showed the
    # changed values. Eager torch now raises; torch.compile (which cannot tell) and
    # the other backends (whose arrays never change) record the value as it was.
    keras.utils.set_random_seed(0)
    model = cs.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="d"),
                           _AddsInPlace(name="add"), keras.layers.Dense(1, name="o")],
                          name="m")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", jit_compile=jit_compile)
    x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
    dense = keras.Model(model.inputs, model.get_layer("d").output).predict(x, verbose=0)

    def run():
        with cs.capture(model, ("m/d", "m/add/h")) as cap:
            if method == "predict":
                model.predict(x, verbose=0)
            else:
                model.fit(x, np.zeros((8, 1)), batch_size=8, shuffle=False, verbose=0)
        return cap

    if keras.backend.backend() == "torch" and not jit_compile:
        with pytest.raises(ValueError, match=r"`m/d` was changed in place after callscope "
                                             r"recorded it.*Received: version \d+ when "
                                             r"recorded, \d+ at the step's end"):
            run()
        # Nothing stays behind: the model runs, and captures what it does not change.
        with cs.capture(model, "m/o") as cap:
            model.predict(x, verbose=0)
        assert cap["m/o:output"].shape == (8, 1)
        return
    cap = run()
    np.testing.assert_allclose(cap["m/d:output"], dense, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cap["m/add/h:output"], (dense + 1.0) * 3.0, rtol=1e-5, atol=1e-5)


def _rematerialized(**scope):
    with keras.RematScope(**scope):
        model = cs.Sequential([keras.Input((2,)), keras.layers.Dense(3, name="d1"),
                               keras.layers.Dense(1, name="d2")], name="r")
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize("how", ["predict", "fit", "__call__", "patch", "intermediate_grads",
                                 "points"])
def test_a_rematerialized_model_is_refused_before_it_runs(how):
    # Measured before this check: lost gradients and points (JAX), points recorded
    # twice (TF eager, torch's fit) and errors from inside the backend's checkpoint.
    model = _rematerialized(mode="full")
    weights = [np.array(w) for w in model.get_weights()]
    with pytest.raises(ValueError) as info:
        if how == "patch":
            with cs.patch(model, {"r/d1": lambda h: h * 0.0}):
                model.predict(X, verbose=0)
        elif how == "intermediate_grads":
            cs.intermediate_grads(model, lambda x: keras.ops.sum(model(x)), X, select="*")
        elif how == "points":
            cs.points(model, X)
        else:
            with cs.capture(model, "*", kinds=("output", "grad") if how == "fit" else ("output",)):
                args = (X, X[:, :1]) if how == "fit" else (X,)
                getattr(model, how)(*args, **({} if how == "__call__" else {"verbose": 0}))
    message = str(info.value)
    assert "outside `keras.RematScope`" in message and "keras.saving.load_model" in message
    assert ("Received: model='r' with 3 rematerialized layers ['r', 'd1', 'd2'] "
            "(mode=full)") in message
    for before, after in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(before, after)  # nothing ran
    from callscope import _scope  # and nothing is left behind

    assert _scope.captures_for(model) == () and _scope.patches_for(model) == ()
    assert _scope.run_of(model) is None


def test_only_the_layers_keras_rematerializes_are_refused():
    with pytest.raises(ValueError, match=r"with 1 rematerialized layers \['d1'\] "
                                         r"\(mode=list_of_layers\)"):
        cs.points(_rematerialized(mode="list_of_layers", layer_names=["d1"]), X)
    # Nothing runs in a checkpoint: mode None (Keras's way to switch it off in an
    # inner scope), no layer named, or a plain activation (it runs inside the
    # recording wrapper). The capture is that of the same model built outside.
    keras.utils.set_random_seed(0)
    reference = _rematerialized(mode=None)
    with cs.capture(reference, "*") as expected:
        reference.predict(X, verbose=0)
    for scope in ({"mode": None}, {"mode": "list_of_layers", "layer_names": ["other"]},
                  {"mode": "activations"}):
        keras.utils.set_random_seed(0)
        model = _rematerialized(**scope)
        with cs.capture(model, "*") as cap:
            model.predict(X, verbose=0)
        assert sorted(cap) == sorted(expected), scope
        for key in expected:
            np.testing.assert_array_equal(cap[key], expected[key], err_msg=str(scope))


def test_a_declared_layer_that_no_model_passes_a_scope_value_raises():
    # A stock model (clone_model's copy of a cs.Sequential) passes nothing: the
    # layer ran with its default under the scope, silently, in predict and fit.
    x = np.ones((2, 4), "float32")
    model = cs.Sequential([keras.Input((4,)), HalvesWhenDebugging(name="b0")], name="seq")
    model.register_context_args("debugging")

    def clone():  # a fresh one per raise: stock JAX loops leave their weights out on one
        copy = keras.models.clone_model(model)
        copy.set_weights(model.get_weights())
        copy.compile(optimizer="sgd", loss="mse")
        return copy

    unregistered = cs.Sequential([keras.Input((4,)), HalvesWhenDebugging(name="b0")], name="other")
    unregistered.compile(optimizer="sgd", loss="mse")
    message = (r"`debugging` is set in the caller's scope \(True\), but `b0` \(which declares "
               r"it with `@cs.context_args`\) is called without it.*Received: debugging=True")
    plain = model.predict(x, verbose=0)
    with cs.context(debugging=True):
        np.testing.assert_allclose(model.predict(x, verbose=0), plain * 0.5, rtol=1e-6)
        for call in (lambda c: c.predict(x, verbose=0), lambda c: c(x),
                     lambda c: c.fit(x, np.zeros((2, 3)), verbose=0),
                     lambda c: c.get_layer("b0")(x)):
            with pytest.raises(RuntimeError, match=message):
                call(clone())
        with pytest.raises(RuntimeError, match="`debugging`"):
            unregistered.predict(x, verbose=0)
        np.testing.assert_allclose(numpy(clone().get_layer("b0")(x, debugging=True)),
                                   plain * 0.5, rtol=1e-6)
    np.testing.assert_allclose(clone().predict(x, verbose=0), plain)


@pytest.mark.parametrize("given", ["scope", "fit"])
def test_a_stock_model_called_in_a_callback_of_a_call_given_a_value_raises(given):
    # Between fit's steps its value is in effect, but a stock model a callback
    # calls is not part of fit's computation. Its declared layer took the value,
    # and its compiled `predict` (JAX, TF) kept it: a later plain predict of it,
    # outside every scope, still halved.
    x = np.ones((2, 4), "float32")
    model = cs.Sequential([keras.Input((4,)), HalvesWhenDebugging(name="b0")], name="seq")
    model.register_context_args("debugging")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")  # (weights stay)
    plain = model.predict(x, verbose=0)
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    seen = []

    class PredictsTheCopy(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            for call in (lambda: copy.predict(x, verbose=0), lambda: copy(x)):
                try:
                    seen.append(numpy(call()))
                except RuntimeError as error:
                    seen.append(error)
            # The callscope model itself takes the value in a callback's call.
            seen.append(self.model.predict(x, verbose=0))

    fit = functools.partial(model.fit, x, np.zeros((2, 3), "float32"), epochs=1, verbose=0,
                            callbacks=[PredictsTheCopy()])
    if given == "scope":
        with cs.context(debugging=True):
            fit()
    else:
        fit(debugging=True)
    for error in seen[:2]:
        assert isinstance(error, cs.StrayValueError), error
        assert re.search(r"`b0` \(which declares it with `@cs.context_args`\) is called "
                         r"without it.*called directly or in a callback.*Received: "
                         r"debugging=True", str(error)), error
    np.testing.assert_allclose(seen[2], plain * 0.5, rtol=1e-6)
    np.testing.assert_allclose(copy.predict(x, verbose=0), plain, rtol=1e-6)


class _RematWrapper(keras.layers.Layer):
    def __init__(self, remat, **kwargs):
        super().__init__(**kwargs)
        self.b = HalvesWhenDebugging(name="blk")
        self.remat = remat

    def call(self, x):
        def body(t):
            return keras.ops.tanh(self.b(t) + t[:, :3])

        return keras.remat(body)(x) if self.remat else body(x)


@pytest.mark.parametrize("how", ["argument", "scope", "train_on_batch"])
def test_a_recomputed_declared_layer_gets_the_models_value(how):
    # A checkpoint's recompute (torch, TF backward) runs the layer outside the
    # model's call: it ran with its default (weights off by ~0.03 after 2 epochs), then
    # was refused; it gets the value the step keys on, as the forward pass did.
    x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
    y = np.ones((8, 1), "float32")

    def trained(remat):
        keras.utils.set_random_seed(0)
        model = cs.Sequential([keras.Input((4,)), _RematWrapper(remat, name="w"),
                               keras.layers.Dense(1)], name="net")
        model.register_context_args("debugging")
        model.compile(optimizer="sgd", loss="mse")
        if how == "argument":
            model.fit(x, y, epochs=2, verbose=0, debugging=True)
        elif how == "scope":
            with cs.context(debugging=True):
                model.fit(x, y, epochs=2, verbose=0)
        else:
            model.train_on_batch(x, y, debugging=True)
        return [numpy(w) for w in model.weights]

    for got, want in zip(trained(True), trained(False)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_the_mixin_after_a_keras_class_is_refused():
    # Keras's `predict` came first in the MRO: a capture stayed empty, silently.
    class Base(keras.Model):
        pass

    for bases, fix in [((keras.Model, cs.ContextMixin), "Model"),
                       ((Base, cs.ContextMixin), "Base")]:
        with pytest.raises(TypeError, match=r"`cs.ContextMixin` must come before the Keras "
                           r"classes among `Net`'s bases.*Write `class Net\(cs.ContextMixin, "
                           + fix + r"\)`.*Received: bases=\['" + fix + "', 'ContextMixin'\\]"):
            type("Net", bases, {})

    class Net(cs.ContextMixin, Base):
        def call(self, x):
            return cs.sow(self, "h", x + 1.0)

    net = Net(name="net")
    with cs.capture(net, "net/h") as cap:
        net.predict(np.ones((2, 2), "float32"), verbose=0)
    np.testing.assert_array_equal(cap["net/h:output"], np.full((2, 2), 2.0))


@pytest.mark.parametrize("traced", [False, True], ids=["first-call", "compiled"])
@pytest.mark.parametrize("method, scope", [
    ("fit", "context"), ("fit", "capture"), ("evaluate", "patch"), ("predict", "capture")])
def test_a_scope_a_callback_opens_during_a_call_is_refused_at_the_next_step(
        traced, method, scope):
    # A JAX or TF step already compiled ran on without it, silently (a capture
    # stayed empty, a patch or context value unapplied); torch and a first trace
    # raised for a context value, torch captured from its eager step.
    model = cs.Sequential([keras.Input((4,)), HalvesWhenDebugging(name="h")])
    model.register_context_args("debugging")
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 4), "float32"), np.ones((8, 3), "float32")
    data = (x, y) if method != "predict" else (x,)
    if traced:
        getattr(model, method)(*data, batch_size=4, verbose=0)
    weights = [numpy(w) for w in model.weights]
    opened = {"context": lambda: cs.context(debugging=True),
              "capture": lambda: cs.capture(model, "*/h"),
              "patch": lambda: cs.patch(model, {"*/h": lambda v: v * 0.0})}[scope]
    hook = {"fit": "train", "evaluate": "test", "predict": "predict"}[method]
    scopes = []

    class Opens(keras.callbacks.Callback):
        pass

    def begin(self, batch, logs=None):
        scopes.append(opened())
        scopes[-1].__enter__()

    setattr(Opens, f"on_{hook}_batch_begin", begin)
    setattr(Opens, f"on_{hook}_batch_end",
            lambda self, batch, logs=None: scopes.pop().__exit__(None, None, None))
    what = {"context": r"`cs.context\(debugging=True\)`", "capture": "A `cs.capture`",
            "patch": "A `cs.patch`"}[scope]
    fix = {"context": r"pass the value to the call \(`fit\(\.\.\., debugging=\.\.\.\)`\)",
           "capture": r"open it around the call \(`with cs.capture\(\.\.\.\): model."
                      + method, "patch": r"open it around the call \(`with cs.patch"}[scope]
    received = {"context": "debugging=True", "capture": "a capture of `sequential",
                "patch": r"patches=\['\*/h'\]"}[scope]
    try:
        with pytest.raises(RuntimeError, match=what + f" was opened while `{method}` runs "
                           r"\(in a callback\), and is not that call's: .* Fix: " + fix
                           + r".*make a call of its own inside the scope.* Received: "
                           + received):
            getattr(model, method)(*data, batch_size=4, verbose=0, callbacks=[Opens()])
    finally:
        while scopes:
            scopes.pop().__exit__(None, None, None)
    # Refused before its first step: the weights are those before the call (on JAX
    # too, where the loop holds them), and the model runs on.
    for before, after in zip(weights, model.weights):
        np.testing.assert_array_equal(numpy(after), before)
    np.testing.assert_allclose(numpy(model(x)), model.predict(x, verbose=0), rtol=1e-6)


def test_a_scope_a_callback_opens_with_the_calls_own_value_or_closes_is_no_error():
    model = cs.Sequential([keras.Input((4,)), HalvesWhenDebugging(name="h")])
    model.register_context_args("debugging")
    x = np.ones((8, 4), "float32")
    seen = []

    class Same(keras.callbacks.Callback):
        def on_predict_batch_begin(self, batch, logs=None):
            self.scope = cs.context(debugging=True)
            self.scope.__enter__()

        def on_predict_batch_end(self, batch, logs=None):
            self.scope.__exit__(None, None, None)
            with cs.context(debugging=False), cs.capture(model, "*/h") as cap:
                self.model.predict_on_batch(x[:2])  # a call of its own inside them
            seen.append(cap["sequential/h:output"])

    halved = model.predict(x, batch_size=4, verbose=0, debugging=True, callbacks=[Same()])
    np.testing.assert_allclose(halved * 2.0, model.predict(x, verbose=0), rtol=1e-6)
    assert len(seen) == 2
    np.testing.assert_allclose(seen[0], halved[:2] * 2.0, rtol=1e-6)


@pytest.mark.parametrize("scope", ["context", "capture", "patch"])
def test_a_scope_exited_by_a_callback_while_a_call_inside_it_runs_stays_open(scope):
    # The call went on applying it (a capture kept filling, a patch kept applying),
    # and a context came back after the call returned.
    model = cs.Sequential([keras.Input((4,)), HalvesWhenDebugging(name="h")])
    model.register_context_args("debugging")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    x, y = np.ones((8, 4), "float32"), np.ones((8, 3), "float32")
    stock = model.predict(x, verbose=0)
    opened = {"context": lambda: cs.context(debugging=True),
              "capture": lambda: cs.capture(model, "*/h"),
              "patch": lambda: cs.patch(model, {"sequential/h": lambda v: v * 0.0})}[scope]()
    what = {"context": r"`cs.context\(debugging=True\)`", "capture": "A `cs.capture`",
            "patch": r"`cs.patch` of \['sequential/h'\]"}[scope]
    errors = []

    class Closes(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            try:
                opened.__exit__(None, None, None)
            except RuntimeError as error:
                errors.append(str(error))

    opened.__enter__()
    try:
        model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[Closes()])
    finally:
        opened.__exit__(None, None, None)  # the right exit, after the call
    assert len(errors) == 2
    assert re.fullmatch(what + r" was exited while `fit`, a call made inside it, runs \(in "
                        r"one of its callbacks\).* It stays open: exit it after the call "
                        r"returns.*", errors[0])
    assert cs.current("debugging") is None
    np.testing.assert_allclose(model.predict(x, verbose=0), stock, rtol=1e-6)
    if scope == "capture":  # both epochs' steps, and nothing after
        assert opened["sequential/h:output"].shape == (16, 3)


def test_a_scope_exited_before_one_opened_inside_it_stays_open():
    # Python's reset put the outer scope back when the inner one exited: it leaked.
    model = cs.Sequential([keras.Input((4,)), HalvesWhenDebugging(name="h")], name="m")
    model.register_context_args("debugging")
    for outer, inner, what in [
            (cs.context(debugging=True), cs.context(debugging=False),
             r"`cs.context\(debugging=True\)`"),
            (cs.capture(model, "m/h"), cs.capture(model, "m"), "A `cs.capture`"),
            (cs.patch(model, {"m/h": lambda v: v}), cs.patch(model, {"m": lambda v: v}),
             r"`cs.patch` of \['m/h'\]")]:
        outer.__enter__()
        inner.__enter__()
        with pytest.raises(RuntimeError, match=what + r" was exited while a scope opened "
                           r"inside it is still open: scopes close innermost first.* It "
                           r"stays open: exit the inner one first"):
            outer.__exit__(None, None, None)
        model.predict(np.ones((2, 4), "float32"), verbose=0)  # (no scope that saw no call)
        inner.__exit__(None, None, None)
        outer.__exit__(None, None, None)
        assert cs.current("debugging") is None


@pytest.mark.parametrize("scope", ["context", "capture", "patch"])
def test_a_scope_a_refused_callback_left_open_ends_with_the_call(scope):
    # A context's exit after the refusal put the call's frame back (the call's
    # `debugging=True` applied to every later call in the thread); a patch went on
    # patching every later call, and a capture recording them.
    model = cs.Sequential([keras.Input((4,)), HalvesWhenDebugging(name="h")])
    model.register_context_args("debugging", "flag")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    x, y = np.ones((8, 4), "float32"), np.ones((8, 3), "float32")
    stock = model.predict(x, verbose=0)
    opened = {"context": lambda: cs.context(flag=True),
              "capture": lambda: cs.capture(model, "sequential/h"),
              "patch": lambda: cs.patch(model, {"sequential/h": lambda v: v * 0.0})}[scope]

    class Opens(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.scope = opened()
            self.scope.__enter__()

    opens = Opens()
    with pytest.raises(RuntimeError, match=r" was opened while `fit` runs"):
        model.fit(x, y, batch_size=4, verbose=0, debugging=True, callbacks=[opens])
    after = model.predict(x, verbose=0)  # before the user's cleanup, too
    opens.scope.__exit__(None, None, None)  # the user's cleanup: nothing to undo
    assert (cs.current("debugging"), cs.current("flag")) == (None, None)
    np.testing.assert_allclose(after, stock, rtol=1e-6)
    np.testing.assert_allclose(model.predict(x, verbose=0), stock, rtol=1e-6)
    if scope == "capture":
        assert list(opens.scope) == []
        with pytest.raises(RuntimeError, match=r"A `cs.capture` is not open: it was exited"):
            opens.scope.__exit__(None, None, None)


def test_a_callback_restating_the_calls_own_dynamic_value_is_no_error():
    model = cs.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.register_context_args("t", dynamic=True)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    x, y = np.ones((8, 4), "float32"), np.ones((8, 3), "float32")
    # (The call holds 0.1 as float32: restated as a Python float, it is the same.)
    for given, restated in [(0.5, 0.5), (0.5, np.float32(0.5)), (np.float32(0.5), 0.5),
                            (0.1, 0.1), (np.float64(0.1), 0.1), (True, True), (3, 3)]:
        class Restates(keras.callbacks.Callback):
            def on_train_begin(self, logs=None, restated=restated):
                self.scope = cs.context(t=restated)
                self.scope.__enter__()

            def on_train_end(self, logs=None):
                self.scope.__exit__(None, None, None)

        model.fit(x, y, batch_size=4, verbose=0, t=given, callbacks=[Restates()])
    with pytest.raises(RuntimeError, match=r"`cs.context\(t=0.25\)` was opened while"):
        class Changes(keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                self.scope = cs.context(t=0.25)
                self.scope.__enter__()

        changes = Changes()
        try:
            model.fit(x, y, batch_size=4, verbose=0, t=0.5, callbacks=[changes])
        finally:
            changes.scope.__exit__(None, None, None)


@pytest.mark.parametrize("given,restated", [(1, 1.5), (1, True), (1.0, 1), ("a", "b")])
def test_a_callback_changing_a_static_value_is_refused_as_its_key_tells_them_apart(
        given, restated):
    # Compared as numbers in the first value's dtype, 1.5 (and True) passed for a
    # static 1, and the compiled step went on with 1, silently.
    model = cs.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.register_context_args("t")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    x, y = np.ones((8, 4), "float32"), np.ones((8, 3), "float32")

    class Opens(keras.callbacks.Callback):
        def __init__(self, value):
            super().__init__()
            self.value = value

        def on_train_begin(self, logs=None):
            self.scope = cs.context(t=self.value)
            self.scope.__enter__()

        def on_train_end(self, logs=None):
            self.scope.__exit__(None, None, None)

    model.fit(x, y, batch_size=4, verbose=0, t=given, callbacks=[Opens(given)])
    changes = Opens(restated)
    with pytest.raises(RuntimeError, match=rf"`cs.context\(t={re.escape(repr(restated))}\)` "
                       r"was opened while `fit` runs"):
        try:
            model.fit(x, y, batch_size=4, verbose=0, t=given, callbacks=[changes])
        finally:
            changes.scope.__exit__(None, None, None)


def test_a_scope_a_callback_opens_as_its_call_returns_is_the_callers_after():
    # Ended with the call whatever happened, a capture and a patch opened in
    # `on_train_end` silently took no later call.
    model = cs.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="h")], name="net")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    x, y = np.ones((8, 4), "float32"), np.ones((8, 3), "float32")
    stock = model.predict(x, verbose=0)

    class OpensAtEnd(keras.callbacks.Callback):
        def on_train_end(self, logs=None):
            self.scopes = [cs.capture(self.model, "net/h"),
                           cs.patch(self.model, {"net/h": lambda v: v * 0.0}),
                           cs.context(mode="late")]
            for scope in self.scopes:
                scope.__enter__()

    opens = OpensAtEnd()
    with pytest.warns(UserWarning, match=r"`cs.context\(mode='late'\)` was opened inside a "
                      r"call .* and was still open when the call returned, so it ended with "
                      r"the call"):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[opens])
    assert cs.current("mode") is None
    patched = model.predict(x, verbose=0)  # the capture and the patch are open
    for scope in reversed(opens.scopes):
        scope.__exit__(None, None, None)
    np.testing.assert_array_equal(patched, np.zeros((8, 3)))
    np.testing.assert_array_equal(opens.scopes[0]["net/h:output"], np.zeros((8, 3)))
    np.testing.assert_allclose(model.predict(x, verbose=0), stock, rtol=1e-6)


def test_a_context_that_nothing_read_warns_that_it_changed_nothing():
    # A stock model's `predict` compiled before the scope ran its trace with the
    # default (JAX, TF), and a misspelt name reached no layer: both silently.
    stock = keras.Sequential([keras.Input((2,)), ScalesWhenDebugging(0.0)])
    stock.predict(X, verbose=0)
    if BACKEND == "torch":  # (eager: the layer runs, and raises)
        with pytest.raises(cs.StrayValueError), cs.context(debugging=True):
            stock.predict(X, verbose=0)
    else:
        with pytest.warns(UserWarning, match=r"`cs.context\(debugging=True\)`: no call inside "
                          r"it looked up `debugging`, so that value changed nothing.* "
                          r"Received: debugging=True"):
            with cs.context(debugging=True):
                np.testing.assert_array_equal(stock.predict(X, verbose=0), X)
    model = cs.Sequential([keras.Input((2,)), ScalesWhenDebugging(0.0)])
    model.register_context_args("debugging")
    with pytest.warns(UserWarning, match=r"`cs.context\(debuging=True\)`: no call inside it "
                      r"looked up `debuging`"):
        with cs.context(debuging=True):
            np.testing.assert_array_equal(model.predict(X, verbose=0), X)
    # Read (and shadowed: the outer one was looked up through the inner one), by
    # a call or by `cs.current`: no warning.
    with cs.context(debugging=False), cs.context(debugging=True):
        np.testing.assert_array_equal(model.predict(X, verbose=0), np.zeros_like(X))
    with cs.context(mode="a"):
        assert cs.current("mode") == "a"
    with pytest.raises(ValueError), cs.context(debuging=True):  # (an error says the rest)
        raise ValueError("x")
    # Each name apart: a misspelt one beside one that is read.
    with pytest.warns(UserWarning, match=r"`cs.context\(debugging=True, debuging_level=2\)`: "
                      r"no call inside it looked up `debuging_level`, so that value changed "
                      r"nothing.* Received: debuging_level=2$"):
        with cs.context(debugging=True, debuging_level=2):
            model.predict(X, verbose=0)
    # A call refused before it read the values reached them: its error says the rest.
    with cs.context(debugging=True), cs.capture(model) as cap:
        with pytest.raises(TypeError, match="bogus"):
            model.predict(X, verbose=0, bogus=1)
    assert len(cap) == 0


def test_the_unread_warning_points_at_the_users_line():
    # As a decorator, contextlib's wrapper exits the scope: the warning named it.
    @cs.context(debuging=True)
    def run():
        return 1

    with pytest.warns(UserWarning, match="looked up `debuging`") as caught:
        run()
    with pytest.warns(UserWarning, match="looked up `mode`") as caught_too:
        with cs.context(mode=1):
            pass
    assert [w.filename for w in (*caught, *caught_too)] == [__file__, __file__]


def test_a_refusal_in_another_thread_leaves_this_scope_unread():
    # Any refusal anywhere in the process (a process-wide count) silenced the
    # warning of every scope open at the time.
    import threading

    def refused():  # a fresh thread: its own (empty) context
        stock = keras.Sequential([keras.Input((2,)), ScalesWhenDebugging(0.0)])
        with cs.context(debugging=True):
            try:
                stock.predict(X, verbose=0)  # (its first call: refused on each backend)
            except cs.StrayValueError:
                errors.append("refused")

    errors = []
    with pytest.warns(UserWarning, match=r"no call inside it looked up `debuging`"):
        with cs.context(debuging=True):
            thread = threading.Thread(target=refused)
            thread.start()
            thread.join()
    assert errors == ["refused"]


class _ReadsScale(keras.layers.Layer):
    def call(self, x):
        return x * cs.current("scale", default=1.0)


class _OpensAScope(cs.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.reads = _ReadsScale(name="reads")

    def call(self, x):
        with cs.context(scale=2.0):  # inside the call (and a compiled step's trace)
            return self.reads(x)


def test_a_context_opened_and_read_inside_a_compiled_step_is_read():
    # Lookups inside a step's sealed frame marked nothing: it warned that nothing
    # read the value it had just used.
    model = _OpensAScope(name="opens")
    np.testing.assert_allclose(model.predict(X, verbose=0), 2.0 * X, rtol=1e-6)
    np.testing.assert_allclose(numpy(model(X)), 2.0 * X, rtol=1e-6)


def test_a_context_value_a_call_overrides_or_refuses_is_told_apart():
    model = cs.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    model.register_context_args("debugging")
    # Given to the call, the value wins: the scope changed nothing.
    with pytest.warns(UserWarning, match=r"no call inside it looked up `debugging`"):
        with cs.context(debugging=True):
            model.predict(X, verbose=0, debugging=False)
    # A direct call refused under a capture reached the scope: its error says the rest.
    with cs.context(debugging=True), cs.capture(model, "*", kinds=("grad",)):
        with pytest.raises(ValueError, match="loss"):
            model(X)
