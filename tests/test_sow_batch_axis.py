"""`cs.sow(..., batch_axis=)`: values whose batch axis is not the first (time-major),
or that have none (a value of the weights, a scalar), on one device and under
Keras's distribution engines (`tf.distribute.MirroredStrategy`, where each replica's
record used to be taken as rows of the batch, and JAX's `DataParallel`)."""

from pathlib import Path

import keras
import numpy as np
import pytest
from conftest import BACKEND
from models_for_tests import SowsWithoutBatchAxis
from test_distribution import _run_worker

import callscope as cs

X = np.random.RandomState(0).randn(10, 2).astype("float32")
Y = np.random.RandomState(1).randn(10, 4).astype("float32")
SOWN = "seq/block/*"
WORKER = Path(__file__).with_name("sow_axes_worker.py")


def _model(jit_compile="auto", of_rows=False):
    model = cs.Sequential([keras.Input((2,)), SowsWithoutBatchAxis(of_rows, name="block")],
                          name="seq")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=jit_compile)
    return model


def _kernel(model):
    return keras.ops.convert_to_numpy(model.get_layer("block").dense.kernel)


def _expected_kernel(model):
    kernel = _kernel(model).copy()
    kernel[0, 0] = np.nan  # the layer's NaN
    return kernel


@pytest.mark.parametrize("jit_compile", ["auto", True, False])
def test_predict_records_each_axis_as_said(jit_compile):
    model = _model(jit_compile)
    with cs.capture(model, SOWN) as cap:
        out = model.predict(X, batch_size=4, verbose=0)  # 3 batches: 4, 4, 2
    kernel = _expected_kernel(model)
    # No batch axis: one row per batch, stacked on a new first axis.
    assert cap["seq/block/kernel:output"].shape == (3, 2, 4)
    for row in cap["seq/block/kernel:output"]:
        np.testing.assert_array_equal(row, kernel)
    np.testing.assert_allclose(cap["seq/block/kernel_sum:output"],
                               [_kernel(model).sum()] * 3, rtol=1e-6)
    # Time-major (3, batch, 4), batch_axis=1: recorded batch-first, (rows, 3, 4).
    h = cap["seq/block/dense:output"]
    steps = cap["seq/block/time_major:output"]
    assert steps.shape == (10, 3, 4)
    np.testing.assert_allclose(steps, np.stack([h, 2 * h, h - 1], axis=1), rtol=1e-6)
    np.testing.assert_allclose(out, h + 0.5 * (h - 1) + 0.1 * _kernel(model).sum(),
                               rtol=1e-5, atol=1e-6)


def test_statistics_count_each_value_once():
    model = _model()
    stats = ("mean", "min", "max", "hist", "nan_count")
    with cs.capture(model, SOWN) as full:
        model.predict(X, batch_size=4, verbose=0)
    with cs.capture(model, SOWN, reduce=stats, hist_range=(-3.0, 3.0), bins=6) as cap:
        model.predict(X, batch_size=4, verbose=0)
    for point in ("kernel", "kernel_sum", "time_major"):
        values = full[f"seq/block/{point}:output"].astype(np.float64)
        finite = values[np.isfinite(values)]
        key = f"seq/block/{point}:output"
        assert cap[f"{key}/nan_count"] == np.isnan(values).sum()
        assert cap[f"{key}/mean"] == pytest.approx(finite.mean(), rel=1e-5)
        assert cap[f"{key}/min"] == pytest.approx(finite.min())
        assert cap[f"{key}/max"] == pytest.approx(finite.max())
        hist, _ = np.histogram(np.clip(finite, -3.0, 3.0), bins=6, range=(-3.0, 3.0))
        np.testing.assert_array_equal(cap[f"{key}/hist"], hist)
    assert cap["seq/block/kernel:output/nan_count"] == 3  # one NaN a batch


