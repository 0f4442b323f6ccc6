"""Statistics at the edges: NaN and inf elements, and partials with no data (n == 0).

Every statistic but `nan_count` and `inf_count` is over the finite elements only;
partials with n == 0 merge as "no data"; a result with no data is NaN, never a
warning. Values are checked against numpy references on each backend.
"""

import functools
import warnings

import keras
import numpy as np
import pytest
from conftest import BACKEND, numpy

import callscope as cs
from callscope import _reduce

JIT = [False, "auto"]
BINS, RANGE = 4, (-1.0, 1.0)
ALL = _reduce.STATS
# `rms` without `std` takes its own partial, the root mean square (`qm`), decided
# by the sum of squares where no mean is needed; with `mean`, by the sum.
RMS_SETS = [("rms", "absmax"), ("rms", "mean", "frac_zero")]
FINITE_STATS = ("mean", "std", "rms", "min", "max", "absmax", "frac_zero")


def _data():
    """10 rows of 4: a first batch (of 3) with no finite value, then NaN, +inf and
    -inf scattered among finite values, zeros and values outside RANGE."""
    x = np.random.default_rng(1).normal(scale=1.5, size=(10, 4)).astype("float32")
    x[0] = np.nan
    x[1] = [np.inf, -np.inf, np.nan, np.inf]
    x[2] = np.nan
    x[4, 1] = np.nan
    x[5, 0], x[5, 3] = np.inf, -np.inf
    x[6, 2] = 0.0
    x[7] = [0.0, 5.0, -7.0, np.nan]
    return x


def _reference(x):
    """numpy statistics of `x` (float64): non-finite values left out of all but
    the counts; NaN where nothing is finite."""
    x = np.asarray(x, np.float64).ravel()
    f = x[np.isfinite(x)]
    counts, _ = np.histogram(np.clip(f, *RANGE), bins=BINS, range=RANGE)
    ref = {"nan_count": np.isnan(x).sum(), "inf_count": np.isinf(x).sum(), "hist": counts}
    if f.size:
        ref.update(mean=f.mean(), std=f.std(), rms=np.sqrt((f ** 2).mean()), min=f.min(),
                   max=f.max(), absmax=np.abs(f).max(), frac_zero=(f == 0).mean())
    else:
        ref.update(dict.fromkeys(FINITE_STATS, np.nan))
    return ref


def _ident():
    return cs.Sequential([keras.Input((4,)),
                          keras.layers.Lambda(lambda x: x * 1.0, name="ident")], name="m")


def _keys(cap, stat):
    """Keys of `stat` for every captured output, read by suffix: the point names
    are not what is tested here. (With select "*", the model's output and ident's
    output are the same tensor, so every key must match the reference.)"""
    keys = [k for k in cap if k.endswith(f":output/{stat}")]
    assert keys, sorted(cap)
    return keys


