"""Statistics of bfloat16 and float16 values are of the values the layer returned,
under each backend's compiler: `jax.jit`, `tf.function(jit_compile=True)` (XLA)
and `torch.compile` (Inductor).

A compiler that computes a half-precision value in float32 may drop the round trip
of the layer's cast to it and the statistics' cast back: Inductor keeps the
float32 value where the two fuse, and XLA, allowed excess precision, simplifies
the pair away. The statistics then described values the layer never returned (on
torch, a mean off by 1e-4 of the spread, a min and max no bfloat16 holds, an
overflow to inf counted as a finite value). Each test compares them with numpy
statistics of the exactly rounded values: `ml_dtypes` rounding of the float32
values cast, or the full capture of the same call.
"""

import keras
import ml_dtypes
import numpy as np
import pytest
from conftest import BACKEND, numpy

import callscope as cs
from callscope import _reduce

HALF = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
STATS = ("mean", "std", "min", "max", "absmax", "frac_zero", "hist", "nan_count", "inf_count")
# What torch.compile fuses whole with the value's own ops: `hist` breaks its graph
# (`bincount`'s output shape depends on the data), and `std`'s second pass, about
# the mean, read the value as stored and corrected the mean by it.
FUSED = ("mean", "min", "max", "absmax", "frac_zero", "nan_count", "inf_count")
STAT_SETS = pytest.mark.parametrize("stats", [FUSED, STATS], ids=["fused", "with_hist"])


def _compiled(fn):
    """`fn` compiled as the backend's compiled steps are."""
    if BACKEND == "jax":
        import jax

        return jax.jit(fn)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(fn, jit_compile=True)
    import torch

    return torch.compile(fn)


def _bitcast(x, dtype):
    if BACKEND == "jax":
        import jax

        return jax.lax.bitcast_convert_type(x, dtype)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.bitcast(x, tf.as_dtype(dtype))
    import torch

    return x.view(getattr(torch, dtype))


