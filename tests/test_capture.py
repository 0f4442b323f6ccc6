"""Capture inside compiled fit/evaluate/predict, compared with an eager numpy reference."""

import enum
import os
import re

import keras
import numpy as np
import pytest
from conftest import BACKEND, numpy

import callscope as cs

rng = np.random.default_rng(0)
X = rng.normal(size=(10, 4)).astype("float32")
Y = rng.normal(size=(10, 2)).astype("float32")
JIT = [False, "auto"]


class Block(keras.layers.Layer):
    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(units, name="dense")

    def call(self, x):
        h = cs.sow(self, "pre_act", self.dense(x))
        return keras.ops.relu(h)


class Net(cs.Model):
    def __init__(self):
        super().__init__(name="net")
        self.block_0 = Block(8, name="block_0")
        self.block_1 = Block(2, name="block_1")

    def call(self, x):
        return self.block_1(self.block_0(x))


def _net(jit_compile="auto", lr=0.0):
    keras.utils.set_random_seed(0)
    net = Net()
    net.compile(optimizer=keras.optimizers.SGD(lr), loss="mse", jit_compile=jit_compile)
    net(X[:1])
    return net


def _reference(net, x):
    """Eager numpy forward pass: every intermediate."""
    out = {}
    h = x
    for block in (net.block_0, net.block_1):
        w, b = (numpy(v) for v in block.dense.weights)
        pre = h @ w + b
        out[f"net/{block.name}/pre_act:output"] = pre
        out[f"net/{block.name}/{block.dense.name}:output"] = pre
        out[f"net/{block.name}:input"] = h
        out[f"net/{block.name}/{block.dense.name}:input"] = h
        h = np.maximum(pre, 0)
        out[f"net/{block.name}:output"] = h
    return out


@pytest.mark.parametrize("jit_compile", JIT)
def test_sown_values_from_predict_match_the_eager_reference(jit_compile):
    net = _net(jit_compile)
    plain = net.predict(X, verbose=0)
    with cs.capture(net) as cap:
        out = net.predict(X, batch_size=4, verbose=0)
    np.testing.assert_allclose(out, plain, rtol=1e-6)  # return structure unchanged
    ref = _reference(net, X)
    assert sorted(cap) == ["net/block_0/pre_act:output", "net/block_1/pre_act:output"]
    for key in cap:
        np.testing.assert_allclose(cap[key], ref[key], rtol=1e-5, atol=1e-6)


class _Batches(keras.utils.PyDataset):
    """X and Y in batches of 4 (the last one 2): data of no known shape ahead."""

    def __len__(self):
        return 3

    def __getitem__(self, index):
        return X[index * 4:index * 4 + 4], Y[index * 4:index * 4 + 4]


@pytest.mark.parametrize("method", ["predict", "evaluate", "fit"])
def test_an_unbuilt_model_built_by_its_first_step_is_captured_and_patched(method):
    # Data of no known shape: Keras builds the subclassed model inside its first
    # step, in a shape-only call of it (`compute_output_spec`) on the step's own
    # tensors. What that call recorded went into the step (TF: tensors of its
    # scratch graph, InaccessibleTensorError; torch: meta tensors, "Cannot copy
    # out of meta tensor").
    keras.utils.set_random_seed(0)
    net = Net()
    net.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")  # (fit keeps the weights)
    run = getattr(net, method)
    kwargs = {"shuffle": False} if method == "fit" else {}
    with cs.capture(net, ["net/*/pre_act", "net/block_0/dense"]) as cap:
        run(_Batches(), verbose=0, **kwargs)
    ref = _reference(net, X)
    assert sorted(cap) == ["net/block_0/dense:output", "net/block_0/pre_act:output",
                           "net/block_1/pre_act:output"]
    for key in cap:
        np.testing.assert_allclose(cap[key], ref[key], rtol=1e-5, atol=1e-6)
    keras.utils.set_random_seed(0)
    net = Net()
    with cs.patch(net, {"net/block_0/pre_act": lambda h: h * 0.0}):
        out = net.predict(_Batches(), verbose=0)
    bias = numpy(net.block_1.dense.weights[1])
    np.testing.assert_allclose(out, np.broadcast_to(np.maximum(bias, 0), (10, 2)), rtol=1e-6)