def _check(cap, ref, stats=ALL):
    for stat in stats:
        for key in _keys(cap, stat):
            value = cap[key]
            if stat == "hist":
                np.testing.assert_array_equal(value, ref["hist"], err_msg=key)
            elif np.isnan(ref[stat]):
                assert np.isnan(value), (key, value)
            else:
                assert value == pytest.approx(ref[stat], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("jit_compile", JIT)
def test_non_finite_values_are_counted_and_left_out_of_every_other_statistic(jit_compile):
    model = _ident()
    model.compile(jit_compile=jit_compile)
    x = _data()
    with cs.capture(model, "*", reduce=ALL, hist_range=RANGE, bins=BINS) as cap:
        model.predict(x, batch_size=3, verbose=0)  # 4 uneven batches, the first all NaN/inf
    ref = _reference(x)
    assert ref["nan_count"] == 11 and ref["inf_count"] == 5  # the data is as meant
    _check(cap, ref)
    for key in _keys(cap, "hist"):
        assert cap[key].sum() == np.isfinite(x).sum()  # counts sum to the finite n


@pytest.mark.parametrize("jit_compile", JIT)
@pytest.mark.parametrize("with_nan", [False, True], ids=["finite", "masked"])
def test_std_is_exact_where_the_mean_rounds(jit_compile, with_nan):
    # M2 summed about a float32-rounded mean was off by n times the rounding
    # squared: a constant 0.1 had std 7e-9, and two values a float32 step apart
    # near 1e4 had std 41% too high. A NaN element takes the masked path.
    model = _ident()
    model.compile(jit_compile=jit_compile)
    step = np.nextafter(np.float32(1e4), np.float32(np.inf))
    for x in (np.full((3, 4), 0.1, "float32"),
              np.array([[1e4, step, 1e4, step]] * 3, "float32")):
        if with_nan:
            x[0, 0] = np.nan
        with cs.capture(model, "m/ident", reduce=("std", "rms")) as cap:
            model.predict(x, verbose=0)
        finite = x[np.isfinite(x)].astype(np.float64)
        assert cap["m/ident:output/std"] == pytest.approx(finite.std(), rel=1e-6, abs=0)
        assert cap["m/ident:output/rms"] == pytest.approx(
            np.sqrt((finite ** 2).mean()), rel=1e-6)


@pytest.mark.parametrize("jit_compile", JIT + [True] if BACKEND == "tensorflow" else JIT)
@pytest.mark.parametrize("with_nan", [False, True], ids=["finite", "masked"])
def test_std_of_values_a_float32_step_apart_is_exact(jit_compile, with_nan):
    # 0.1 give or take one float32 step, 160 of them: XLA's CPU summed them to a
    # mean steps off, and M2 about it cancelled to a std 2e-5 too low (compiled,
    # JAX and TF). M2 is now summed about the mean moved by the drift.
    model = _ident()
    model.compile(jit_compile=jit_compile)
    v = np.float32(0.1)
    steps = np.random.default_rng(2).integers(-1, 2, size=(40, 4))
    x = (v + steps * np.spacing(v)).astype("float32")
    if with_nan:
        x[7, 1] = np.nan
    with cs.capture(model, "m/ident", reduce=("mean", "std")) as cap:
        model.predict(x, batch_size=40, verbose=0)
    finite = x[np.isfinite(x)].astype(np.float64)
    assert cap["m/ident:output/std"] == pytest.approx(finite.std(), rel=1e-6, abs=0)
    assert cap["m/ident:output/mean"] == pytest.approx(finite.mean(), rel=1e-7)


@pytest.mark.parametrize("jit_compile", JIT)
@pytest.mark.parametrize("with_nan", [False, True], ids=["finite", "masked"])
def test_a_std_merged_over_steps_takes_each_steps_mean_unrounded(jit_compile, with_nan):
    """Each step's mean was one float32: a std merged over steps whose means
    differ by about the spread, far from 0, carried its rounding in the steps'
    spread (0.09% off at 1e5, 0.6% at 1e6), and the mean's own was 0.05 of
    the spread at 1e6. The mean's correction (`dmean`) is now a partial of its
    own, added on the host in float64. predict merges four steps (the masked
    path where a NaN is in each), and fit reads each step's mean."""
    inputs = keras.Input((64,))
    h = keras.layers.Lambda(lambda x: x * 1.0, name="ident")(inputs)
    model = cs.Model(inputs, keras.layers.Dense(1, name="head")(h), name="m")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", jit_compile=jit_compile)
    rng = np.random.default_rng(0)
    for center in (1e5, 1e6):
        # Four batches, their means a uniform(-1, 1) apart about `center`.
        x = center + rng.normal(size=(4, 256, 64)) + rng.uniform(-1, 1, (4, 1, 1))
        x = x.astype("float32").reshape(1024, 64)
        if with_nan:
            x[::256, 0] = np.nan
        finite = x[np.isfinite(x)].astype(np.float64)
        with cs.capture(model, "m/ident", reduce=("mean", "std")) as cap:
            model.predict(x, batch_size=256, verbose=0)
        assert cap["m/ident:output/std"] == pytest.approx(finite.std(), rel=1e-6)
        assert abs(cap["m/ident:output/mean"] - finite.mean()) < 1e-5 * finite.std()
        with cs.capture(model, "m/ident", reduce=("mean", "std")) as cap:
            model.fit(x, np.zeros((1024, 1), "float32"), batch_size=256, verbose=0,
                      shuffle=False)
        batches = x.reshape(4, 256 * 64).astype(np.float64)
        means = np.array([b[np.isfinite(b)].mean() for b in batches])
        np.testing.assert_allclose(cap["m/ident:output/mean"], means, rtol=0,
                                   atol=1e-5 * finite.std())


@pytest.mark.parametrize("jit_compile", JIT)
@pytest.mark.parametrize("stats", [("rms",), ("rms", "absmax"), ("rms", "mean")],
                         ids=["rms", "rms_absmax", "rms_mean"])
def test_rms_without_std_is_right_where_squares_leave_float32s_range(jit_compile, stats):
    """Vanishing gradients: the squares of values under 1e-19 fall below float32's
    normal range (XLA on a CPU flushes them to 0), and read an rms of 0 unscaled;
    those of values over 1.8e19 overflow, and dividing by a scale over 8.5e37 may
    multiply by its subnormal reciprocal. The one-pass sum of squares is used
    only where the largest square is at least size * 2**-96 (what flushes is
    then a part in 2**30 of the sum): 2e-14 beside values whose squares flush is
    just inside that bound. Three steps merged (predict), and a direct call (run
    op by op on JAX)."""
    model = _ident()
    model.compile(jit_compile=jit_compile)
    rng = np.random.default_rng(4)
    for x in (np.full((6, 4), 1e-19, "float32"), np.full((6, 4), 3e-21, "float32"),
              (1e-20 * rng.normal(size=(6, 4))).astype("float32"),
              (1e20 * rng.normal(size=(6, 4))).astype("float32"),
              np.array([[3e38, 1.0, -3e38, 2.0]] * 6, "float32"),
              np.array([[2e-14, 1e-20, -1e-20, 3e-21]] * 6, "float32"),
              np.zeros((6, 4), "float32")):
        expected = np.sqrt((x.astype(np.float64) ** 2).mean())
        with cs.capture(model, "m/ident", reduce=stats) as cap:
            model.predict(x, batch_size=2, verbose=0)
        assert cap["m/ident:output/rms"] == pytest.approx(expected, rel=1e-5, abs=0)
        with cs.capture(model, "m/ident", reduce=stats) as cap:
            model(x)
        assert cap["m/ident:output/rms"] == pytest.approx(expected, rel=1e-5, abs=0)


@pytest.mark.parametrize("jit_compile", JIT)
@pytest.mark.parametrize("stats", [("std",), ("mean", "std", "rms", "absmax")],
                         ids=["std", "std_rms"])
def test_std_is_right_where_squares_leave_float32s_range(jit_compile, stats):
    """Vanishing gradients: `std` read 0 for values under about 1e-19 (JAX and
    TF; torch under 1e-22), whose squared deviations flush to 0 or fall below
    float32's range, and `rms` asked for with it read |mean|; over about 1e19 the
    squares overflowed and `std` read inf. The partial is now a root, from
    deviations scaled by the largest. Spreads around a mean, a spread alone,
    a constant (std 0) and huge values; three steps merged (predict), and a
    direct call (run op by op on JAX)."""
    model = _ident()
    model.compile(jit_compile=jit_compile)
    rng = np.random.default_rng(5)
    for x in ((1e-20 * rng.uniform(1, 2, size=(6, 4))).astype("float32"),
              (1e-24 * rng.normal(size=(6, 4))).astype("float32"),
              (3e-23 + 1e-25 * rng.normal(size=(6, 4))).astype("float32"),
              np.full((6, 4), 3e-21, "float32"),
              (1e20 * rng.normal(size=(6, 4))).astype("float32")):
        wide = x.astype(np.float64)
        for batch_size in (2, None):  # None: a direct call
            with cs.capture(model, "m/ident", reduce=stats) as cap:
                if batch_size is None:
                    model(x)
                else:
                    model.predict(x, batch_size=batch_size, verbose=0)
            assert cap["m/ident:output/std"] == pytest.approx(wide.std(), rel=1e-5, abs=0)
            if "rms" in stats:
                assert cap["m/ident:output/rms"] == pytest.approx(
                    np.sqrt((wide ** 2).mean()), rel=1e-5, abs=0)


@pytest.mark.parametrize("data", ["normal", "offset", "constant", "near_constant"])
def test_std_and_rms_of_long_or_alike_values_keep_float32s_rounding(data):
    """torch's CPU dot product sums squares in float32 accumulators whose errors
    grow with length and, for values alike, all lean one way: the rms of 256 x
    512 constant values was off by 5e-5, the std of 4M normal ones by 1.2e-5,
    where a float32 sum is off by about 1e-7 (TF's by 2e-6 at most). The
    partials of each kind, against float64."""
    rng = np.random.default_rng(8)
    x = {"normal": lambda: rng.normal(size=(2048, 2051)),
         "offset": lambda: 3.0 + rng.normal(size=(2048, 2051)),
         "constant": lambda: np.full((256, 512), 1e4),
         "near_constant": lambda: rng.uniform(1e4, 1.0001e4, size=(512, 512))}[data]()
    x = x.astype("float32")
    wide = x.astype(np.float64)
    for stats in (("mean", "std"), ("rms",)):
        parts = _device_partials(x, stats)
        if "std" in stats:
            assert parts["sd"][0] == pytest.approx(wide.std(), rel=3e-6, abs=1e-9)
        else:
            assert parts["qm"][0] == pytest.approx(np.sqrt((wide ** 2).mean()), rel=3e-6)


@pytest.mark.parametrize("jit_compile", JIT)
@pytest.mark.parametrize("stats", [("mean",), ("mean", "std"), ("std", "rms")])
def test_a_mean_whose_sum_overflows_reads_inf_whatever_else_is_asked(jit_compile, stats):
    """The documented limit: the mean of values whose float32 sum passes 3.4e38 is
    inf (its std NaN). Asked with `std`, the mean's correction by its deviations
    (all -inf) made it NaN, so the mean read differently by what else was asked.
    One batch and three merged, with an inf element (the masked partials) and
    without (the sum alone overflows), and a direct call."""
    model = _ident()
    model.compile(jit_compile=jit_compile)
    for x in (np.full((6, 4), 3e38, "float32"),
              np.where(np.eye(6, 4) > 0, np.inf, 3e38).astype("float32")):
        for batch_size in (6, 2, None):  # None: a direct call
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)  # (none from the merge)
                with cs.capture(model, "m/ident", reduce=stats) as cap:
                    if batch_size is None:
                        model(x)
                    else:
                        model.predict(x, batch_size=batch_size, verbose=0)
            if "mean" in stats:
                assert cap["m/ident:output/mean"] == np.inf
            assert np.isnan(cap["m/ident:output/std"]) if "std" in stats else True
            if "rms" in stats:  # worked out from std there, as README says
                assert np.isnan(cap["m/ident:output/rms"])


