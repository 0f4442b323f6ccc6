"""cs.patch: interventions inside compiled and eager calls, leaving nothing behind."""

import collections
import re

import keras
import numpy as np
import pytest
from conftest import BACKEND, numpy
from models_for_tests import Branching, SkipsOnShortBatches

import callscope as cs

rng = np.random.default_rng(1)
CLEAN = rng.normal(size=(5, 4)).astype("float32")
CORRUPT = CLEAN + rng.normal(size=(5, 4)).astype("float32")


class Block(keras.layers.Layer):
    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(units)

    def call(self, x):
        return keras.ops.relu(cs.sow(self, "pre_act", self.dense(x)))


def _model(jit_compile):
    keras.utils.set_random_seed(0)
    model = cs.Sequential([keras.Input((4,)), Block(8, name="b0"), Block(8, name="b1"),
                           keras.layers.Dense(3, name="logits")], name="tiny")
    model.compile(optimizer="sgd", loss="mse", jit_compile=jit_compile)
    return model


@pytest.mark.parametrize("jit_compile", [False, "auto"])
def test_activation_patching_recovers_the_clean_logits_exactly(jit_compile):
    model = _model(jit_compile)
    clean_logits = model.predict(CLEAN, verbose=0)
    with cs.capture(model, "tiny/b1") as clean:
        model.predict(CLEAN, verbose=0)
    corrupt_logits = model.predict(CORRUPT, verbose=0)
    assert not np.allclose(corrupt_logits, clean_logits)
    clean_b1 = clean["tiny/b1:output"]
    with cs.patch(model, {"tiny/b1": lambda h: keras.ops.convert_to_tensor(clean_b1)}):
        patched = model.predict(CORRUPT, verbose=0)
        eager = numpy(model(CORRUPT))
    np.testing.assert_array_equal(patched, clean_logits)
    np.testing.assert_allclose(eager, clean_logits, rtol=1e-6)
    np.testing.assert_array_equal(model.predict(CORRUPT, verbose=0), corrupt_logits)


def test_patching_a_sown_point_changes_what_follows():
    model = _model("auto")
    base = model.predict(CLEAN, verbose=0)
    with cs.patch(model, {"tiny/b0/pre_act": lambda h: h * 0.0}):
        zeroed = model.predict(CLEAN, verbose=0)
    bias_only = model.layers[1](model.layers[1].dense.weights[1][None, :] * 0.0 + 0.0)
    assert not np.allclose(base, zeroed)
    w, c = (numpy(v) for v in model.get_layer("b1").dense.weights)
    wl, cl = (numpy(v) for v in model.get_layer("logits").weights)
    expected = np.maximum(np.zeros((5, 8)) @ w + c, 0) @ wl + cl
    np.testing.assert_allclose(zeroed, expected, rtol=1e-5, atol=1e-6)
    del bias_only


def test_patch_leaves_no_trace_even_after_an_exception():
    model = _model("auto")
    base = model.predict(CLEAN, verbose=0)
    with pytest.raises(RuntimeError, match="inside"):
        with cs.patch(model, {"tiny/b0": lambda h: h * 0.0}):
            model.predict(CLEAN, verbose=0)
            raise RuntimeError("inside")
    from callscope import _scope

    assert _scope.patches_for(model) == () and _scope.run_of(model) is None
    np.testing.assert_array_equal(model.predict(CLEAN, verbose=0), base)


def test_a_patch_of_a_held_model_that_missed_names_points_as_that_model_does():
    # The hint named the caller's points (`ae/enc/d`), which a patch of `enc` does
    # not take; patched, that name then "is a point of the model that no step of
    # this call ran (a branch not taken)": a wrong reason.
    enc = cs.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d")], name="enc")
    ae = cs.Sequential([keras.Input((4,)), enc, keras.layers.Dense(2, name="head")], name="ae")
    for point in ("enc/dd", "ae/enc/d"):
        with pytest.raises(ValueError, match=rf"never reached \['{point}'\] in this `predict`"
                                             r": .* Nearest points: \['enc', 'enc/d'\]\. "
                           ) as error:
            with cs.patch(enc, {point: keras.ops.zeros_like}):
                ae.predict(CLEAN, verbose=0)
        assert "no step of this call ran" not in str(error.value)
        assert "ae/" not in str(error.value).split("Nearest points")[1].split("Use")[0]