@pytest.mark.parametrize("jit_compile", JIT)
@pytest.mark.parametrize("method", ["evaluate", "predict_on_batch", "test_on_batch", "__call__"])
def test_every_inference_entry_point_captures(method, jit_compile):
    net = _net(jit_compile)
    ref = _reference(net, X)
    with cs.capture(net, "net/block_*", kinds=("input", "output")) as cap:
        if method == "evaluate":
            net.evaluate(X, Y, batch_size=3, verbose=0)
        elif method == "test_on_batch":
            net.test_on_batch(X, Y)
        elif method == "predict_on_batch":
            net.predict_on_batch(X)
        else:
            net(X)
    assert {"net/block_0:input", "net/block_1:output", "net/block_0/dense:output"} <= set(cap)
    for key in cap:
        np.testing.assert_allclose(cap[key], ref[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("jit_compile", JIT)
def test_fit_captures_every_step_in_order_and_logs_are_unchanged(jit_compile):
    net = _net(jit_compile, lr=0.0)
    plain = net.fit(X, Y, batch_size=4, epochs=1, verbose=0, shuffle=False).history
    history = keras.callbacks.History()
    with cs.capture(net, ["net/block_1"]) as cap:
        result = net.fit(X, Y, batch_size=4, epochs=2, verbose=0, shuffle=False,
                         validation_data=(X, Y), callbacks=[history])
    assert set(result.history) == {"loss", "val_loss"}
    assert result.history["loss"][0] == pytest.approx(plain["loss"][0], rel=1e-6)
    ref = _reference(net, X)["net/block_1:output"]
    assert list(cap) == ["net/block_1:output"]
    # two epochs of three batches (4, 4, 2); validation is not captured in fit
    np.testing.assert_allclose(cap["net/block_1:output"], np.concatenate([ref, ref]),
                               rtol=1e-5, atol=1e-6)
    with cs.capture(net, "net/block_0") as cap:
        net.train_on_batch(X, Y)
    np.testing.assert_allclose(cap["net/block_0:output"], _reference(net, X)["net/block_0:output"],
                               rtol=1e-5, atol=1e-6)


def test_fit_capture_sees_the_training_step_values():
    net = _net(lr=0.1)
    before = _reference(net, X[:5])["net/block_0:output"]
    with cs.capture(net, "net/block_0") as cap:
        net.fit(X, Y, batch_size=5, epochs=1, verbose=0, shuffle=False)
    np.testing.assert_allclose(cap["net/block_0:output"][:5], before, rtol=1e-5, atol=1e-6)
    after_first = cap["net/block_0:output"][5:]
    assert not np.allclose(after_first, _reference(_net(), X)["net/block_0:output"][5:])


class PositionLike(keras.layers.Layer):
    """Returns a view of its weight, as keras_hub's PositionEmbedding does (a slice,
    broadcast), and sows the weight itself."""

    def build(self, shape):
        self.table = self.add_weight(shape=(8, shape[-1]), initializer="ones", name="table")

    def call(self, x):
        cs.sow(self, "table", self.table)
        cs.sow(self, "value", self.table.value)  # TF: a tf.Variable; torch: the Parameter
        n = keras.ops.shape(x)[1]
        return x + keras.ops.broadcast_to(self.table[:n], keras.ops.shape(x))


def _position_model(jit_compile):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3, 2))
    model = cs.Model(inputs, PositionLike(name="pos")(inputs), name="m")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=jit_compile)
    return model


# (torch.compile: dynamo's own probe of a non-leaf tensor, see test_torch_compile.py)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
@pytest.mark.parametrize("jit_compile", JIT + ([True] if BACKEND == "torch" else []))
def test_fit_records_each_weight_as_its_step_used_it(jit_compile):
    # Records are read when the step ends, after the optimizer's update; torch
    # updates weights in place, so a view of one read then would show the next
    # step's weight (and TF read a sown variable then).
    x = np.random.default_rng(1).normal(size=(12, 3, 2)).astype("float32")
    y = np.zeros_like(x)
    twin, used = _position_model(jit_compile), []
    for start in range(0, 12, 4):  # the reference: the weight before each step
        used.append(numpy(twin.get_layer("pos").table))
        twin.train_on_batch(x[start:start + 4], y[start:start + 4])
    assert not np.allclose(used[0], used[-1])
    model = _position_model(jit_compile)
    with cs.capture(model, ["m/pos", "m/pos/table", "m/pos/value"]) as cap, \
            cs.capture(model, "m/pos/table", reduce=("mean", "max")) as stats:
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(cap["m/pos/table:output"].reshape(3, 8, 2), used, rtol=1e-6)
    np.testing.assert_allclose(cap["m/pos/value:output"].reshape(3, 8, 2), used, rtol=1e-6)
    outputs = cap["m/pos:output"].reshape(3, 4, 3, 2)
    for step, table in enumerate(used):
        np.testing.assert_allclose(outputs[step], x[step * 4:step * 4 + 4] + table[:3],
                                   rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["m/pos/table:output/mean"], [t.mean() for t in used],
                               rtol=1e-5)
    np.testing.assert_allclose(stats["m/pos/table:output/max"], [t.max() for t in used],
                               rtol=1e-6)


def test_capture_off_restores_the_original_compiled_function():
    net = _net()
    net.predict(X, verbose=0)
    original = net.predict_function
    with cs.capture(net) as cap:
        net.predict(X, verbose=0)
    assert len(cap) == 2
    net.predict(X, verbose=0)
    assert net.predict_function is original
    with cs.capture(net):
        net.predict(X, verbose=0)
    assert net.predict_function is original


def test_sow_outside_a_capture_is_the_identity_and_adds_nothing():
    layer = keras.layers.Dense(2)
    value = np.ones((1, 2))
    assert cs.sow(layer, "x", value) is value
    net = _net()
    net.predict(X, verbose=0)
    out = net.predict_function
    assert not getattr(out, "_callscope_popper", False)