@pytest.mark.parametrize("jit_compile", JIT)
def test_values_outside_the_range_still_count_in_the_edge_bins(jit_compile):
    model = _ident()
    model.compile(jit_compile=jit_compile)
    x = np.array([[-1e30, -3.0, np.nan, 0.25], [3.0, 1e30, -np.inf, 1.0]], "float32")
    with cs.capture(model, "*", reduce="hist", hist_range=RANGE, bins=BINS) as cap:
        model.predict(x, batch_size=2, verbose=0)
    for key in _keys(cap, "hist"):
        np.testing.assert_array_equal(cap[key], [2, 0, 1, 3])


@pytest.mark.parametrize("jit_compile", JIT)
def test_no_finite_value_at_all_gives_nan_statistics_and_zero_counts(jit_compile):
    model = _ident()
    model.compile(jit_compile=jit_compile)
    x = np.full((5, 4), np.nan, "float32")
    x[1, :2] = np.inf
    x[3, 3] = -np.inf
    with cs.capture(model, "*", reduce=ALL, hist_range=RANGE, bins=BINS) as cap:
        model.predict(x, batch_size=2, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check(cap, _reference(x))
    for key in _keys(cap, "hist"):
        np.testing.assert_array_equal(cap[key], np.zeros(BINS))
    for key in _keys(cap, "nan_count"):
        assert cap[key] == 17


@pytest.mark.parametrize("jit_compile", JIT)
def test_fit_gives_nan_for_a_step_with_no_finite_value(jit_compile):
    inputs = keras.Input((4,))
    h = keras.layers.Lambda(lambda x: x * 1.0, name="ident")(inputs)
    h = keras.layers.Lambda(lambda x: keras.ops.nan_to_num(x, nan=0.0, posinf=0.0,
                                                           neginf=0.0), name="clean")(h)
    model = cs.Model(inputs, keras.layers.Dense(1, name="head")(h), name="m")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", jit_compile=jit_compile)
    x = np.random.default_rng(2).normal(size=(12, 4)).astype("float32")
    x[4:8] = np.nan  # step 1: nothing finite
    x[8, 0], x[9, 1] = np.inf, np.nan
    stats = ("mean", "std", "min", "frac_zero", "hist", "nan_count", "inf_count")
    with cs.capture(model, lambda point, layer: layer.name == "ident", reduce=stats,
                    hist_range=RANGE, bins=BINS) as cap:
        model.fit(x, np.zeros((12, 1), "float32"), batch_size=4, epochs=1, verbose=0,
                  shuffle=False)
    refs = [_reference(x[i:i + 4]) for i in (0, 4, 8)]
    for stat in stats:
        (key,) = _keys(cap, stat)
        value = cap[key]
        expected = np.array([r[stat] for r in refs], np.float64)
        assert value.shape == expected.shape, key
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6, err_msg=key)