def test_gradients_keep_the_value_layout():
    model = _model()
    kernel, bias = (keras.ops.convert_to_numpy(w) for w in model.get_layer("block").dense.weights)
    with cs.capture(model, SOWN, kinds=("output", "grad")) as cap:
        model.train_on_batch(X, Y)
    # mse over (10, 4): d loss / d out = 2 (out - y) / 40, with out = h + 0.5 (h - 1) + 0.1 sum(k).
    h = X @ kernel + bias
    out = 1.5 * h - 0.5 + 0.1 * kernel.sum()
    g = 2 * (out - Y) / out.size
    np.testing.assert_allclose(cap["seq/block/kernel_sum:grad"], [0.1 * g.sum()], rtol=1e-4)
    np.testing.assert_array_equal(cap["seq/block/kernel:grad"], np.zeros((1, 2, 4)))
    np.testing.assert_allclose(cap["seq/block/time_major:grad"],
                               np.stack([g, 0 * g, 0.5 * g], axis=1), rtol=1e-4, atol=1e-7)


def test_a_streamed_capture_stacks_alike(tmp_path):
    model = _model()
    with cs.capture(model, SOWN) as cap:
        model.predict(X, batch_size=4, verbose=0)
    with cs.capture(model, SOWN, to=tmp_path / "caps") as streamed:
        model.predict(X, batch_size=4, verbose=0)
    loaded = cs.load_capture(tmp_path / "caps")
    for key, value in cap.items():
        np.testing.assert_array_equal(streamed[key], value)
        np.testing.assert_array_equal(loaded[key], value)


class Sows(keras.layers.Layer):
    """Sows its input transposed, (2, batch), once per axis in `axes`."""

    def __init__(self, axes, **kwargs):
        super().__init__(**kwargs)
        self.axes = axes

    def call(self, x):
        for axis in self.axes:  # (2, batch): its batch axis is the last
            cs.sow(self, "v", keras.ops.transpose(x), batch_axis=axis)
        cs.sow(self, "plain", x)
        return x


def test_bad_batch_axes_are_refused():
    for bad in (1.5, True, "0"):
        model = cs.Sequential([keras.Input((2,)), Sows([bad], name="sows")], name="m")
        with pytest.raises(TypeError, match=r"`batch_axis` is the axis of the value that holds "
                           rf"the batch's rows .*Received: batch_axis={bad!r}"):
            with cs.capture(model):
                model.predict(X, verbose=0)
        # Only where the point is recorded: a capture of another point runs.
        with cs.capture(model, "m/sows/plain") as cap:
            model.predict(X, verbose=0)
        np.testing.assert_array_equal(cap["m/sows/plain:output"], X)

    model = cs.Sequential([keras.Input((2,)), Sows([3], name="sows")], name="m")
    with pytest.raises(ValueError, match=r"`m/sows/v` is sown with batch_axis=3, but its value "
                       r"has 2 axes.*Received: batch_axis=3, a value of shape \(2, \d+\)"):
        with cs.capture(model):
            model.predict(X, verbose=0)
    for axes in ([None, 1], [0, 1], [None, 0], [1, 0]):
        model = cs.Sequential([keras.Input((2,)), Sows(axes, name="sows")], name="m")
        with pytest.raises(ValueError, match=r"`m/sows/v` is sown twice in one step with "
                           r"different batch axes.*Received: batch_axis=(None|0|1) and "
                           r"batch_axis=(None|0|1)"):
            with cs.capture(model):
                model.predict(X, verbose=0)
    # -1 is the last axis; nothing was left behind by the errors.
    model = cs.Sequential([keras.Input((2,)), Sows([-1], name="sows")], name="m")
    with cs.capture(model) as cap:
        model.predict(X, batch_size=4, verbose=0)
    np.testing.assert_array_equal(cap["m/sows/v:output"], X)