@pytest.mark.parametrize("kind", ["sequential", "functional", "enabled", "nested"])
def test_capture_on_every_model_kind(kind):
    keras.utils.set_random_seed(0)
    if kind == "sequential":
        model = cs.Sequential([keras.Input((4,)), Block(3, name="blk")])
    elif kind == "functional":
        inputs = keras.Input((4,))
        model = cs.Model(inputs, Block(3, name="blk")(inputs))
    elif kind == "enabled":
        model = cs.enable(keras.Sequential([keras.Input((4,)), Block(3, name="blk")]))
    else:  # a functional sub-model inside a subclassed model
        inputs = keras.Input((4,))
        inner = keras.Model(inputs, Block(3, name="blk")(inputs), name="inner")

        class Outer(cs.Model):
            def __init__(self):
                super().__init__(name="outer")
                self.inner = inner

            def call(self, x):
                return self.inner(x) * 2.0

        model = Outer()
    with cs.capture(model, "*blk*") as cap:
        out = model.predict(X, verbose=0)
    blk = next(layer for layer in model._flatten_layers() if layer.name == "blk")
    w, b = (numpy(v) for v in blk.dense.weights)
    pre = X @ w + b
    sown = [k for k in cap if k.endswith("pre_act:output")]
    assert len(sown) == 1, list(cap)
    np.testing.assert_allclose(cap[sown[0]], pre, rtol=1e-5, atol=1e-6)
    outputs = [k for k in cap if k.endswith("blk:output")]
    np.testing.assert_allclose(cap[outputs[0]], np.maximum(pre, 0), rtol=1e-5, atol=1e-6)
    assert out.shape == (10, 3)


def test_a_point_called_twice_gets_at_indices():
    class Twice(cs.Model):
        def __init__(self):
            super().__init__(name="twice")
            self.shared = keras.layers.Dense(4, name="shared")

        def call(self, x):
            return self.shared(self.shared(x))

    model = Twice()
    with cs.capture(model, "twice/shared") as cap:
        model.predict(X, verbose=0)
    assert sorted(cap) == ["twice/shared@0:output", "twice/shared@1:output"]
    w, b = (numpy(v) for v in model.shared.weights)
    np.testing.assert_allclose(cap["twice/shared@1:output"], (X @ w + b) @ w + b, rtol=1e-5)
    # A patch names the point, and applies at every call of it; a key with `@i`
    # (as cs.points and captures list the calls) says so, naming the point to patch.
    with cs.patch(model, {"twice/shared": lambda v: v * 2.0}):
        np.testing.assert_allclose(model.predict(X, verbose=0),
                                   2 * ((2 * (X @ w + b)) @ w + b), rtol=1e-5)
    with pytest.raises(ValueError, match=r"never reached \['twice/shared@0'\] in this "
                       r"`predict`: .* \['twice/shared@0'\] name single calls of a point "
                       r"that runs more than once \(a shared layer\), as `cs.points` lists "
                       r"them: a patch applies to every call of its point: patch "
                       r"\['twice/shared'\] instead\."):
        with cs.patch(model, {"twice/shared@0": lambda v: v}):
            model.predict(X, verbose=0)
    # So does a capture's list with a glob that matched nothing (it was left out
    # in silence), and the other globs are captured.
    with pytest.raises(ValueError, match=r"cs.capture: \['twice/shared@1', 'twice/sharde'\] "
                       r"of the globs in `select` matched no point of `twice`. "
                       r"\['twice/shared@1'\] name single calls .*select the "
                       r"point \(\['twice/shared'\]\).*Nearest points: .*'twice/shared'.*"
                       r"Received: select=\['twice/shared@1', 'twice/sharde', 'twice'\]"):
        with cs.capture(model, ["twice/shared@1", "twice/sharde", "twice"]) as cap:
            model.predict(X, verbose=0)
    assert sorted(cap) == ["twice:output"]
    # Alone (nothing selected at all), it said only that no point matched.
    for select in ("twice/shared@1", ["twice/shared@1", "twice/shared@0"]):
        with pytest.raises(ValueError, match=r"cs.capture selected nothing: no point matched "
                           r"\[.*\]\. \[.*'twice/shared@1'\] name single calls .*select the "
                           r"point \(\['twice/shared'\]\)"):
            with cs.capture(model, select):
                model.predict(X, verbose=0)
    with pytest.raises(ValueError, match=r"and selected none: .*\['twice/shared@1'\] name "
                       r"single calls .*select the point \(\['twice/shared'\]\)"):
        cs.intermediate_grads(model, lambda: keras.ops.sum(model(X)), select="twice/shared@1")
    with cs.capture(model, ["twice/shared", "twice/s*"]) as cap:
        model.predict(X, verbose=0)
    np.testing.assert_allclose(cap["twice/shared@1:output"], (X @ w + b) @ w + b, rtol=1e-5)
    # A model called inside another notes no points of its own: its layers' are known.
    outer = cs.Sequential([keras.Input(X.shape[1:]), model, keras.layers.Dense(1)])
    with cs.capture(model, ["twice/shared", "twice"]) as cap:
        outer.predict(X, verbose=0)
    assert sorted(cap) == ["twice/shared@0:output", "twice/shared@1:output", "twice:output"]
    with pytest.raises(ValueError, match=r"\['twice/sharde'\] of the globs"):
        with cs.capture(model, ["twice/shared", "twice/sharde"]):
            outer.predict(X, verbose=0)


def test_a_glob_of_a_list_whose_points_lack_every_kind_asked_for_is_refused():
    """Each glob of a list must select something: one that matched only points
    without the kinds asked for (a sown value has no `input`) was left out in
    silence, while the same glob alone was refused."""
    net = _net()
    with pytest.raises(ValueError, match=r"cs.capture: the glob 'net/block_0/pre_act' of "
                       r"`select` selected nothing \(the other globs' values were "
                       r"captured\): \['net/block_0/pre_act'\] matched, but it has no "
                       r"kind in kinds=\('input',\): `net/block_0/pre_act` is a sown "
                       r"value, which has only `output`"):
        with cs.capture(net, ["net/block_0", "net/block_0/pre_act"],
                        kinds=("input",)) as cap:
            net.predict(X, verbose=0)
    assert sorted(cap) == ["net/block_0:input"]
    np.testing.assert_allclose(cap["net/block_0:input"], X, rtol=1e-6)
    # A glob that matches a point with the kind as well selects that one.
    with cs.capture(net, ["net/block_0", "net/block_1*"], kinds=("input",)) as cap:
        net.predict(X, verbose=0)
    assert sorted(cap) == ["net/block_0:input", "net/block_1/dense:input",
                           "net/block_1:input"]