def test_float16_overflow_shows_as_inf_count_and_is_left_out_of_the_mean():
    model = cs.Sequential([keras.Input((4,)),
                           keras.layers.Dense(4, dtype="mixed_float16", name="big",
                                              kernel_initializer=keras.initializers.Constant(300.0))],
                          name="m")
    x = np.ones((8, 4), "float32")
    x[:4] = 300.0  # outputs 360000: inf in float16; the other rows give 1200
    with cs.capture(model, "*", reduce=("mean", "max", "inf_count", "nan_count")) as cap:
        out = model.predict(x, batch_size=4, verbose=0)
    assert np.isinf(out[:4]).all()
    for key in _keys(cap, "inf_count"):
        assert cap[key] == 16
    for key in _keys(cap, "nan_count"):
        assert cap[key] == 0
    for stat in ("mean", "max"):
        for key in _keys(cap, stat):
            assert cap[key] == pytest.approx(1200.0)


# The host merge, directly.

def _rows(*parts):
    """Partials with a step axis from a list of dicts of scalars or arrays."""
    return {k: np.stack([np.asarray(p[k], np.float32) for p in parts]) for k in parts[0]}


def _partials_of(values):
    """Partials of one step as the device would give them (float32 values)."""
    f = np.asarray(values, np.float64)
    f = f[np.isfinite(f)]
    mean = f.mean() if f.size else 0.0
    return {"n": f.size, "mean": mean, "dmean": 0.0, "sd": f.std() if f.size else 0.0,
            "qm": np.sqrt((f ** 2).mean()) if f.size else 0.0,
            "min": f.min() if f.size else np.inf, "max": f.max() if f.size else -np.inf,
            "absmax": np.abs(f).max() if f.size else -np.inf, "nzero": (f == 0).sum(),
            "nnan": np.isnan(values).sum(), "ninf": np.isinf(values).sum(),
            "hist": np.histogram(np.clip(f, *RANGE), BINS, RANGE)[0]}


def test_merge_skips_rows_with_no_data_even_if_their_mean_is_nan():
    a, b = [0.5, -2.0, 3.0], [1.0, 0.0]
    empty = dict(_partials_of([]), mean=np.nan, sd=np.nan, qm=np.nan)  # e.g. an idle replica
    rows = _rows(_partials_of(a), empty, _partials_of(b), empty)
    with np.errstate(all="raise"), warnings.catch_warnings():
        warnings.simplefilter("error")
        merged = _reduce.merge(rows)
        both = np.array(a + b)
        assert merged["n"] == 5
        assert _reduce.finalize(merged, "mean") == pytest.approx(both.mean())
        assert _reduce.finalize(merged, "std") == pytest.approx(both.std())
        assert _reduce.finalize(merged, "rms") == pytest.approx(np.sqrt((both ** 2).mean()))
        with_std = {k: v for k, v in merged.items() if k != "qm"}  # rms from mean and sd
        assert _reduce.finalize(with_std, "rms") == pytest.approx(np.sqrt((both ** 2).mean()))
        assert _reduce.finalize(merged, "min") == -2.0
        assert _reduce.finalize(merged, "absmax") == 3.0
        assert _reduce.finalize(merged, "frac_zero") == pytest.approx(0.2)


def test_merge_each_gives_one_row_per_step_from_its_replicas_rows():
    # Under tf.distribute a step's partials have one row per replica; an idle
    # replica's row is no data.
    a, b, c = [0.5, -2.0, 3.0], [1.0, 0.0], [4.0, np.nan]
    empty = dict(_partials_of([]), mean=np.nan, sd=np.nan)
    steps = [_rows(_partials_of(a), _partials_of(b)), _rows(_partials_of(c), empty)]
    with np.errstate(all="raise"), warnings.catch_warnings():
        warnings.simplefilter("error")
        merged = _reduce.merge_each(steps)
    for stat, want in (("mean", [np.mean(a + b), 4.0]), ("std", [np.std(a + b), 0.0]),
                       ("min", [-2.0, 4.0]), ("nan_count", [0, 1])):
        np.testing.assert_allclose(_reduce.per_step(merged, stat), want, rtol=1e-6)
    assert _reduce.per_step(merged, "hist").shape == (2, BINS)
    np.testing.assert_array_equal(_reduce.per_step(merged, "hist").sum(axis=1), [5, 1])
    # One row per step (one device): the rows themselves, stacked.
    single = _reduce.merge_each([_rows(_partials_of(a)), _rows(_partials_of(b))])
    np.testing.assert_allclose(_reduce.per_step(single, "mean"), [np.mean(a), np.mean(b)],
                               rtol=1e-6)


def test_merge_with_no_data_at_all_gives_nan_without_warnings():
    rows = _rows(_partials_of([np.nan, np.inf]), dict(_partials_of([]), mean=np.nan))
    with np.errstate(all="raise"), warnings.catch_warnings():
        warnings.simplefilter("error")
        merged = _reduce.merge(rows)
        assert merged["n"] == 0
        for stat in FINITE_STATS:
            assert np.isnan(_reduce.finalize(merged, stat)), stat
        assert _reduce.finalize(merged, "nan_count") == 1
        assert _reduce.finalize(merged, "inf_count") == 1
        np.testing.assert_array_equal(_reduce.finalize(merged, "hist"), np.zeros(BINS))