def _same_floats(got, want):
    """Bit for bit, any NaN for a NaN."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    same = (got.view(np.int32) == want.view(np.int32)) | (np.isnan(got) & np.isnan(want))
    return bool(same.all())


@pytest.mark.parametrize("dtype", sorted(HALF))
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_every_half_precision_value_is_read_back_from_its_bits_exactly(dtype, compiled):
    """`_from_bits`, which torch.compile and TF's XLA read statistics through, over
    all 2**16 bit patterns: zeros of both signs, subnormals, normals, inf, NaN."""
    bits = np.arange(-(2**15), 2**15).astype(np.int16)
    value = _bitcast(keras.ops.convert_to_tensor(bits), dtype)

    def read(v):
        return _reduce._from_bits(v, _bitcast)

    got = numpy((_compiled(read) if compiled else read)(value))
    assert got.dtype == np.float32
    assert _same_floats(got, bits.view(HALF[dtype]).astype(np.float32))


def _edge_values(dtype):
    """float32 values whose rounding to `dtype` shows: ties (to even) and values
    either side of them, values past its largest (inf), for float16 values that
    round to 0 or to a subnormal, NaN and inf, among values of a spread about
    1000."""
    rng = np.random.default_rng(0)
    spread = (rng.normal(size=4000) * 1000).astype(np.float32)
    dropped = 16 if dtype == "bfloat16" else 13  # float32 mantissa bits it lacks
    keep = np.uint32(~((1 << dropped) - 1) & 0xFFFFFFFF)
    tie = (spread.view(np.uint32) & keep) | np.uint32(1 << (dropped - 1))
    special = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, np.finfo(np.float32).max]
    if dtype == "float16":
        # Past its largest, and to 0 or a subnormal (float32 normal numbers; the
        # bfloat16 ones are float32 subnormals, which XLA on a CPU flushes to 0, and
        # its largest would overflow float32's sums).
        tiny = 2.0**-24
        special += [65504.0, 65519.99, 65520.0, -65569.0, tiny * 0.5, -tiny * 0.5,
                    tiny * 1.5, tiny * 0.75, tiny * 2.5, 2.0**-14 - tiny * 0.5]
    return np.concatenate([spread, tie.view(np.float32), (tie + 1).view(np.float32),
                           (tie - 1).view(np.float32), np.array(special, np.float32)])


def _numpy_stats(values, stats, hist_range, bins):
    x = np.asarray(values, np.float64).ravel()
    f = x[np.isfinite(x)]
    edges = np.linspace(*hist_range, bins + 1)
    every = {"mean": f.mean(), "std": f.std(), "min": f.min(), "max": f.max(),
             "absmax": np.abs(f).max(), "frac_zero": (f == 0).mean(),
             "hist": np.histogram(np.clip(f, *hist_range), edges)[0],
             "nan_count": np.isnan(x).sum(), "inf_count": np.isinf(x).sum()}
    return {stat: every[stat] for stat in stats}


def _assert_stats(got, want, label):
    """Statistics `got` against numpy's `want`: exact but for the mean and std,
    float32 sums (to a part in 1e6 of the largest value, where a dropped bfloat16
    rounding was a part in 1e4 of the spread)."""
    for stat, expected in want.items():
        value = np.squeeze(np.asarray(got[stat], np.float64))
        if stat in ("mean", "std"):
            assert abs(value - expected) <= 1e-6 * max(-want["min"], want["max"]), \
                (label, stat, value, expected)
        else:
            np.testing.assert_array_equal(value, expected, err_msg=f"{label} {stat}")


def _finalized(parts, stats):
    parts = {k: np.asarray(numpy(v), np.float64) for k, v in parts.items()}
    return {stat: _reduce.finalize(parts, stat) for stat in stats}


@STAT_SETS
@pytest.mark.parametrize("dtype", sorted(HALF))
def test_statistics_of_a_cast_in_a_compiled_function_are_of_its_rounded_values(dtype, stats):
    """The value is float32 data cast to `dtype` in the same compiled function as
    its statistics: the case a compiler fuses. Before the fix, torch.compile gave
    the float32 data's statistics (float32's largest value, inf in either dtype,
    counted finite: a mean of 2e34 for one of -15)."""
    x = _edge_values(dtype)
    hist_range, bins = (-4096.0, 4096.0), 1024  # edges and bin indices exact
    fn = _compiled(lambda t: _reduce.partials(keras.ops.cast(t, dtype), stats, bins, hist_range))
    got = _finalized(fn(keras.ops.convert_to_tensor(x)), stats)
    with np.errstate(over="ignore"):
        rounded = x.astype(HALF[dtype])
    _assert_stats(got, _numpy_stats(rounded, stats, hist_range, bins), dtype)


@STAT_SETS
@pytest.mark.parametrize("dtype", sorted(HALF))
def test_statistics_of_a_computed_value_are_of_the_value_the_function_returns(dtype, stats):
    """A value computed in `dtype` (in float32 by the compilers), returned by the
    compiled function beside its statistics: the returned values are the
    reference. Before the fix, torch.compile and TF's XLA both dropped the
    bfloat16 rounding here (a mean off by 2e-2 and 2e-3, where float32's sums are
    right to 1e-3)."""
    x = np.random.default_rng(1).normal(size=4096).astype("float32")
    hist_range, bins = (-2048.0, 2048.0), 1024
    ops = keras.ops

    def fn(t):
        value = ops.sin(ops.cast(t, dtype) * 3.7) * 1234.5
        return value, _reduce.partials(value, stats, bins, hist_range)

    value, parts = _compiled(fn)(ops.convert_to_tensor(x))
    value = numpy(value)
    assert value.dtype == HALF[dtype]
    _assert_stats(_finalized(parts, stats), _numpy_stats(value, stats, hist_range, bins), dtype)


class _Amp(keras.layers.Layer):
    """Values in +-100.5 whose low bits are far below either dtype's: the
    rounding of its output shows."""

    def call(self, x):
        return keras.ops.sin(x * 3.7) * 100.5


def _model():
    """One bfloat16 and one float16 point, each the output of its own layer."""
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, name="d1")(inputs)
    a = _Amp(name="bf", dtype="bfloat16")(h)
    b = _Amp(name="f16", dtype="float16")(h)
    joined = keras.layers.Concatenate(name="join")([a, b])
    return cs.Model(inputs, keras.layers.Dense(2, name="d2")(joined), name="m")


@STAT_SETS
@pytest.mark.parametrize("method", ["predict", "fit"])
def test_statistics_of_half_precision_points_under_jit_compile(method, stats):
    """`jit_compile=True` on every backend: the statistics of a bfloat16 and a
    float16 output (and in fit, their gradients, of the same dtypes) against the
    full capture of the same call, one row per step in fit. A first model of the
    same layers runs first: torch.compile then traces the step as one graph, where
    the layers and the statistics fuse."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.normal(size=(64, 2)).astype("float32")
    kinds = ("output", "grad") if method == "fit" else ("output",)
    points = ["m/bf", "m/f16"]
    hist_range = (-128.0, 128.0)
    for _ in range(2):  # the first also warms the layers' classes (see above)
        model = _model()
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", jit_compile=True)

        with cs.capture(model, points, kinds=kinds) as full, \
                cs.capture(model, points, kinds=kinds, reduce=stats,
                           hist_range=hist_range, bins=256) as reduced:
            if method == "fit":
                model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
            else:
                model.predict(x, batch_size=16, verbose=0)
        for key in [f"{p}:{k}" for p in points for k in kinds]:
            assert full[key].dtype == HALF["bfloat16" if "/bf:" in key else "float16"], key
            rows = np.asarray(full[key], np.float64).reshape(4 if method == "fit" else 1, -1)
            for step, row in enumerate(rows):
                # predict's statistics merge its 4 steps; fit's have a row per step
                got = {stat: reduced[f"{key}/{stat}"][step] if method == "fit"
                       else reduced[f"{key}/{stat}"] for stat in stats}
                _assert_stats(got, _numpy_stats(row, stats, hist_range, 256), f"{key} step {step}")


def test_float32_values_are_not_read_from_their_bits(monkeypatch):
    """Only half-precision values take `_from_bits`, and only where a compiler
    may drop their rounding: float32 statistics get no extra op."""
    def refuse(value, bitcast):
        raise AssertionError(f"read from bits: {value.dtype}")

    monkeypatch.setattr(_reduce, "_from_bits", refuse)
    x = keras.ops.convert_to_tensor(np.linspace(-3, 3, 64, dtype="float32"))
    _compiled(lambda t: _reduce.partials(t, STATS, 8, (-4.0, 4.0)))(x)
    _reduce.partials(x, STATS, 8, (-4.0, 4.0))
    # Eagerly a half-precision value is stored in its own dtype, rounded.
    _reduce.partials(keras.ops.cast(x, "bfloat16"), STATS, 8, (-4.0, 4.0))