def test_a_point_of_a_list_that_no_call_ran_is_refused_as_it_is_alone():
    # Keras's MultiHeadAttention takes its fused attention without dropout, and
    # never calls its `softmax`: named alone, the point was refused; named in a
    # list, it was left out without a word (a KeyError when read).
    inputs = keras.Input((8, 16))
    model = cs.Model(inputs, keras.layers.MultiHeadAttention(2, 8, name="mha")(inputs, inputs),
                     name="m")
    x = np.random.default_rng(0).normal(size=(3, 8, 16)).astype("float32")
    for select in ("m/mha/softmax", ["m/mha", "m/mha/softmax"]):
        with pytest.raises(ValueError, match=r"\['m/mha/softmax'\] .*points of the model's "
                           r"layers that no call in this scope ran .*`MultiHeadAttention`"):
            with cs.capture(model, select) as cap:
                model.predict(x, verbose=0)
    np.testing.assert_allclose(cap["m/mha:output"], model.predict(x, verbose=0), rtol=1e-6)


def test_a_list_of_globs_of_a_model_run_only_inside_another_is_not_refused():
    """Its points are noted on the model that runs it: a sown point, which has no
    `input`, was taken for a glob that matched nothing."""
    keras.utils.set_random_seed(0)
    net = Net()
    outer = cs.Sequential([keras.Input((4,)), net, keras.layers.Dense(1)])
    with cs.capture(net, ["net/block_0/pre_act", "net/block_0"], kinds=("input",)) as cap:
        outer.predict(X, verbose=0)
    assert sorted(cap) == ["net/block_0:input"]
    np.testing.assert_allclose(cap["net/block_0:input"], X, rtol=1e-6)


def test_select_callable_and_no_match_error():
    net = _net()
    with cs.capture(net, lambda point, layer: isinstance(layer, keras.layers.Dense)) as cap:
        net.predict(X, verbose=0)
    assert sorted(cap) == ["net/block_0/dense:output", "net/block_1/dense:output"]
    with pytest.raises(ValueError, match=r"selected nothing.*Nearest points: .*net/block_0"):
        with cs.capture(net, "net/blok_0"):
            net.predict(X, verbose=0)