@pytest.mark.parametrize("jit_compile", [False, "auto"])
def test_two_open_patches_of_one_layer_are_refused_and_of_two_layers_both_apply(jit_compile):
    # The inner scope's patch replaced the outer one's, which was lost without a
    # word (same model); across an inner and an outer model the first opened won
    # and the other raised "never reached" while listing its point.
    inner = cs.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="dense")],
                          name="enc")
    inputs = keras.Input((4,))
    outer = cs.Model(inputs, keras.layers.Dense(2, name="head")(inner(inputs)), name="outer")
    outer.compile(jit_compile=jit_compile)
    w, b = (numpy(v) for v in inner.get_layer("dense").weights)
    wh, bh = (numpy(v) for v in outer.get_layer("head").weights)
    h = CLEAN @ w + b

    def head(x):
        return x @ wh + bh

    with cs.patch(outer, {"outer/enc/dense": lambda v: v + 1.0}):
        with pytest.raises(ValueError, match=r"Two open cs.patch scopes patch "
                                             r"`outer/enc/dense` of `outer`.*one function"):
            with cs.patch(outer, {"outer/enc/dense": lambda v: v * 10.0}):
                pass
        # The outer scope is as it was; a patch of another layer adds to it.
        np.testing.assert_allclose(outer.predict(CLEAN, verbose=0), head(h + 1.0),
                                   rtol=1e-5, atol=1e-5)
        with cs.patch(outer, {"outer/head": lambda v: v * 10.0}):
            np.testing.assert_allclose(outer.predict(CLEAN, verbose=0), 10 * head(h + 1.0),
                                       rtol=1e-5, atol=1e-4)
    for first, second in ((inner, outer), (outer, inner)):
        point = {inner: "enc/dense", outer: "outer/enc/dense"}
        with cs.patch(first, {point[first]: lambda v: v + 1.0}), \
                cs.patch(second, {point[second]: lambda v: v * 10.0}):
            with pytest.raises(ValueError, match=r"Two open cs.patch scopes patch "
                                                 r"`(outer/)?enc/dense` \(one layer"):
                outer.predict(CLEAN, verbose=0)
    np.testing.assert_allclose(outer.predict(CLEAN, verbose=0), head(h), rtol=1e-5, atol=1e-5)


def test_patched_runs_in_fit_and_unknown_points_are_named():
    model = _model("auto")
    with cs.patch(model, {"tiny/logits": lambda y: y * 0.0}):
        loss = model.evaluate(CLEAN, np.ones((5, 3)), verbose=0)
    assert loss == pytest.approx(1.0)
    with pytest.raises(ValueError, match=r"never reached \['tiny/b2'\].*tiny/b"):
        with cs.patch(model, {"tiny/b2": lambda h: h}):
            model.predict(CLEAN, verbose=0)
    with pytest.raises(TypeError, match="Received"):
        with cs.patch(model, {"tiny/b0": 3}):
            pass


def test_an_eager_call_that_never_reaches_a_patch_raises_though_an_earlier_one_did():
    # Eager steps (torch's; `run_eagerly` on JAX and TF) run their Python every
    # step, so a call can skip a point that an earlier call with the same patch
    # reached: the key's reached points were shared by every call, and the second
    # call ran unpatched with no error.
    model = Branching(name="net")
    model.compile(loss="mse", run_eagerly=True)
    x = np.ones((4, 2), "float32")
    zero = lambda h: h * 0.0  # noqa: E731 (one function object: one key)
    with cs.patch(model, {"net/a": zero}):
        np.testing.assert_array_equal(model.predict(x, verbose=0), np.zeros((4, 3)))
    model.use_a = False
    with pytest.raises(ValueError, match=r"never reached \['net/a'\] in this `predict`"):
        with cs.patch(model, {"net/a": zero}):
            model.predict(x, verbose=0)