def test_per_step_gives_nan_for_a_step_with_no_data_without_warnings():
    steps = [[0.5, 2.0], [np.nan, -np.inf], [], [0.0, -1.0, np.nan]]
    rows = _rows(*[_partials_of(s) for s in steps])
    refs = [_reference(s) for s in steps]
    with np.errstate(all="raise"), warnings.catch_warnings():
        warnings.simplefilter("error")
        for stat in ALL:
            expected = np.array([r[stat] for r in refs], np.float64)
            np.testing.assert_allclose(_reduce.per_step(rows, stat), expected, err_msg=stat)


def test_merge_is_exact_chan_over_many_uneven_rows():
    rng = np.random.default_rng(3)
    chunks = [rng.normal(1e3, 1.0, size=s) for s in (1, 7, 0, 64, 3)]
    rows = _rows(*[_partials_of(c) for c in chunks])
    both = np.concatenate(chunks)
    merged = _reduce.merge(rows)
    assert _reduce.finalize(merged, "mean") == pytest.approx(both.mean(), rel=1e-7)
    assert _reduce.finalize(merged, "std") == pytest.approx(both.std(), rel=1e-5)


# The device partials, directly, on this backend.

def _device_partials(x, stats=ALL):
    parts = _reduce.partials(keras.ops.convert_to_tensor(x), stats, bins=BINS,
                             hist_range=RANGE)
    return {k: numpy(v) for k, v in parts.items()}


def _joined(parts):
    """Partials with the mean's correction added to it, in float64: the paths
    split the mean between `mean` and `dmean` each its own way."""
    parts = {name: np.asarray(value) for name, value in parts.items()}
    if "dmean" in parts:
        parts["mean"] = parts["mean"].astype(np.float64) + parts.pop("dmean")
    return parts


def _check_partials(parts, x, stats=ALL):
    expected = _partials_of(np.asarray(x, np.float64).ravel())
    expected = {name: expected[name] for name in _reduce.needs(stats)}
    assert sorted(parts) == sorted(expected)
    for name, value in parts.items():
        assert value.shape == (1, BINS) if name == "hist" else value.shape == (1,), name
        assert value.dtype == np.float32, name
    for name, value in _joined(parts).items():
        np.testing.assert_allclose(value[0], expected[name], rtol=1e-5, atol=1e-5,
                                   err_msg=name)


def test_partials_of_a_tensor_with_nan_and_inf():
    x = np.array([[1.0, np.nan, -np.inf], [0.0, 2.0, np.inf], [5.0, -3.0, 0.5]], "float32")
    parts = _device_partials(x)
    _check_partials(parts, x)
    assert parts["n"][0] == 6 and parts["nnan"][0] == 1 and parts["ninf"][0] == 2
    np.testing.assert_array_equal(parts["hist"][0], [1, 0, 1, 4])
    for stats in RMS_SETS:  # the root mean square of the finite values: sqrt(39.25 / 6)
        parts = _device_partials(x, stats)
        _check_partials(parts, x, stats)
        assert parts["qm"][0] == pytest.approx(np.sqrt(39.25 / 6), rel=1e-6)


@pytest.mark.parametrize("x", [np.zeros((0, 3), "float32"), np.full((2, 2), np.nan, "float32"),
                               np.array([np.inf, -np.inf], "float32")],
                         ids=["empty", "all_nan", "all_inf"])
def test_partials_with_no_finite_value_hold_identities(x):
    parts = _device_partials(x)
    _check_partials(parts, x)
    assert parts["mean"][0] == 0 and parts["dmean"][0] == 0 and parts["sd"][0] == 0  # never NaN
    assert parts["min"][0] == np.inf and parts["max"][0] == -np.inf
    assert parts["absmax"][0] == -np.inf
    assert _device_partials(x, ("rms",))["qm"][0] == 0  # never NaN


def test_partials_hold_only_what_the_statistics_need():
    x = np.array([np.nan, 1.0, np.inf], "float32")
    assert sorted(_device_partials(x, ("nan_count",))) == ["nnan"]
    assert sorted(_device_partials(x, ("inf_count", "min"))) == ["min", "n", "ninf"]


@pytest.mark.skipif(BACKEND == "torch", reason="torch runs the partials eagerly")
def test_partials_compile_with_static_shapes():
    x = np.array([[1.0, np.nan, -np.inf, 0.0], [0.5, 9.0, np.inf, -0.75]], "float32")
    if BACKEND == "jax":
        import jax

        fn = jax.jit(lambda t: _reduce.partials(t, ALL, BINS, RANGE))
    else:
        import tensorflow as tf

        fn = tf.function(lambda t: _reduce.partials(t, ALL, BINS, RANGE), jit_compile=True)
    parts = {k: numpy(v) for k, v in fn(keras.ops.convert_to_tensor(x)).items()}
    _check_partials(parts, x)


@pytest.mark.parametrize("data", ["finite", "masked", "mostly_nan"])
@pytest.mark.parametrize("size", [2**24 - 3, 2**24 + 2**20 + 6],
                         ids=["under_2**24", "over_2**24"])