class SowsItsSublayer(keras.layers.Layer):
    """Sows its sublayer's time-major output under the sublayer's own point."""

    def __init__(self, batch_axis, **kwargs):
        super().__init__(**kwargs)
        self.batch_axis = batch_axis
        # 1: time-major steps; None: a scalar; "rows": rows, sown as if it had none.
        self.steps = keras.layers.Lambda(
            lambda x: (keras.ops.stack([x, 2.0 * x]) if self.batch_axis == 1
                       else x if self.batch_axis else x[0, 0]),
            name="steps")

    def call(self, x):
        axis = None if self.batch_axis == "rows" else self.batch_axis
        steps = cs.sow(self, "steps", self.steps(x), batch_axis=axis)
        return x + 0.0 * keras.ops.sum(steps)


@pytest.mark.parametrize("select", [None, "m/block/steps", "m/block/*", "*"])
def test_a_sown_sublayer_output_keeps_its_axis_whatever_selects_it(select):
    model = cs.Sequential([keras.Input((2,)), SowsItsSublayer(1, name="block")], name="m")
    with cs.capture(model, select) as cap:
        model.predict(X, batch_size=4, verbose=0)
    np.testing.assert_array_equal(cap["m/block/steps:output"], np.stack([X, 2 * X], axis=1))
    model = cs.Sequential([keras.Input((2,)), SowsItsSublayer(None, name="block")], name="m")
    with cs.capture(model, select) as cap:
        model.predict(X, batch_size=4, verbose=0)
    np.testing.assert_array_equal(cap["m/block/steps:output"], X[[0, 4, 8], 0])
    assert cap["m/block/steps:output"].shape == (3,)  # one 0-d value a batch