class _Skips(keras.layers.Layer):
    """Holds two layers and runs one: `spare` is a point no call reaches."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.used = keras.layers.Dense(2, name="used")
        self.spare = keras.layers.Dense(2, name="spare")

    def build(self, shape):
        self.used.build(shape), self.spare.build(shape)

    def call(self, x):
        return self.used(x)


def test_a_point_no_call_reached_is_named_as_such():
    """The error listed the very name selected among the nearest points, with no word
    of why (torch's keras.ops.cond runs one branch, so the other's points never run)."""
    model = cs.Sequential([keras.Input((X.shape[1],)), _Skips(name="skips")], name="m")
    with pytest.raises(ValueError, match=r"no point matched \['m/skips/spare'\] that a call "
                                         r"reached: \['m/skips/spare'\] are points of the "
                                         r"model's layers that no call in this scope ran"):
        with cs.capture(model, "m/skips/spare"):
            model.predict(X, verbose=0)


@pytest.mark.parametrize("jit_compile", JIT)
def test_statistics_are_exact_aggregates_over_all_batches(jit_compile):
    net = _net(jit_compile)
    stats = ("mean", "std", "min", "max", "absmax", "rms", "frac_zero", "hist")
    ref = _reference(net, X)["net/block_0:output"].astype(np.float64)
    with cs.capture(net, "net/block_0", reduce=stats, hist_range=(-1.0, 3.0), bins=8) as cap:
        net.predict(X, batch_size=3, verbose=0)  # 4 uneven batches
    key = "net/block_0:output"
    assert cap[f"{key}/mean"] == pytest.approx(ref.mean(), rel=1e-5)
    assert cap[f"{key}/std"] == pytest.approx(ref.std(), rel=1e-5)
    assert cap[f"{key}/min"] == pytest.approx(ref.min())
    assert cap[f"{key}/max"] == pytest.approx(ref.max(), rel=1e-6)
    assert cap[f"{key}/absmax"] == pytest.approx(np.abs(ref).max(), rel=1e-6)
    assert cap[f"{key}/rms"] == pytest.approx(np.sqrt((ref ** 2).mean()), rel=1e-5)
    assert cap[f"{key}/frac_zero"] == pytest.approx((ref == 0).mean())
    counts, edges = np.histogram(np.clip(ref, -1.0, 3.0), bins=8, range=(-1.0, 3.0))
    np.testing.assert_array_equal(cap[f"{key}/hist"], counts)
    np.testing.assert_allclose(cap.hist_edges(f"{key}/hist"), edges)


@pytest.mark.parametrize("jit_compile", JIT)
def test_fit_statistics_give_one_row_per_step_and_hist_range_from_first_batch(jit_compile):
    net = _net(jit_compile)
    with cs.capture(net, "net/block_1", reduce=("mean", "hist"), bins=4) as cap:
        net.fit(X, Y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    ref = _reference(net, X)["net/block_1:output"]
    means = [ref[i:i + 4].mean() for i in (0, 4, 8)]
    np.testing.assert_allclose(cap["net/block_1:output/mean"], means, rtol=1e-5)
    hist = cap["net/block_1:output/hist"]
    assert hist.shape == (3, 4)
    np.testing.assert_array_equal(hist.sum(axis=1), [8, 8, 4])
    lo, hi = ref[:4].min(), ref[:4].max()
    np.testing.assert_allclose(cap.hist_edges("net/block_1:output/hist")[[0, -1]], [lo, hi],
                               rtol=1e-5)


def test_mixed_precision_statistics_are_float32():
    keras.utils.set_random_seed(0)
    model = cs.Sequential([keras.Input((4,)),
                           keras.layers.Dense(4, dtype="mixed_float16", name="big",
                                              kernel_initializer=keras.initializers.Constant(300.0))])
    x = np.full((8, 4), 30.0, "float32")  # outputs 36000: squares overflow float16
    with cs.capture(model, "*/big", reduce=("mean", "std", "rms")) as cap:
        out = model.predict(x, verbose=0)
    assert out.dtype == np.float16
    assert cap["sequential/big:output/rms"] == pytest.approx(36000.0, rel=1e-3)
    assert cap["sequential/big:output/std"] == pytest.approx(0.0, abs=1e-3)


@pytest.mark.parametrize("jit_compile", JIT)
def test_streaming_to_disk_reads_back_memory_mapped(tmp_path, jit_compile):
    net = _net(jit_compile)
    target = tmp_path / "caps"
    with cs.capture(net, "net/block_*", to=target) as cap:
        net.predict(X, batch_size=3, verbose=0)
    value = cap["net/block_0:output"]
    assert isinstance(value, np.memmap)
    np.testing.assert_allclose(value, _reference(net, X)["net/block_0:output"], rtol=1e-5,
                               atol=1e-6)
    assert os.path.exists(target / "index.json")
    with pytest.raises(FileExistsError, match="already holds a capture"):
        with cs.capture(net, to=target):
            pass


@pytest.mark.parametrize("stream", [False, True], ids=["memory", "streamed"])
def test_calls_whose_rows_differ_in_shape_are_read_one_by_one(tmp_path, stream):
    # Two predicts of sequences of 5 and 7 steps: `cap[key]` cannot join them,
    # and says so by key (numpy's own error named neither), where each call reads.
    model = cs.Sequential([keras.Input((None, 2)), keras.layers.Dense(3, name="d")],
                          name="seq")
    w, b = (numpy(v) for v in model.get_layer("d").weights)
    short, long = (np.ones((2, n, 2), "float32") for n in (5, 7))
    with cs.capture(model, "seq/d", to=tmp_path / "caps" if stream else None) as cap:
        model.predict(short, verbose=0)
        model.predict(long, verbose=0)
    with pytest.raises(ValueError, match=r"`seq/d:output` has rows of different shapes .*"
                                         r"\(5, 3\), \(7, 3\).*cap.calls\[i\]\[key\]"):
        cap["seq/d:output"]
    for call, x in zip(cap.calls, (short, long)):
        np.testing.assert_allclose(call["seq/d:output"], x @ w + b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stream", [False, True], ids=["memory", "streamed"])
def test_calls_whose_rows_differ_in_dtype_are_read_one_by_one(tmp_path, stream):
    # A value sown as float32 in one call and int32 in the next read as float64
    # (numpy's promotion), silently: `cap[key]` refuses the cast, as it does for a
    # change of shape, also read back with cs.load_capture.
    class Net(cs.Model):
        def call(self, x):
            cs.sow(self, "raw", x)
            return keras.ops.cast(x, "float32")

    net = Net(name="net")
    floats, ints = np.ones((4, 3), "float32"), np.full((4, 3), 7, "int32")
    target = tmp_path / "caps" if stream else None
    with cs.capture(net, to=target) as cap:
        net.predict(floats, verbose=0)
        net.predict(ints, verbose=0)
    for read in [cap] + ([cs.load_capture(target)] if stream else []):
        with pytest.raises(ValueError, match=r"`net/raw:output` has rows of different dtypes "
                                             r".*float32, int32.*cap.calls\[i\]\[key\]"):
            read["net/raw:output"]
        for call, x in zip(read.calls, (floats, ints)):
            assert call["net/raw:output"].dtype == x.dtype
            np.testing.assert_array_equal(call["net/raw:output"], x)


@pytest.mark.parametrize("stream", [False, True], ids=["memory", "streamed"])
def test_a_key_read_over_a_call_that_failed_warns(tmp_path, stream):
    # The failed predict's 8 rows were joined to the next one's 16 (24 rows for
    # 32 rows of data), silently; each call alone reads without a warning.
    class Boom(keras.callbacks.Callback):
        def on_predict_batch_end(self, batch, logs=None):
            if batch == 1:
                raise RuntimeError("boom")

    model = cs.Sequential([keras.Input((2,)), keras.layers.Dense(3, name="d")], name="seq")
    w, b = (numpy(v) for v in model.get_layer("d").weights)
    x = np.random.default_rng(0).normal(size=(16, 2)).astype("float32")
    target = tmp_path / "caps" if stream else None
    with cs.capture(model, "seq/d", to=target) as cap:
        with pytest.raises(RuntimeError, match="boom"):
            model.predict(x, batch_size=4, verbose=0, callbacks=[Boom()])
        model.predict(x, batch_size=4, verbose=0)
    for read in [cap] + ([cs.load_capture(target)] if stream else []):
        assert [c.failed for c in read.calls] == [True, False]
        # Membership and `get` read nothing, and say nothing (they warned).
        assert "seq/d:output" in read and "typo" not in read and read.get("typo") is None
        with pytest.warns(UserWarning, match=r"`seq/d:output` joins the rows of 2 calls, "
                                             r"of which cap.calls\[0\] raised"):
            joined = read["seq/d:output"]
        np.testing.assert_allclose(joined, np.concatenate([x[:8], x]) @ w + b, rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_allclose(read.calls[0]["seq/d:output"], x[:8] @ w + b, rtol=1e-5,
                                   atol=1e-6)
    with cs.capture(model, "seq/d") as alone:
        with pytest.raises(RuntimeError, match="boom"):
            model.predict(x, batch_size=4, verbose=0, callbacks=[Boom()])
    np.testing.assert_allclose(alone["seq/d:output"], x[:8] @ w + b, rtol=1e-5, atol=1e-6)


def test_streaming_to_a_file_is_refused_clearly(tmp_path):
    net = _net()
    target = tmp_path / "taken"
    target.write_text("a file")
    with pytest.raises(NotADirectoryError, match=r"is a file: cs.capture\(to=...\) writes a "
                                                 r"directory.*Received: to="):
        with cs.capture(net, to=target):
            pass
    assert target.read_text() == "a file"
    net.predict(X, verbose=0)  # nothing left open or installed


def test_two_open_captures_never_stream_into_one_directory(tmp_path, monkeypatch):
    # Each would name its first call `call_000`, and one run's writer appends to
    # a file it has open: the two keys' batches would interleave in one file.
    net = _net()
    target = tmp_path / "caps"
    with cs.capture(net, "net/block_0", to=target) as first:
        for to, overwrite in ((target, False), (target, True), (target / "inner", False),
                              (os.path.join(tmp_path, "x", "..", "caps"), False)):
            with pytest.raises(ValueError, match="directory of another open cs.capture") as e:
                with cs.capture(net, "net/block_1", to=to, overwrite=overwrite):
                    pass
            assert str(e.value).endswith(f"Received: to={str(to)!r}")
        with pytest.raises(ValueError, match="inside, or holds,"):
            with cs.capture(net, "net/block_1", to=tmp_path):
                pass
        with cs.capture(net, "net/block_1", to=tmp_path / "other") as second:
            net.predict(X, batch_size=3, verbose=0)
    reference = _reference(net, X)
    for cap, key in ((first, "net/block_0:output"), (second, "net/block_1:output")):
        assert list(cap) == [key]
        np.testing.assert_allclose(cap[key], reference[key], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cs.load_capture(target)["net/block_0:output"],
                               reference["net/block_0:output"], rtol=1e-5, atol=1e-6)
    with cs.capture(net, "net/block_1", to=target, overwrite=True) as again:  # closed: free
        net.predict(X, batch_size=3, verbose=0)
    # A relative directory is where it was when the scope opened, whatever the
    # working directory later: another `os.chdir`'ed capture of "out" is another one.
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    with cs.capture(net, "net/block_0", to="out") as first:
        monkeypatch.chdir(tmp_path / "b")
        with cs.capture(net, "net/block_1", to="out") as second:
            net.predict(X, batch_size=3, verbose=0)
    for where, cap, key in (("a", first, "net/block_0:output"),
                            ("b", second, "net/block_1:output")):
        np.testing.assert_allclose(cap[key], reference[key], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(cs.load_capture(tmp_path / where / "out")[key],
                                   reference[key], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(again["net/block_1:output"], reference["net/block_1:output"],
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(FileExistsError):  # a refused scope gives its directory back
        with cs.capture(net, to=target):
            pass
    with pytest.warns(UserWarning, match="saw no call"), \
            cs.capture(net, "net/block_0", to=target, overwrite=True):
        pass


def test_steps_per_execution_predict_works_and_fit_says_why_not():
    if BACKEND == "torch":
        pytest.skip("Keras's torch backend only supports steps_per_execution=1")
    keras.utils.set_random_seed(0)
    net = Net()
    net.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    with cs.capture(net) as cap:
        net.predict(X, batch_size=2, verbose=0)
    np.testing.assert_allclose(cap["net/block_0/pre_act:output"],
                               _reference(net, X)["net/block_0/pre_act:output"], rtol=1e-5,
                               atol=1e-6)
    with pytest.raises(ValueError, match="steps_per_execution=2"):
        with cs.capture(net):
            net.fit(X, Y, batch_size=2, verbose=0)


@pytest.mark.parametrize("jit_compile", JIT)
def test_an_exception_leaves_nothing_installed_and_captures_nest(jit_compile):
    net = _net(jit_compile)
    with pytest.raises(RuntimeError, match="boom"):
        with cs.capture(net, "net/*"):
            net.predict(X, verbose=0)
            raise RuntimeError("boom")
    from callscope import _scope

    assert _scope.captures_for(net) == () and _scope.run_of(net) is None
    np.testing.assert_allclose(net.predict(X, verbose=0), _reference(net, X)["net/block_1:output"],
                               rtol=1e-5, atol=1e-6)
    with cs.capture(net, "net/block_0") as outer:
        with cs.capture(net, reduce="mean") as inner:
            net.predict(X, verbose=0)
        net.predict(X, verbose=0)
    assert list(inner) == ["net/block_0/pre_act:output/mean", "net/block_1/pre_act:output/mean"]
    assert outer["net/block_0:output"].shape == (20, 8)


def test_points_and_summary_show_the_call_tree():
    net = _net()
    pts = cs.points(net, X[:2])
    assert pts["net/block_0/pre_act"] == (2, 8)
    assert pts["net/block_1"] == (2, 2) and pts["net"] == (2, 2)
    text = cs.summary(net, X[:2], print_fn=lambda s: None)
    lines = text.splitlines()
    assert lines[2].startswith("net (Net)")
    assert any("sow pre_act" in line for line in lines)
    assert any(line.strip().startswith("net/block_0/dense (Dense)") and "40" in line
               for line in lines)


def test_user_stateless_jax_step_with_collecting_and_emit():
    if BACKEND != "jax":
        pytest.skip("a stateless train_step with jax.value_and_grad is the JAX style")
    import jax

    class Custom(Net):
        def compute_loss_and_updates(self, tv, ntv, x, y):
            with cs.collecting() as sown:
                y_pred, ntv = self.stateless_call(tv, ntv, x, training=True)
            return self.compute_loss(x, y, y_pred), (ntv, sown.values)

        def train_step(self, state, data):
            tv, ntv, ov, mv = state
            x, y = data
            grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
            (loss, (ntv, sown)), grads = grad_fn(tv, ntv, x, y)
            cs.emit(sown)
            tv, ov = self.optimizer.stateless_apply(ov, grads, tv)
            return {"my_loss": loss}, (tv, ntv, ov, mv)

    keras.utils.set_random_seed(0)
    net = Custom()
    net.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    net(X[:1])
    with cs.capture(net) as cap:
        net.fit(X, Y, batch_size=5, epochs=1, verbose=0, shuffle=False)
    np.testing.assert_allclose(cap["net/block_1/pre_act:output"],
                               _reference(net, X)["net/block_1/pre_act:output"], rtol=1e-5,
                               atol=1e-6)


def test_user_stateless_jax_step_without_collecting_says_what_to_do():
    # JAX's own error named no point and never callscope.
    if BACKEND != "jax":
        pytest.skip("a stateless train_step with jax.value_and_grad is the JAX style")
    import jax

    class Custom(Net):
        def train_step(self, state, data):
            tv, ntv, ov, mv = state
            x, y = data

            def loss_fn(tv):
                y_pred, _ = self.stateless_call(tv, ntv, x, training=True)
                return self.compute_loss(x, y, y_pred)

            loss, grads = jax.value_and_grad(loss_fn)(tv)
            tv, ov = self.optimizer.stateless_apply(ov, grads, tv)
            return {"my_loss": loss}, (tv, ntv, ov, mv)

    net = Custom()
    net.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    net(X[:1])
    with pytest.raises(jax.errors.UnexpectedTracerError) as raised:
        with cs.capture(net):
            net.fit(X, Y, batch_size=5, epochs=1, verbose=0, shuffle=False)
    assert any("Wrap the forward in `with cs.collecting() as sown:`" in note
               for note in getattr(raised.value, "__notes__", ())), raised.value
    net.fit(X, Y, batch_size=5, epochs=1, verbose=0)  # (nothing left behind)


def test_load_capture_explains_a_directory_without_a_capture(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"holds no capture index .*Received: path="):
        cs.load_capture(tmp_path)


def test_streaming_bfloat16_reads_back_what_memory_holds(tmp_path):
    # numpy has no string for bfloat16 (`<V2`): the index stores its name.
    model = cs.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d", dtype="bfloat16")],
                          name="bf")
    x = np.linspace(-1, 1, 24, dtype="float32").reshape(6, 4)
    with cs.capture(model, "bf/d") as held:
        model.predict(x, batch_size=4, verbose=0)
    with cs.capture(model, "bf/d", to=tmp_path / "cap") as streamed:
        model.predict(x, batch_size=4, verbose=0)
    for got in (streamed["bf/d:output"], cs.load_capture(tmp_path / "cap")["bf/d:output"]):
        assert got.dtype == held["bf/d:output"].dtype
        np.testing.assert_array_equal(got.astype("float32"),
                                      held["bf/d:output"].astype("float32"))


class _ByBatchSize(cs.Model):
    """Runs `extra` only for batches of 4 rows: a branch on a static shape, which
    a compiled step fixes where it is traced."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = keras.layers.Dense(3, name="first")
        self.extra = keras.layers.Dense(3, name="extra")

    def call(self, x):
        x = self.first(x)
        return self.extra(x) if x.shape[0] == 4 else x