def test_counts_are_exact_either_side_of_2_to_the_24(size, data):
    """Under 2**24 elements a count is a float32 sum of 0s and 1s (XLA compiles
    it faster than an integer one), from there an integer sum. Before: 3 zeros
    among 2**24 + 2**20 + 3 ones read 2 (size less a float32 count of the
    non-zeros), TF's graph counted a histogram bin to 2**24 at most, and torch
    read 7 finite values among 2**24 NaN as 6 (size less a float32 count)."""
    x = np.full(size, np.nan if data == "mostly_nan" else 1.0, "float32")
    x[[0, 1, 100]] = 1.0
    x[[5, 1000, size - 1]] = 0.0
    if data != "finite":
        x[[3, size - 2]] = np.nan
        x[[9, size - 9, 4]] = np.inf
    finite = np.isfinite(x).sum()
    assert (x == 0).sum() == 3
    assert finite == {"finite": size, "masked": size - 5, "mostly_nan": 6}[data]
    stats = ("frac_zero", "nan_count", "inf_count", "hist")

    def fn(t):
        return _reduce.partials(t, stats, bins=2, hist_range=(0.0, 2.0))

    if BACKEND == "jax":
        import jax

        parts = jax.jit(fn)(x)
    elif BACKEND == "tensorflow":
        import tensorflow as tf

        parts = tf.function(fn)(x)  # a graph, as Keras's fit on a CPU (no XLA)
    else:
        parts = fn(keras.ops.convert_to_tensor(x))
    parts = {name: numpy(value)[0].tolist() for name, value in parts.items()}
    f32 = lambda count: float(np.float32(count))  # noqa: E731
    assert parts == {"n": f32(finite), "nzero": 3.0, "nnan": f32(np.isnan(x).sum()),
                     "ninf": f32(np.isinf(x).sum()), "hist": [3.0, f32(finite - 3)]}


FINITE_CASES = ["relu", "offset", "overflow", "zeros", "squares_overflow"]


def _finite_branch_cases():
    rng = np.random.default_rng(3)
    relu = np.maximum(rng.normal(size=(16, 4)), 0).astype("float32")  # many zeros
    offset = (1e4 + rng.normal(size=(16, 4))).astype("float32")  # mean >> std
    overflow = np.full((4, 4), 3e38, "float32")  # finite, but the sum is inf
    # The sum is finite, the squares are not (|x| > 1.8e19); about the mean they are.
    squares_overflow = (1e20 + 1e18 * rng.normal(size=(4, 4))).astype("float32")
    return [relu, offset, overflow, np.full((3, 4), -0.0, "float32"), squares_overflow]


@pytest.mark.skipif(BACKEND == "torch", reason="torch has its own fast path (below)")
@pytest.mark.parametrize("stats", [ALL, *RMS_SETS], ids=["all", "rms_absmax", "rms_mean"])
@pytest.mark.parametrize("x", _finite_branch_cases(), ids=FINITE_CASES)
def test_the_unmasked_branch_gives_what_the_masked_one_gives(x, stats):
    """A tensor whose deciding sum is finite takes `_finite_partials`; its values
    must be those of the masked computation, compiled as in a step. The overflow
    cases (finite elements, an infinite sum of values or of squares) take the
    masked branch, where the root mean square is still right (scaled)."""
    if BACKEND == "jax":
        import jax

        compiled = jax.jit
    else:
        import tensorflow as tf

        compiled = functools.partial(tf.function, jit_compile=True)
    flat = keras.ops.reshape(keras.ops.convert_to_tensor(x), (-1,))
    needed = _reduce.needs(stats)
    fast = compiled(lambda t: _reduce.partials(t, stats, BINS, RANGE))(flat)
    masked = compiled(lambda t: _reduce._masked_partials(t, needed, BINS, RANGE))(flat)
    assert sorted(fast) == sorted(masked)
    fast = {name: numpy(value) for name, value in fast.items()}
    masked = _joined({name: numpy(value)[None] for name, value in masked.items()})
    for name, value in _joined(fast).items():
        np.testing.assert_allclose(value[0], masked[name][0], rtol=1e-6, err_msg=name)
    with np.errstate(over="ignore"):
        finite_sum = np.isfinite(x.sum(dtype=np.float32))
    if finite_sum or "mean" not in needed:  # no mean: every partial is right
        _check_partials({k: numpy(v) for k, v in fast.items()}, x, stats)


@pytest.mark.skipif(BACKEND != "torch", reason="the plain-torch fast path")
@pytest.mark.parametrize("stats", [ALL, *RMS_SETS], ids=["all", "rms_absmax", "rms_mean"])
@pytest.mark.parametrize("x", _finite_branch_cases(), ids=FINITE_CASES)
def test_torch_unmasked_partials_match_numpy_and_the_keras_ops_path(x, stats, monkeypatch):
    """On the CPU, torch works M2 out as the sum of squares less `total * mean`,
    and sums about the mean where that cancels: the offset case (mean 1e4, std 1)
    would keep almost no correct bits in float32 otherwise. The root mean square
    of squares past float32's range is scaled."""
    fast = _device_partials(x, stats)
    with np.errstate(over="ignore"):
        finite_sum = np.isfinite(x.sum(dtype=np.float32))
    if finite_sum or "mean" not in _reduce.needs(stats):
        _check_partials(fast, x, stats)
    monkeypatch.setattr(_reduce, "_TORCH", False)
    slow = _device_partials(x, stats)
    assert sorted(fast) == sorted(slow)
    slow = _joined(slow)
    for name, value in _joined(fast).items():
        np.testing.assert_allclose(value, slow[name], rtol=1e-6, err_msg=name)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="only TF traces unknown lengths")
def test_a_length_unknown_when_traced_may_be_empty_or_not():
    """Keras's TF steps are traced with an unknown batch size: the unmasked branch
    then meets empty tensors too (their sum is finite), and must give the masked
    branch's identities."""
    import tensorflow as tf

    fn = tf.function(lambda t: _reduce.partials(t, ALL, BINS, RANGE),
                     input_signature=[tf.TensorSpec([None, 3], tf.float32)])
    for x in (np.zeros((0, 3), "float32"), np.array([[1.0, 0.0, -2.0]], "float32"),
              np.array([[1.0, np.nan, np.inf]], "float32")):
        parts = {k: numpy(v) for k, v in fn(tf.constant(x)).items()}
        _check_partials(parts, x)
        if not x.size:
            assert parts["min"][0] == np.inf and parts["max"][0] == -np.inf
            assert parts["mean"][0] == 0 and parts["dmean"][0] == 0 and parts["sd"][0] == 0