class ReturnsWhatItSows(keras.layers.Layer):
    """Sows a time-major value (`batch_axis=1`) and its weights' sum (`None`) under
    the names of the elements of its tuple output that they are: one point each."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3, name="dense")

    def call(self, x):
        h = self.dense(x)
        steps = cs.sow(self, "0", keras.ops.stack([h, 2.0 * h]), batch_axis=1)
        total = cs.sow(self, "1", keras.ops.sum(self.dense.kernel), batch_axis=None)
        return steps, total


class UsesThePair(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.pair = ReturnsWhatItSows(name="pair")

    def call(self, x):
        steps, total = self.pair(x)
        return steps[1] + total


@pytest.mark.parametrize("select", [None, "m/u/pair", "m/u/pair/*", "*", "m/u/pair/0"])
def test_a_sown_output_element_keeps_its_axis_whatever_selects_it(select):
    # Selecting the layer selects its elements; they were recorded with their first
    # axis as the rows: (8, 2, 3) as (4, 4, 3), silently, where batches are even.
    model = cs.Sequential([keras.Input((2,)), UsesThePair(name="u")], name="m")
    with cs.capture(model, select) as cap:
        model.predict(X[:8], batch_size=4, verbose=0)
    dense = model.get_layer("u").pair.dense
    h = keras.ops.convert_to_numpy(dense(X[:8]))
    np.testing.assert_allclose(cap["m/u/pair/0:output"], np.stack([h, 2 * h], axis=1),
                               rtol=1e-6)
    if select != "m/u/pair/0":
        total = keras.ops.convert_to_numpy(keras.ops.sum(dense.kernel))
        np.testing.assert_allclose(cap["m/u/pair/1:output"], [total, total], rtol=1e-6)


def test_a_patch_of_the_rows_of_a_sown_sublayer_output_is_refused():
    # The sublayer's call patches its output before `sow` gives the axis: a patch
    # that takes the batch saw the T steps as rows, silently where T is the batch size.
    model = cs.Sequential([keras.Input((2,)), SowsItsSublayer(1, name="block")], name="m")

    def by_row(value, batch):
        return keras.ops.zeros_like(value) + keras.ops.cast(batch.start, value.dtype)

    for patch in (by_row, np.zeros((10, 2, 2), "float32")):
        with pytest.raises(ValueError, match=r"The patch of `m/block/steps` takes the batch .*"
                           r"output of the sublayer `steps`, sown there with batch_axis=1: "
                           r".*Sow the value under a name of its own \(e.g. `cs.sow\(self, "
                           r"'steps_rows', ..., batch_axis=1\)`\)"):
            with cs.patch(model, {"m/block/steps": patch}):  # batches of T = 2 rows
                model.predict(X[:8], batch_size=2, verbose=0)
    # Where the rows do not fit, the sublayer's shape check says where to give the axis.
    with pytest.raises(ValueError, match=r"took the value's first axis as the batch's rows: "
                       r"a value whose rows are on another axis is patched where it is "
                       r"sown, with `cs.sow\(..., batch_axis=\)`"):
        with cs.patch(model, {"m/block/steps": np.zeros((10, 2, 2), "float32")}):
            model.predict(X, batch_size=4, verbose=0)
    # A patch of the value alone needs no rows.
    with cs.patch(model, {"m/block/steps": lambda v: v * 0.0}):
        np.testing.assert_array_equal(model.predict(X, batch_size=4, verbose=0), X)
    # Opened on the inner model, the error names the point as the patch does.
    outer = cs.Sequential([keras.Input((2,)), model], name="outer")
    with pytest.raises(ValueError, match=r"The patch of `m/block/steps` takes the batch .*"
                       r"output of the sublayer `steps`, sown there with batch_axis=1"):
        with cs.patch(model, {"m/block/steps": by_row}):
            outer.predict(X[:8], batch_size=2, verbose=0)
    # Without a batch axis there are no rows to patch, whatever the name.
    model = cs.Sequential([keras.Input((2,)), SowsItsSublayer(None, name="block")], name="m")
    with pytest.raises(ValueError, match=r"The patch of `m/block/steps` takes the batch .*"
                       r"the point's value is a scalar: it has no rows. Patch it with "
                       r"`fn\(value\)`"):
        with cs.patch(model, {"m/block/steps": by_row}):
            model.predict(X, batch_size=4, verbose=0)
    model = cs.Sequential([keras.Input((2,)), SowsItsSublayer("rows", name="block")],
                          name="m")
    with pytest.raises(ValueError, match=r"sown there with batch_axis=None: .*"
                       r"A value sown with batch_axis=None has no rows: patch it with "
                       r"`fn\(value\)`"):
        with cs.patch(model, {"m/block/steps": by_row}):
            model.predict(X[:8], batch_size=4, verbose=0)


def test_a_patch_of_the_rows_of_a_tuple_output_is_refused():
    model = cs.Sequential([keras.Input((2,)), UsesThePair(name="u")], name="m")
    with pytest.raises(ValueError, match=r"The patch of `m/u/pair` takes the batch .*the "
                       r"layer's output there is a tuple of tensors.*Patch each element at "
                       r"its own point \(`m/u/pair/0`, ...\)"):
        with cs.patch(model, {"m/u/pair": lambda value, batch: value}):
            model.predict(X, batch_size=4, verbose=0)


@pytest.mark.skipif(BACKEND != "torch", reason="torch.compile: torch's jit_compile=True")
def test_under_torch_compile_an_output_element_sown_under_its_point_is_refused():
    # Layers cannot note there which value is which, so one point of two is refused,
    # and before the element's patch would run a second time (with its first axis
    # as the rows: the patch's shape error, which named the wrong cause).
    model = cs.Sequential([keras.Input((2,)), UsesThePair(name="u")], name="m")
    model.compile(loss="mse", jit_compile=True)
    message = (r"`cs.sow\(self, '0', ...\)` in `pair` names the point `m/u/pair/0`, which is "
               r"also an element of its output, with a value that is not that output itself "
               r"\(or, under torch.compile, `jit_compile=True`, any value: .*but not under "
               r"torch.compile\)")
    steps = np.zeros((10, 2, 3), "float32")
    for opened in (lambda: cs.capture(model), lambda: cs.patch(model, {"m/u/pair/0": steps})):
        with pytest.raises(ValueError, match=message):
            with opened():
                model.predict(X, batch_size=4, verbose=0)


def test_patches_see_a_time_major_value_batch_first():
    model = _model()
    with cs.capture(model, "seq/block/time_major") as clean:
        model.predict(X, batch_size=4, verbose=0)
    steps = clean["seq/block/time_major:output"]  # (10, 3, 4), batch-first
    # Splicing the captured array back in changes nothing.
    with cs.patch(model, {"seq/block/time_major": steps}):
        np.testing.assert_allclose(model.predict(X, batch_size=4, verbose=0),
                                   model.predict(X, batch_size=4, verbose=0), rtol=1e-6)
    # A row-dependent patch sees batch.rows rows: each row's steps set to its index.
    def by_row(value, batch):
        rows = keras.ops.arange(batch.rows) + batch.start
        return keras.ops.zeros_like(value) + keras.ops.cast(rows, value.dtype)[:, None, None]

    with cs.patch(model, {"seq/block/time_major": by_row}):
        out = model.predict(X, batch_size=4, verbose=0)
    rows = np.arange(10, dtype="float32")[:, None]
    np.testing.assert_allclose(out, 1.5 * rows + 0.1 * _kernel(model).sum() + 0 * out,
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"The patch of `seq/block/kernel` takes the batch .*"
                       r"sown with batch_axis=None: its value has no rows"):
        with cs.patch(model, {"seq/block/kernel": np.zeros((3, 2, 4), "float32")}):
            model.predict(X, batch_size=4, verbose=0)
    with cs.patch(model, {"seq/block/kernel_sum": lambda v: v * 0.0}):
        out = model.predict(X, batch_size=4, verbose=0)
    h = steps[:, 0]
    np.testing.assert_allclose(out, h + 0.5 * (h - 1), rtol=1e-5, atol=1e-6)


def _assert_same(actual, desired):
    assert actual.keys() == desired.keys()
    for key, value in desired.items():
        value, got = np.asarray(value, dtype=float), np.asarray(actual[key], dtype=float)
        assert got.shape == value.shape, key
        np.testing.assert_allclose(got, value, rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.skipif(BACKEND == "torch", reason="Keras distributes JAX and TF only")
def test_distributed_captures_match_one_device():
    results = _run_worker(BACKEND, WORKER)
    assert results["devices"] == 4
    single, dist = results["single"], results["distributed"]
    assert np.shape(single["predict"]["seq/block/kernel:output"]) == (2, 2, 4)
    assert np.shape(single["predict"]["seq/block/kernel_sum:output"]) == (2,)
    assert np.shape(single["predict_on_batch"]["seq/block/kernel_sum:output"]) == (1,)
    assert single["predict_stats"]["seq/block/kernel:output/nan_count"] == 2
    for section, values in single.items():
        if section == "weights":
            for a, b in zip(dist[section], values):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        else:
            _assert_same(dist[section], values)
    if BACKEND == "tensorflow":
        # The replicas each saw their own rows: no one-device value to record.
        for message in results["disagreeing"].values():
            assert ("`seq/block/row_mean` has no batch axis (sown with batch_axis=None, "
                    "or a layer's 0-d argument), but the replicas of tf.distribute "
                    "computed different values for it") in message
            assert "Received: points=['seq/block/row_mean']" in message
        # The host raised, not the step: the other replicas' collective ops were not
        # cancelled, and training goes on (with one weight update more: the step ran).
        after, single_after = results["after_disagreeing"], results["single_after_disagreeing"]
        assert after["predict"].keys() == single_after["predict"].keys()
        assert np.shape(after["fit"]["seq/block/kernel:grad"]) == (2, 2, 4)
        assert np.isfinite(after["loss"])
        for message in results["xla"]:
            assert message is not None and "which a step compiled by XLA cannot make" in message
            assert "Compile the model with jit_compile=False" in message
            assert "Received: jit_compile=True, 4 replicas" in message
        assert np.isfinite(results["xla_after"]).all()
    else:  # one program over the global batch: its mean is one device's
        for method, values in results["single_disagreeing"].items():
            _assert_same(results["disagreeing"][method], values)