def test_a_compiled_step_that_reads_a_range_this_call_did_not_find_is_refused():
    # The compiled step's histogram ranges are its inputs, found from each call's
    # first batch. A later call of the same key whose first batch does not reach a
    # point the step reads a range for cannot give it: refused, with the fix.
    model = _ByBatchSize(name="m")
    model.compile(loss="mse")
    x = np.random.default_rng(0).normal(size=(8, 2)).astype("float32")
    with cs.capture(model, "m/*", reduce="hist") as cap:
        model.predict(x, batch_size=4, verbose=0)
    assert sorted(cap) == ["m/extra:output/hist", "m/first:output/hist"]
    with pytest.raises(ValueError) as raised:
        with cs.capture(model, "m/*", reduce="hist"):
            model.predict(x[:6], batch_size=2, verbose=0)
    message = str(raised.value)
    assert "Pass `hist_range=`" in message
    assert message.endswith("Received: missing ranges ['range|0|m/extra:output']")
    # With the range given there is nothing to find, and the call runs.
    with cs.capture(model, "m/*", reduce="hist", hist_range=(-5.0, 5.0)) as cap:
        model.predict(x[:6], batch_size=2, verbose=0)
    assert sorted(cap) == ["m/first:output/hist"]


class _Part(enum.Enum):
    A = "a"
    B = "b"