@pytest.mark.skipif(BACKEND != "torch", reason="the plain-torch fast path")
@pytest.mark.parametrize("x", [np.array([[1.0, np.nan, -np.inf, 0.0], [0.5, 9.0, np.inf, -0.75]],
                                        "float32"),
                               np.zeros((0, 4), "float32"), np.full((3,), np.nan, "float32")],
                         ids=["mixed", "empty", "all_nan"])
@pytest.mark.parametrize("stats", [ALL, *RMS_SETS], ids=["all", "rms_absmax", "rms_mean"])
def test_torch_fast_path_matches_the_keras_ops_path(x, stats, monkeypatch):
    fast = _device_partials(x, stats)
    monkeypatch.setattr(_reduce, "_TORCH", False)
    slow = _device_partials(x, stats)
    assert sorted(fast) == sorted(slow)
    slow = _joined(slow)
    for name, value in _joined(fast).items():
        np.testing.assert_allclose(value, slow[name], rtol=1e-6, err_msg=name)


def test_the_new_statistics_are_accepted_and_documented():
    assert _reduce.check_stats(("nan_count", "inf_count")) == ("nan_count", "inf_count")
    doc = _reduce.__doc__
    for stat in _reduce.STATS:
        assert f"`{stat}`" in doc, stat
    assert "finite" in doc and "NaN" in doc and "inf" in doc


def test_hist_range_from_the_first_batch_leaves_non_finite_values_out():
    model = _ident()
    x = np.array([[np.nan, -0.5, np.inf, 2.0], [-np.inf, 0.0, 1.0, np.nan],
                  [9.0, np.nan, -9.0, 0.0]], "float32")
    with cs.capture(model, "*", reduce=("hist", "nan_count"), bins=BINS) as cap:
        model.predict(x, batch_size=2, verbose=0)
    for key in _keys(cap, "hist"):
        np.testing.assert_allclose(cap.hist_edges(key), np.linspace(-0.5, 2.0, BINS + 1))
        np.testing.assert_array_equal(cap[key], [4, 0, 1, 2])  # 9 and -9 in the edge bins


@pytest.mark.parametrize("ratio", [0.0, 0.99, 1.01, 100.0])
def test_std_of_a_large_tensor_is_right_to_float32s_rounding(ratio):
    """M2 as the sum of squares less total * mean (one pass: JAX's dot product,
    torch's) is taken only where that cancels at most half of the sum (the mean
    at most the standard deviation); past that, M2 is summed about the mean.
    Each side of that edge, and far past it, on a step-sized tensor, compiled."""
    rng = np.random.default_rng(7)
    x = (ratio + rng.normal(size=(256, 512))).astype("float32")
    expected = _partials_of(np.asarray(x, np.float64).ravel())
    if BACKEND == "jax":
        import jax

        fn = jax.jit(lambda t: _reduce.partials(t, ("mean", "std"), BINS, RANGE))
    elif BACKEND == "tensorflow":
        import tensorflow as tf

        fn = tf.function(lambda t: _reduce.partials(t, ("mean", "std"), BINS, RANGE),
                         jit_compile=True)
    else:
        fn = lambda t: _reduce.partials(t, ("mean", "std"), BINS, RANGE)  # noqa: E731
    parts = {k: numpy(v) for k, v in fn(keras.ops.convert_to_tensor(x)).items()}
    std = expected["sd"]
    # The mean's error against the spread (at ratio 0 the mean itself is ~0).
    mean = _joined(parts)["mean"][0]
    assert abs(mean - expected["mean"]) < 2e-6 * max(std, abs(expected["mean"]))
    assert abs(parts["sd"][0] / std - 1) < 1e-6


# Mixed precision: statistics of the values a bfloat16 layer returned.

class _Amp(keras.layers.Layer):
    """Values in +-1234.5 with bits far below bfloat16's 8: its rounding shows."""

    def call(self, x):
        return keras.ops.tanh(x * 3.7) * 1234.5


def _bf16_model():
    inputs = keras.Input((8,))
    h = _Amp(name="amp")(keras.layers.Dense(16, name="d1")(inputs))
    return cs.Model(inputs, keras.layers.Dense(2, name="d2")(h), name="m")


def _check_against_captured(stats, key, steps, values, hist_range):
    """`stats[key]`'s mean, min, max and hist (one row per step where `steps` > 1)
    against numpy float64 statistics of the full capture's `values` (bfloat16)."""
    assert values.dtype.name == "bfloat16", values.dtype
    rows = np.asarray(values, np.float64).reshape(steps, -1)
    # The float32 sums' rounding is a part in 2**24 of the sum of |values|: the
    # mean is checked against the spread (XLA's dropped rounding was 1e-4 of it).
    np.testing.assert_allclose(stats[f"{key}/mean"], rows.mean(1).squeeze(), rtol=0,
                               atol=1e-6 * np.abs(rows).max(), err_msg=key)
    np.testing.assert_array_equal(stats[f"{key}/min"], rows.min(1).squeeze(), err_msg=key)
    np.testing.assert_array_equal(stats[f"{key}/max"], rows.max(1).squeeze(), err_msg=key)
    edges = stats.hist_edges(key)
    np.testing.assert_allclose(edges, np.linspace(*hist_range, len(edges)))
    hist = [np.histogram(np.clip(row, *hist_range), edges)[0] for row in rows]
    np.testing.assert_array_equal(stats[f"{key}/hist"], np.squeeze(hist), err_msg=key)