class _ByWidth(cs.Model):
    """Runs `a` for inputs of 2 features only: a batch of 3 features makes another
    trace (on every backend), which never reaches it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.b = keras.layers.Dense(3, name="b", kernel_initializer="ones")
        self.a = keras.layers.Dense(3, name="a", kernel_initializer="ones")

    def call(self, x):
        h = self.b(x[:, :2])
        return self.a(h) if x.shape[-1] == 2 else h


@pytest.mark.filterwarnings("ignore:Gradients do not exist for variables")  # (a skipped)
@pytest.mark.parametrize("method", ["predict", "evaluate", "fit"])
def test_a_call_whose_trace_never_reaches_a_patch_raises_though_an_earlier_trace_did(method):
    # The traces of one key (one patch function) pooled the points they reached: a
    # second call whose batches had another shape, and so another trace that took
    # another branch, ran unpatched with no error because the first call's trace
    # had reached the point (JAX and TF; torch's eager steps were checked per call).
    model = _ByWidth(name="net")
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.0))
    narrow, wide = np.ones((8, 2), "float32"), np.ones((8, 3), "float32")
    zero = lambda h: h * 0.0  # noqa: E731 (one function object: one key)

    def call(x):
        kwargs = {} if method == "predict" else {"y": np.zeros((8, 3), "float32")}
        return getattr(model, method)(x, batch_size=4, verbose=0, **kwargs)

    with cs.patch(model, {"net/a": zero}):
        call(narrow)
        np.testing.assert_array_equal(model.predict(narrow, verbose=0), np.zeros((8, 3)))
    with pytest.raises(ValueError, match=rf"never reached \['net/a'\] in this `{method}`.* "
                       r"\['net/a'\] is a point of the model that no step of this call ran"):
        with cs.patch(model, {"net/a": zero}):
            call(wide)
    if method == "predict":  # both traces in one call: it reached the point
        with cs.patch(model, {"net/a": zero}):
            result = model.predict(_Widths([2, 3]), verbose=0)
        np.testing.assert_array_equal(result, [[0.0] * 3] * 4 + [[2.0] * 3] * 4)


def test_a_call_of_more_steps_than_the_run_holds_numbers_for_is_checked_whole():
    # A run keeps its steps' trace numbers as the steps returned them, and folds
    # them into a set past 256 steps: a trace seen before the fold still counts.
    model = _ByWidth(name="net")
    model.compile(loss="mse")
    zero = lambda h: h * 0.0  # noqa: E731
    with cs.patch(model, {"net/a": zero}):
        out = model.predict(np.ones((300, 2), "float32"), batch_size=1, verbose=0)
    np.testing.assert_array_equal(out, np.zeros((300, 3)))
    with pytest.raises(ValueError, match=r"never reached \['net/a'\]"):
        with cs.patch(model, {"net/a": zero}):
            model.predict(np.ones((300, 3), "float32"), batch_size=1, verbose=0)


def test_a_patch_that_some_steps_of_one_execution_reach_raises_nothing():
    # steps_per_execution=3 puts a predict's three steps (8, 8 and 4 rows) in one TF
    # graph, one trace: the last step's reach (it skips `a`) replaced the others',
    # and a call that patched rows 0:16 raised that it never reached the patch.
    if BACKEND == "torch":
        pytest.skip("Keras's torch backend only supports steps_per_execution=1")
    model = SkipsOnShortBatches(name="net")
    model.compile(loss="mse", steps_per_execution=3)
    x = np.arange(40, dtype="float32").reshape(20, 2) / 40
    with cs.patch(model, {"net/a": lambda h: h * 0.0}):
        out = model.predict(x, batch_size=8, verbose=0)
    np.testing.assert_array_equal(out[:16], np.zeros((16, 3)))
    np.testing.assert_allclose(out[16:], x[16:] @ np.ones((2, 3)), rtol=1e-6)  # b alone


class _Widths(keras.utils.PyDataset):
    """Batches of 4 rows of ones, with `widths[i]` features in batch `i`."""

    def __init__(self, widths):
        super().__init__()
        self.widths = widths

    def __len__(self):
        return len(self.widths)

    def __getitem__(self, index):
        return np.ones((4, self.widths[index]), "float32"), np.zeros((4, 3), "float32")


class _Tables(keras.utils.PyDataset):
    """Batches of an ordered dict whose first entry is the batch (2 rows) and whose
    second, a table of 5 rows, sorts before it."""

    def __len__(self):
        return 3

    def __getitem__(self, index):
        return (collections.OrderedDict([("x", np.zeros((2, 1), "float32")),
                                         ("a_table", np.zeros((5, 1), "float32"))]),)


class _WithTable(cs.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.ident = keras.layers.Identity(name="x")

    def call(self, inputs):
        return self.ident(inputs["x"]) + 0.0 * keras.ops.sum(inputs["a_table"])


def test_a_batch_patch_counts_rows_from_the_first_input_in_keras_order():
    # An ordered dict keeps its order (as keras.tree.flatten does): the batch's
    # rows are its first entry's, not those of the entry whose name sorts first.
    def row_index(value, batch):
        rows = keras.ops.arange(batch.rows) + batch.start
        return keras.ops.cast(keras.ops.reshape(rows, (-1, 1)), value.dtype)

    model = _WithTable(name="m")
    model(_Tables()[0][0])  # built first: see "JAX builds a model" in the README
    with cs.patch(model, {"m/x": row_index}):
        got = model.predict(_Tables(), verbose=0)
    np.testing.assert_array_equal(got[:, 0], np.arange(6.0))


def test_an_array_patch_that_a_cast_would_change_is_refused():
    # An array is cast to the point's dtype: 2.7 onto an int point ran as 2, silently.
    class ArgMax(keras.layers.Layer):
        def call(self, x):
            return keras.ops.argmax(x, axis=-1)

    inputs = keras.Input((4,))
    index = ArgMax(name="am")(inputs)
    model = cs.Model(inputs, keras.layers.Identity(name="out")(index), name="m")
    with cs.patch(model, {"m/am": np.arange(5, dtype="int64") * 3}):
        np.testing.assert_array_equal(numpy(model.predict(CLEAN, verbose=0)), [0, 3, 6, 9, 12])
    with pytest.raises(TypeError, match=r"The array patch of `m/am` holds float\d+ values, and "
                                        r"the point's value is int\d+: the cast would change "
                                        r"them \(2.7 -> 2\).*Received: an array of dtype float"):
        with cs.patch(model, {"m/am": np.full((5,), 2.7)}):
            model.predict(CLEAN, verbose=0)
    np.testing.assert_array_equal(numpy(model.predict(CLEAN, verbose=0)),
                                  np.argmax(CLEAN, axis=-1))


def test_a_patch_array_or_value_of_strings_is_refused_when_the_scope_opens():
    # It reached the backend, whose error named neither the patch nor the point.
    model = cs.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d")], name="m")
    for patch, values, what in [({"m/d": np.array([["a", "b"]] * 5)}, None,
                                 r"The array patch of `m/d`"),
                                ({"m/d": np.full((5, 2), None)}, None, r"The array patch of `m/d`"),
                                ({"m/d": lambda v, values: v}, {"s": np.array(["a"])},
                                 r"values\['s'\]")]:
        with pytest.raises(TypeError, match=what + r" enters the compiled step as a tensor: it "
                           r"takes numbers or bools\. .* Received: an array of numpy dtype"):
            with cs.patch(model, patch, values=values):
                pytest.fail("the scope opened")
    with cs.patch(model, {"m/d": lambda v: v * 0.0}):  # nothing left open
        np.testing.assert_array_equal(model.predict(CLEAN, verbose=0), np.zeros((5, 2)))


@pytest.mark.parametrize("jit_compile", [False, "auto"])
def test_a_patch_function_returns_values_in_the_points_dtype(jit_compile):
    """As an array patch's: the layers after it got whatever dtype it returned, each
    backend reading it its own way (one_hot of floats gave zeros on JAX, a
    truncation on TF and torch)."""
    class ArgMax(keras.layers.Layer):
        def call(self, x):
            return keras.ops.argmax(x, axis=-1)

    inputs = keras.Input((4,))
    index = ArgMax(name="am")(inputs)
    hot = keras.layers.Lambda(lambda i: keras.ops.one_hot(i, 4), name="hot")(index)
    model = cs.Model(inputs, hot, name="m")
    model.compile(jit_compile=jit_compile)
    with pytest.raises(TypeError, match=r"The patch of `m/am` returned float32 values, and the "
                                        r"point's value is int\d+: casting them back would "
                                        r"change them \(2.7 -> 2\).*Received: a value of "
                                        r"dtype float32 for a point of dtype int"):
        with cs.patch(model, {"m/am": lambda i: keras.ops.cast(i, "float32") + 0.5}):
            model.predict(CLEAN, verbose=0)
    # Ints onto a float point, and float16 onto float32, are cast back: no value changes.
    dense = _model(jit_compile)
    h = numpy(keras.ops.relu(dense.get_layer("b0").dense(CLEAN)))
    w, b = (numpy(v) for v in dense.get_layer("b1").dense.weights)
    with cs.capture(dense, "tiny/b1/pre_act") as cap:
        with cs.patch(dense, {"tiny/b0": lambda v: keras.ops.cast(v * 4.0, "int32")}):
            dense.predict(CLEAN, verbose=0)
        with cs.patch(dense, {"tiny/b0": lambda v: keras.ops.cast(v, "float16") * 3.0}):
            dense.predict(CLEAN, verbose=0)
    as_int, halves = (numpy(cap.calls[i]["tiny/b1/pre_act:output"]) for i in range(2))
    assert as_int.dtype == halves.dtype == np.float32
    np.testing.assert_allclose(as_int, np.trunc(h * 4.0) @ w + b, rtol=1e-5, atol=1e-5)
    half = (h.astype(np.float16) * np.float16(3.0)).astype(np.float32)
    np.testing.assert_allclose(halves, half @ w + b, rtol=1e-5, atol=1e-5)


def test_a_batch_patch_needs_one_batch_per_step():
    model = _model(False)
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    with cs.patch(model, {"tiny/b0": np.zeros((len(CLEAN), 8), "float32")}):
        with pytest.raises(ValueError, match=r"needs one batch per compiled step on one "
                                             r"replica, to know each batch's rows: compile "
                                             r"with steps_per_execution=1 \(not 2\)\. "
                                             r"Received: steps_per_execution=2, replicas=1"):
            model.predict(CLEAN, batch_size=2, verbose=0)
    model.compile(optimizer="sgd", loss="mse")
    with cs.patch(model, {"tiny/b0": np.zeros((len(CLEAN), 8), "float32")}):
        patched = model.predict(CLEAN, batch_size=2, verbose=0)
    with cs.patch(model, {"tiny/b0": keras.ops.zeros_like}):
        np.testing.assert_allclose(patched, model.predict(CLEAN, verbose=0), rtol=1e-6)


def test_a_batch_patch_in_a_direct_call_names_the_methods_that_give_the_batch():
    model = _model(False)
    with cs.patch(model, {"tiny/b0": lambda value, batch: value}):
        with pytest.raises(ValueError, match=r"The patch of `tiny/b0` takes the batch .*which "
                                             r"only `predict`, `evaluate` and the \*_on_batch "
                                             r"methods give .*Received: a direct model\(x\) "
                                             r"call"):
            model(CLEAN)
    with cs.patch(model, {"tiny/b0": lambda value: value[:, :2]}):
        with pytest.raises(ValueError, match=r"a patch must keep the shape.*Received: a value "
                                             r"of shape \(5, 2\) for `tiny/b0`"):
            model.predict(CLEAN, verbose=0)


@pytest.mark.parametrize("jit_compile", [False, True] if BACKEND != "torch" else [False])
@pytest.mark.parametrize("method", ["predict", "evaluate"])
@pytest.mark.parametrize("shape", [(4, 3), (4, 3, 1, 1)], ids=["rank2", "rank4"])
def test_a_patch_that_changes_the_shape_on_the_last_batch_only_is_a_value_error(
        jit_compile, method, shape):
    # TF raised its InvalidArgumentError from the graph's check (the message
    # inside it, without the shapes), or the loss's (evaluate: the op after the
    # patch may fail first); under XLA, which drops the check, predict gave 12 rows
    # for 10, silently. JAX and torch raise a ValueError.
    layers = [keras.Input((4,)), keras.layers.Dense(3, name="d")]
    if len(shape) == 4:
        layers += [keras.layers.Reshape((3, 1, 1), name="r"), keras.layers.Flatten()]
    model = cs.Sequential(layers, name="s")
    model.compile(loss="mse", jit_compile=jit_compile)
    point = "s/d" if len(shape) == 2 else "s/r"
    got, want = str(shape), str((2, *shape[1:]))
    x = np.ones((10, 4), "float32")
    data = (x,) if method == "predict" else (x, np.ones((10, 3), "float32"))
    with pytest.raises(ValueError, match=rf"The patch of `{point}` returned a value of shape "
                       + re.escape(got) + r", but the point's value has shape "
                       + re.escape(want) + r": a patch must keep the shape.* Received: a "
                       rf"value of shape {re.escape(got)} for `{point}`"):
        with cs.patch(model, {point: lambda v: keras.ops.zeros(shape)}):
            getattr(model, method)(*data, batch_size=4, verbose=0)
    np.testing.assert_allclose(model.predict(x, verbose=0), numpy(model(x)), rtol=1e-6)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "int4"])
def test_a_narrow_ml_dtypes_patch_array_or_value_applies_on_every_backend(dtype):
    # TF had no kernel to take its rows (a bare InvalidArgumentError), torch
    # converted no such array (a bare TypeError); JAX took it.
    import ml_dtypes

    model = cs.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d")], name="s")
    numbers = np.array([[-1.5, 0.25, 2.0]] * 4 if dtype != "int4" else [[-3, 0, 5]] * 4)
    narrow = numbers.astype(getattr(ml_dtypes, dtype))
    x = np.ones((4, 4), "float32")
    with cs.patch(model, {"s/d": narrow}):
        np.testing.assert_array_equal(model.predict(x, batch_size=3, verbose=0), numbers)
    with cs.patch(model, {"s/d": lambda v, values: keras.ops.add(v * 0.0, values["row"])},
                  values={"row": narrow[0]}):
        np.testing.assert_array_equal(model.predict(x, verbose=0), numbers)


def test_a_widened_patch_array_a_cast_would_change_is_refused_by_its_own_dtype():
    import ml_dtypes

    model = cs.Sequential([keras.Input((2,)), keras.layers.Lambda(
        lambda t: keras.ops.cast(t, "int32"), name="i")], name="s")
    with pytest.raises(TypeError, match=r"The array patch of `s/i` holds float8_e4m3fn values, "
                       r"and the point's value is int32.* Received: an array of dtype "
                       r"float8_e4m3fn for a point of dtype int32"):
        with cs.patch(model, {"s/i": np.full((2, 2), 0.25, ml_dtypes.float8_e4m3fn)}):
            model.predict(np.ones((2, 2), "float32"), verbose=0)


class _Casts(keras.layers.Layer):
    """Sows its input as uint8 and float16, and goes on with both."""

    def call(self, x):
        small = cs.sow(self, "u8", keras.ops.cast(x, "uint8"))
        half = cs.sow(self, "f16", keras.ops.cast(x, "float16"))
        return keras.ops.cast(small, "float32") + keras.ops.cast(half, "float32")


class _TwiceCast(cs.Model):
    """One `_Casts` layer called twice in a call: its points are patched twice."""

    def __init__(self):
        super().__init__(name="net")
        self.c = _Casts(name="c")

    def call(self, x):
        return self.c(x) + self.c(x * 0.0)


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_a_patch_whose_values_the_points_dtype_cannot_hold_raises(run_eagerly):
    # A patch is cast to the point's dtype: 300 as uint8 read 44, -1 read 255,
    # 2**32 + 5 as int32 read 5 and 1e6 as float16 read inf, with no error.
    model = cs.Sequential([keras.Input((3,)), _Casts(name="c")], name="net")
    model.compile(run_eagerly=run_eagerly)
    x = np.ones((4, 3), "float32")
    for point, patch in (("u8", np.full((4, 3), 300)), ("u8", np.full((4, 3), -1, "int32")),
                         ("u8", np.full((4, 3), -1, "int8")),  # (255 as uint8, -1 back)
                         ("u8", lambda v: keras.ops.cast(v, "int32") * 0 + 300),
                         ("f16", np.full((4, 3), 1e6, "float32")),
                         ("f16", lambda v: keras.ops.cast(v, "float32") * 1e6)):
        wanted = {"u8": r"uint8 holds \[0, 255\], and a value past that wraps around",
                  "f16": r"float16 holds finite values up to 65504; past that, inf"}[point]
        with pytest.raises(ValueError, match=rf"The patch of `net/c/{point}` gave (int|float)"
                                             rf"\d+ values .*cannot hold \({wanted}\).*"
                                             rf"Received: .*out of"):
            with cs.patch(model, {f"net/c/{point}": patch}):
                model.predict(x, batch_size=2, verbose=0)
    # Values in range are cast as they were: 255 and 65504 are held.
    with cs.patch(model, {"net/c/u8": np.full((4, 3), 255), "net/c/f16": lambda v: v * 0 + 65504}):
        out = model.predict(x, batch_size=2, verbose=0)
    np.testing.assert_array_equal(out, np.full((4, 3), 255 + 65504, "float32"))
    # A layer called twice: the first call's values overflow, the second's do not.
    twice = _TwiceCast()
    twice.compile(run_eagerly=run_eagerly)
    with pytest.raises(ValueError, match=r"The patch of `net/c/f16` gave float32 values"):
        with cs.patch(twice, {"net/c/f16": lambda v: keras.ops.cast(v, "float32") * 1e6}):
            twice.predict(x, batch_size=2, verbose=0)
    if BACKEND == "jax":  # (64-bit numbers are held as 32-bit there: refused at once)
        with pytest.raises(ValueError, match=r"holds int64 values from 4294967301 to "
                                             r"4294967301, and JAX holds them as int32"):
            cs.patch(model, {"net/c/u8": np.full((4, 3), 2**32 + 5)})
        with pytest.raises(ValueError, match=r"holds float64 values from 1e\+300 to "
                                             r"1e\+300, and JAX holds them as float32"):
            cs.patch(model, {"net/c/f16": np.full((4, 3), 1e300)})


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_a_float32_array_patch_of_a_float32_point_under_mixed_precision_is_exact(run_eagerly):
    # The array's hidden variable (TF, torch) was read inside the layer's float16
    # autocast: 1.0001 read 1.0 and 1e6 read inf, with no error.
    policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = cs.Sequential([keras.Input((3,)), _SowsFloat32(name="c")], name="net")
        model.compile(run_eagerly=run_eagerly)
        x = np.ones((4, 3), "float32")
        patch = np.full((4, 3), 1.0001, "float32")
        patch[0] = 1e6
        with cs.patch(model, {"net/c/f32": patch}):
            out = model.predict(x, batch_size=2, verbose=0)
    finally:
        keras.config.set_dtype_policy(policy)
    np.testing.assert_array_equal(out, patch)


class _SowsFloat32(keras.layers.Layer):
    """A float32 value inside a float16 layer (statistics kept in float32)."""

    def call(self, x):
        return cs.sow(self, "f32", keras.ops.cast(x, "float32") * 1.0)