class _Mix(keras.layers.Layer):
    def call(self, x, parts):
        return x + parts[_Part.A] * parts[_Part.B]


class _EnumKeys(cs.Model):
    """Calls a layer with a dict whose keys do not sort (Enum members)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2, name="dense")
        self.mix = _Mix(name="mix")

    def call(self, x):
        h = self.dense(x)
        return self.mix(h, {_Part.B: h, _Part.A: h})


def test_a_capture_runs_a_call_whose_dict_keys_do_not_sort_as_keras_does():
    model = _EnumKeys(name="net")
    x = np.random.default_rng(0).normal(size=(4, 3)).astype("float32")
    try:
        plain = model.predict(x, verbose=0)
    except TypeError as error:  # torch: Keras itself sorts a call's dict keys
        assert BACKEND == "torch", error
        with pytest.raises(TypeError, match=re.escape(str(error).splitlines()[0][:40])):
            with cs.capture(model, "net/*"):
                model.predict(x, verbose=0)
        return
    with cs.capture(model, "net/*") as cap:
        captured = model.predict(x, verbose=0)
    np.testing.assert_array_equal(captured, plain)
    h = cap["net/dense:output"]
    np.testing.assert_allclose(cap["net/mix:output"], h + h * h, rtol=1e-6)


def test_a_capture_that_no_call_reached_warns_that_it_is_empty():
    # A call in a thread that did not copy the scope's context (a plain
    # `threading.Thread`, a `ThreadPoolExecutor`) ran uncaptured: the capture
    # ended empty without a word.
    import threading

    model = cs.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d")], name="m")
    stock = model.predict(X, verbose=0)
    with pytest.warns(UserWarning, match=r"cs.capture saw no call of `m`, so it is empty.*"
                      r"Received: 0 calls of `m`"):
        with cs.capture(model, "m/d") as cap:
            thread = threading.Thread(target=lambda: model.predict(X, verbose=0))
            thread.start()
            thread.join()
    assert len(cap) == 0
    # A patch too: the thread's call went unpatched.
    got = []
    with pytest.warns(UserWarning, match=r"cs.patch of \['m/d'\] saw no call of `m`, so it "
                      r"patched nothing.*Received: 0 calls of `m`"):
        with cs.patch(model, {"m/d": lambda h: h * 0.0}):
            thread = threading.Thread(target=lambda: got.append(model.predict(X, verbose=0)))
            thread.start()
            thread.join()
    np.testing.assert_allclose(got[0], stock, rtol=1e-6)
    with cs.patch(model, {"m/d": lambda h: h * 0.0}):  # (a call reached it: no warning)
        np.testing.assert_array_equal(model.predict(X, verbose=0), np.zeros((10, 3)))
    # A call refused before it began reached the scope: its error says the rest.
    with cs.capture(model, "m/d") as cap:
        with pytest.raises(TypeError, match="nope"):
            model.predict(X, verbose=0, nope=1)
    assert len(cap) == 0


_SHAPE_ERRORS = (TypeError, ValueError, RuntimeError)  # (fit's, on JAX, TF and torch)


@pytest.mark.parametrize("to", [False, True])
def test_a_capture_whose_calls_all_failed_raises_no_error_of_selection(tmp_path, to):
    # The call failed before its first step reached the point, and the user caught
    # its error: the scope's exit blamed the selection ("selected nothing: ... a
    # layer its call skipped").
    model = cs.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d")], name="m")
    model.compile(optimizer="sgd", loss="mse")
    model.predict(X, verbose=0)
    directory = tmp_path / "cap" if to else None
    for select in ("m/d", ["m/d", "m/nothing*"]):
        with cs.capture(model, select, to=directory) as cap:
            with pytest.raises(_SHAPE_ERRORS):
                model.fit(X, np.ones((10, 5), "float32"), verbose=0)
        assert len(cap) == 0
        if to:
            assert not directory.exists()  # left as it was found
    # A call that ran and recorded nothing still says so.
    with pytest.raises(ValueError, match="cs.capture selected nothing"):
        with cs.capture(model, "m/nothing"):
            with pytest.raises(_SHAPE_ERRORS):
                model.fit(X, np.ones((10, 5), "float32"), verbose=0)
            model.predict(X, verbose=0)


def test_a_streaming_capture_that_no_call_reached_leaves_its_directory_as_found(tmp_path):
    # It wrote an index of nothing: the next capture to the same place was refused.
    model = cs.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d")], name="m")
    with pytest.warns(UserWarning, match="saw no call"), cs.capture(model, "m/d",
                                                                   to=tmp_path / "cap"):
        pass
    assert not (tmp_path / "cap").exists()
    with cs.capture(model, "m/d", to=tmp_path / "cap") as cap:
        model.predict(X, verbose=0)
    np.testing.assert_allclose(cs.load_capture(tmp_path / "cap")["m/d:output"], cap["m/d:output"])