def _power_of_two_range(values):
    """(-r, r) for the smallest power of two r over every |value|: with as many
    bins as a power of two, the bin edges and bin indices are exact."""
    r = 2.0 ** np.ceil(np.log2(np.abs(np.asarray(values, np.float64)).max()))
    return (-r, r)


def test_statistics_of_a_bfloat16_output_are_of_its_rounded_values_in_predict():
    """On JAX, XLA computed the layer in float32 and (allowed excess precision)
    dropped the float32 -> bfloat16 -> float32 round trip of the layer's cast and
    the statistics' own: they were of values the layer never returned (a mean
    off by 1e-4 of the spread, a min no bfloat16 holds, counts in other bins)."""
    keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
    try:
        model = _bf16_model()
        x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
        with cs.capture(model, "m/amp") as full:
            model.predict(x, batch_size=16, verbose=0)
        hist_range = (-2048.0, 2048.0)
        with cs.capture(model, "m/amp", reduce=("mean", "min", "max", "hist"),
                        hist_range=hist_range, bins=128) as stats:
            model.predict(x, batch_size=16, verbose=0)  # 4 steps, merged
        _check_against_captured(stats, "m/amp:output", 1, full["m/amp:output"], hist_range)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")


def test_statistics_of_a_bfloat16_output_and_gradient_are_of_their_rounded_values_in_fit():
    """The same in fit, one row per step, for the output and its gradient (also
    bfloat16): a learning rate of 0 keeps the weights, so both fits see the same
    values."""
    keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
    try:
        model = _bf16_model()
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
        rng = np.random.default_rng(0)
        x = rng.normal(size=(64, 8)).astype("float32")
        y = rng.normal(size=(64, 2)).astype("float32")
        kinds = ("output", "grad")
        with cs.capture(model, "m/amp", kinds=kinds) as full:
            model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
        ranges = {kind: _power_of_two_range(full[f"m/amp:{kind}"]) for kind in kinds}
        with cs.capture(model, "m/amp", kinds=kinds, reduce=("mean", "min", "max", "hist"),
                        hist_range=ranges, bins=128) as stats:
            model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
        for kind in kinds:
            key = f"m/amp:{kind}"
            assert stats[f"{key}/mean"].shape == (4,), key
            _check_against_captured(stats, key, 4, full[key], ranges[kind])
    finally:
        keras.mixed_precision.set_dtype_policy("float32")


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's cond outside a trace compiles")
def test_statistics_run_op_by_op_pick_their_branch_in_python(monkeypatch):
    """JAX's `cond` outside a trace compiles both branches at every call: a direct
    call of an 8 x Dense(64) model under `reduce=("mean", "std")` took 4 s, and 10
    steps of a predict run eagerly 42 s. Run op by op the decision is a value, and
    Python picks the branch (the finite one, or the masked one for a NaN); a
    compiled step still picks it on the device."""
    conds = []
    real_cond = keras.ops.cond
    monkeypatch.setattr(keras.ops, "cond", lambda *a, **k: conds.append(1) or real_cond(*a, **k))
    model = _ident()
    x = _data()[3:]  # finite rows, then NaN and inf among finite values
    for rows in (x[:1], x):
        with cs.capture(model, "m/ident", reduce=ALL, hist_range=RANGE, bins=BINS) as cap:
            model(rows)
        _check(cap, _reference(rows))
    assert conds == []
    model.compile(run_eagerly=True)
    with cs.capture(model, "m/ident", reduce=ALL, hist_range=RANGE, bins=BINS) as cap:
        model.predict(x, batch_size=3, verbose=0)
    _check(cap, _reference(x))
    assert conds == []
    model.compile(jit_compile=True)
    with cs.capture(model, "m/ident", reduce=ALL, hist_range=RANGE, bins=BINS) as cap:
        model.predict(x, batch_size=3, verbose=0)
    _check(cap, _reference(x))
    assert conds  # traced: on the device


class _SowsComplex(keras.layers.Layer):
    def call(self, x):
        i = keras.ops.convert_to_tensor(np.array(1j, "complex64"))
        cs.sow(self, "v", keras.ops.cast(x, "complex64") * i)
        if BACKEND == "tensorflow":
            import tensorflow as tf

            cs.sow(self, "s", tf.strings.as_string(x))
        return x


@pytest.mark.parametrize("what", ["v", "s"] if BACKEND == "tensorflow" else ["v"])
def test_statistics_of_complex_or_string_values_are_refused(what):
    # A complex value's imaginary part was dropped without a word (every statistic
    # of 1j * x read 0: absmax 0, frac_zero 1); a TF string failed inside the step
    # with a bare UnimplementedError. (Strings are tensors on TF only.)
    model = cs.Sequential([keras.Input((3,)), _SowsComplex(name="p")], name="m")
    x = np.random.default_rng(1).normal(size=(10, 3)).astype("float32")
    dtype = {"v": "complex64", "s": "string"}[what]
    for call in (lambda: model.predict(x, batch_size=4, verbose=0), lambda: model(x)):
        with pytest.raises(TypeError, match=r"cs.capture\(reduce=...\) computes statistics of "
                           rf"real numbers, and `m/p/{what}:output` holds {dtype} values.*"
                           rf"Received: `m/p/{what}:output` of dtype {dtype}"):
            with cs.capture(model, f"m/p/{what}", reduce=("mean", "absmax")):
                call()
    with cs.capture(model, "m/p/v") as full:  # in full, as it is
        model.predict(x, batch_size=4, verbose=0)
    np.testing.assert_array_equal(full["m/p/v:output"], x.astype("complex64") * 1j)
