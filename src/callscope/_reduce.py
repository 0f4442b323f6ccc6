"""On-device statistics of captured tensors, and their exact merge on the host.

A compiled step cannot hand back a running aggregate, so each step returns small
*partials* per captured tensor: element count, mean (with `std`, in two float32
parts, `mean` and its correction `dmean`, which the host adds in float64: one
float32's rounding of each step's mean put a std merged over steps whose means
differed by about the spread, around 1e6, 0.6% off), standard deviation (`sd`,
the root of the centred sum of squares M2 over the count), root mean square (for
`rms` without `std`: one pass, where it would take the mean's and M2's three),
min, max, absmax, zero count, NaN and inf counts and
histogram counts, each with a
leading axis of 1 so that Keras can concatenate them across steps. The host merges
partials with Chan's parallel formula in float64, which is exact up to rounding
(never an average of per-batch means). Statistics are computed in float32 whatever
the compute dtype, so mixed precision does not overflow them. The spreads are
roots (`sd`, `qm`), never sums of squares, which float32 cannot hold for the
values of a vanishing gradient (squares under 1.2e-38, flushed to 0 on a CPU) or
of a huge one: each is computed from values scaled by their largest where the
plain sums would lose it, and squared again only on the host, in float64.

Statistics (`reduce=`): `mean`, `std`, `min`, `max`, `absmax`, `rms`, `frac_zero`,
`hist`, `nan_count` and `inf_count`.

Non-finite values: `nan_count` counts NaN elements and `inf_count` counts +inf and
-inf elements. Every other statistic leaves non-finite values out: it is over the
finite elements only (`frac_zero` is zeros / finite elements, and `hist` counts sum
to the number of finite elements; finite values outside `hist_range` still count in
the edge bins). A tensor, step or call with no finite elements (all NaN or inf, or
empty) gives NaN for `mean`, `std`, `rms`, `min`, `max`, `absmax` and `frac_zero`,
and all-zero `hist` counts; partials of such a step merge as "no data".
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Mapping

import keras
import numpy as np
from keras import ops

from callscope import _backend, _keras_compat

_TORCH = keras.backend.backend() == "torch"
_JAX = keras.backend.backend() == "jax"
_TF = keras.backend.backend() == "tensorflow"
STATS = ("mean", "std", "min", "max", "absmax", "rms", "frac_zero", "hist",
         "nan_count", "inf_count")
# Partials: n (finite elements), mean (plus dmean, its float32 correction, where
# sd is computed: the mean is their sum, in float64), sd (standard deviation) and
# qm (root mean square) over finite elements, min, max and absmax (identities
# +inf, -inf, -inf when n == 0), nzero, nnan, ninf, hist.
_NEEDS = {
    "mean": ("n", "mean"),
    "std": ("n", "mean", "dmean", "sd"),
    "rms": ("n", "qm"),  # from mean and sd instead where those are computed (`needs`)
    "min": ("n", "min"),
    "max": ("n", "max"),
    "absmax": ("n", "absmax"),
    "frac_zero": ("n", "nzero"),
    "hist": ("hist",),
    "nan_count": ("nnan",),
    "inf_count": ("ninf",),
}
# Exponent and mantissa bits of the narrow float dtypes whose rounding JAX keeps
# (and whose values torch.compile and TF's XLA read from their bits: `_from_bits`).
_OWN_PRECISION = {"bfloat16": (8, 7), "float16": (5, 10)}
_FINITE_ONLY = ("n", "mean", "dmean", "sd", "qm", "min", "max", "absmax", "nzero", "hist")
_SCALARS = ("n", "mean", "dmean", "sd", "qm", "min", "max", "absmax", "nzero", "nnan", "ninf")


def needs(stats) -> tuple:
    """The partials `stats` take, sorted. `rms` takes `qm`, one pass of squares,
    unless `mean` and `sd` are computed anyway (`std`): then it is worked out from
    them on the host, as `finalize` does, at no extra pass.

    >>> needs(("rms", "absmax")), needs(("rms", "std"))
    (('absmax', 'n', 'qm'), ('dmean', 'mean', 'n', 'sd'))
    """
    needed = {p for s in stats for p in _NEEDS[s]}
    if "sd" in needed:
        needed.discard("qm")
    return tuple(sorted(needed))


# torch asks at every point of every step, eagerly (not under torch.compile:
# dynamo traces through a cache's wrapper, and warns).
_cached_needs = functools.lru_cache(maxsize=256)(needs)


def check_stats(reduce) -> tuple[str, ...] | None:
    """Normalises `reduce=` to a tuple of statistic names, or raises."""
    if reduce is None:
        return None
    stats = (reduce,) if isinstance(reduce, str) else tuple(reduce)
    unknown = [s for s in stats if s not in STATS]
    if unknown or not stats:
        raise ValueError(
            f"`reduce` takes one or more of {', '.join(STATS)}. "
            f"Received: reduce={reduce!r}"
        )
    return stats


# Below this many elements, a float32 sum of 0s and 1s is an exact count: every
# partial sum is an integer under 2**24, exact in any order. From there it is not
# (TF's sums stop at 2**24, and size less a count of the rest rounds: 3 zeros
# among 20M ones read 4), and counts are integer sums.
_EXACT_IN_FLOAT32 = 2**24


def _counts_in_float32(length) -> bool:
    """Whether counts over `length` elements (None: unknown when traced) are exact
    as float32 sums."""
    return length is not None and length < _EXACT_IN_FLOAT32


def _count(mask):
    """The number of True elements of a flat mask, as float32 like every other
    partial (exact below 2**24), summed as float32 where that is exact
    (`_counts_in_float32`): XLA's CPU compiles an integer reduction about three
    times as slowly, and a compiled step holds one per count per point (the
    statistics of 60 tensors under `reduce=("mean", "std", "min", "max",
    "frac_zero", "nan_count", "inf_count")` compiled in 10.2 s, against 13.0)."""
    if _counts_in_float32(mask.shape[0]):
        return ops.sum(ops.cast(mask, "float32"))
    return ops.cast(ops.sum(ops.cast(mask, "int32")), "float32")


def partials(value, stats, bins=32, hist_range=None):
    """Device-side partial statistics of `value` (a tensor), each of shape [1, ...].

    Non-finite elements are left out of every partial but `nnan` and `ninf`; see
    the module docstring. Masking them is most of the cost on a CPU (`isfinite`,
    `where` and comparisons are far slower there than plain sums), so a tensor
    whose sum is finite, which means every element is (a non-finite element, or
    an overflow, makes the sum inf or NaN), gets unmasked partials, the same
    values; an `ops.cond` runs the masked ones only for the other tensors.
    """
    if _TORCH:
        return _torch_partials(value, stats, bins, hist_range)
    value = ops.stop_gradient(value)  # statistics never need gradients
    if _JAX and str(value.dtype) in _OWN_PRECISION:
        # XLA computes a bfloat16 (or float16) value in float32 and, allowed
        # excess precision (its default), drops the f32 -> bf16 -> f32 round
        # trip of the layer's cast and this one's: the statistics would be of
        # values the layer never returned. A reduce_precision to the value's
        # own precision changes nothing, and XLA keeps it until it is done
        # simplifying conversions (`jax.checkpoint` relies on the same).
        import jax

        value = jax.lax.reduce_precision(value, *_OWN_PRECISION[str(value.dtype)])
    elif _TF and value.dtype.name in _OWN_PRECISION and _keras_compat.in_tf_xla_context():
        # TF's XLA (jit_compile) drops the round trip too: the values are read
        # from their bits (`_from_bits`). Only there: without XLA the value is
        # the layer's, stored rounded, and reading float16 bits cost 6 ms a
        # step more for 8 points of 256 x 512.
        import tensorflow as tf

        value = _from_bits(value, lambda t, dtype: tf.bitcast(t, tf.as_dtype(dtype)))

    def flat():
        return ops.reshape(ops.cast(value, "float32"), (-1,))

    x = flat()
    needed = needs(stats)
    if x.shape[0] == 0:  # known to be empty (JAX's min and max reject it unmasked)
        out = _masked_partials(x, needed, bins, hist_range)
    else:
        # Given the flat `x`, a `cond` branch made XLA on a CPU compute the
        # layer's output twice (see `_centred_partials`), so each branch
        # flattens the tensor itself.
        if "sd" in needed:
            def centred():
                return _centred_partials(flat(), flat, needed, bins, hist_range)

            out = _one_pass_partials(x, needed, bins, hist_range, centred)
        else:
            out = _centred_partials(x, flat, needed, bins, hist_range)
    # In one order whatever the path: a `cond` gives its dict back with sorted
    # keys, and under tf.distribute every replica's step must pack the same
    # layout (a replica with no rows takes the empty path).
    return {k: ops.expand_dims(out[k], 0) for k in sorted(out)}


def _one_pass_partials(x, needed, bins, hist_range, otherwise):
    """`partials` of a flat float32 tensor with M2 from one pass, the sum of
    squares less total * mean, where every element is finite (the sum of squares
    is), that cancels at most half of it (the variance is at least the mean
    squared), and M2 is at least size * 2**-96 (a CPU flushes squares under
    2**-126 to 0: what is lost is then a part in 2**30 of M2 at most): a part in
    2**23 of M2, about float32's rounding of a sum. Elsewhere `otherwise()`, the
    corrected two-pass sums about the mean, scaled (`_centred_partials`).
    Against those, statistics in a compiled fit went from 1.10 to 1.04 times plain
    fit on JAX (`bench/capture.py`, figure 4, 31 pairs); on TF the kernels took
    half the time (see `_sum_of_squares`), which its fit's noise hides. torch
    does the same (`_torch_finite_partials`)."""
    total, squares = ops.sum(x), _sum_of_squares(x)
    size = ops.cast(ops.shape(x)[0], "float32")
    mean = total / ops.maximum(size, 1.0)
    m2 = squares - total * mean
    sd = ops.sqrt(ops.maximum(m2, 0.0) / ops.maximum(size, 1.0))
    # (|mean| <= sd here: its float32 rounding is a part in 2**24 of sd, no dmean.)
    finite = _finite_partials(x, {"total": total}, needed, bins, hist_range,
                              moments=(mean, ops.zeros((), "float32"), sd))
    return _picked({"squares": squares}, finite, otherwise,
                   also=(2.0 * m2 >= squares, m2 >= size * 2.0**-96))


def _sum_of_squares(x):
    """The sum of the squares of a flat float32 tensor, in one pass where the
    backend has one: on XLA's CPU a dot product is a vectorised library call
    where its reductions are not (8 points of 256 x 512: 0.33 against 0.56 ms
    for `mean`, `std` and `frac_zero`); TF's `l2_loss` is one fused kernel where
    a square and a sum are two ops and two passes over the tensor (0.72 against
    1.38 ms). Both are as exact as a sum (5e-8 against float64 here). TF's own
    dot product is not: it sums in one float32 accumulator (2e-5)."""
    if _JAX:
        return ops.dot(x, x)
    if _TF:
        import tensorflow as tf

        return 2.0 * tf.nn.l2_loss(x)
    return ops.sum(ops.square(x))


def _centred_partials(x, flat, needed, bins, hist_range):
    """`partials` of a flat float32 tensor `x` (`flat()` makes it again) with M2
    summed about the mean (`_centred`), where the sums decide; the rest go to `_scaled_partials`."""
    # The unmasked partials are computed outside the `cond`, which only picks
    # them: there XLA fuses them with the ops around them, and a compiled
    # train step ran about 2% faster (`bench/capture.py`). Where the sum is
    # not finite they are computed for nothing. The masked branch flattens
    # the tensor itself: given the flat `x`, XLA on a CPU computed the
    # layer's output twice, once in its own shape and once flat for the
    # `cond` (one more pass and one more buffer per point, 5-10% of a step).
    # A sum that decides: of the values, or of their squares where `qm` needs
    # those and no mean does; both where both are needed. The squares are
    # summed as they are, beside `absmax`'s largest |value|, not over it:
    # dividing by the largest needs it first, so that took a second pass and
    # a division (XLA fuses the two independent reductions into one loop). A
    # gradient and output capture of 16 tensors in TF's fit ran about 4%
    # faster (`bench/capture.py`, figure 5). That is exact to float32's
    # rounding while the squares neither overflow (their sum is finite) nor
    # lose anything to underflow: a CPU flushes squares below 2**-126 to 0,
    # which are at most size * 2**-126 of a sum of at least largest**2, so
    # `fits` asks largest**2 >= size * 2**-96 (a part in 2**30 at most). Any
    # other tensor (vanishing or huge values, or one with a non-finite
    # element, which makes a sum inf or NaN) goes to `_scaled_partials`.
    sums, fits = {}, ()
    if "qm" in needed:
        largest = ops.max(ops.abs(x))
        # (JAX fuses this sum with the largest |value| above: no dot product.)
        sums["squares"] = _sum_of_squares(x) if _TF else ops.sum(ops.square(x))
        size = ops.cast(ops.shape(x)[0], "float32")
        fits = (ops.square(largest) >= size * 2.0**-96,)
    if "mean" in needed or not sums:
        sums["total"] = ops.sum(x)
    finite = _finite_partials(x, sums, needed, bins, hist_range)
    return _picked(sums, finite, lambda: _scaled_partials(flat(), needed, bins, hist_range),
                   also=fits)


def _picked(sums, finite, otherwise, also=()):
    """`finite` (partials) where every sum is finite and every condition in `also`
    holds, else `otherwise()`: picked on the device by an `ops.cond` where the
    step is traced (compiled, or TF's graph), in Python where JAX runs op by op."""
    decides = [ops.isfinite(v) for v in sums.values()] + list(also)
    fits = functools.reduce(ops.logical_and, decides)
    if _JAX and not _backend.is_tracing([fits]):
        # Run op by op (a direct call, `run_eagerly`), the decision is a value:
        # Python picks the branch. JAX's `cond` outside a trace compiles both
        # branches at every call (new closures each time): a direct call of an
        # 8 x Dense(64) model under `reduce=("mean", "std")` took 4 s.
        return dict(finite) if bool(fits) else otherwise()
    return ops.cond(fits, lambda: dict(finite), otherwise)


def _scaled_partials(x, needed, bins, hist_range):
    """`partials` of a flat float32 tensor that the one-pass sums did not decide:
    where `qm` is needed and the values are finite, the squares are of the values
    over their largest |value| (each at most 1: they never overflow, and do not
    underflow either); elsewhere, or with a non-finite element (the sums are
    then inf or NaN), `_masked_partials`."""
    if "qm" not in needed:
        return _masked_partials(x, needed, bins, hist_range)
    scale = _scale(ops.max(ops.abs(x)))
    sums = {"squares": ops.sum(ops.square(x / scale))}
    if "mean" in needed:
        sums["total"] = ops.sum(x)
    finite = _finite_partials(x, sums, needed, bins, hist_range, scale)
    return _picked(sums, finite, lambda: _masked_partials(x, needed, bins, hist_range))


def _masked_partials(x, needed, bins, hist_range):
    """`partials` of a flat float32 tensor with non-finite values masked out."""
    out = {}
    if set(needed).intersection(_FINITE_ONLY):
        finite = ops.isfinite(x)
        xf = ops.where(finite, x, 0.0)  # finite values, 0 elsewhere
    if "n" in needed:  # _NEEDS lists n with every mean
        n = _count(finite)
        out["n"] = n
    if "mean" in needed or "sd" in needed:
        # 0 when n == 0, so that an empty partial never carries a NaN mean.
        mean = ops.sum(xf) / ops.maximum(n, 1.0)
        if "sd" in needed:
            out["dmean"], out["sd"] = _centred(ops.where(finite, xf - mean, 0.0), n, finite)
        out["mean"] = mean
    if "qm" in needed:
        # Scaled by the largest |value|, so that squares past float32's range
        # (|x| > 1.8e19, also where the sum of squares overflowed) still give it.
        scale = _scale(ops.max(ops.abs(xf), initial=0.0))
        out["qm"] = scale * ops.sqrt(ops.sum(ops.square(xf / scale)) / ops.maximum(n, 1.0))
    inf = float("inf")
    if "min" in needed:
        out["min"] = ops.min(ops.where(finite, x, inf), initial=inf)
    if "max" in needed:
        out["max"] = ops.max(ops.where(finite, x, -inf), initial=-inf)
    if "absmax" in needed:
        out["absmax"] = ops.max(ops.where(finite, ops.abs(x), -inf), initial=-inf)
    if "nzero" in needed:
        out["nzero"] = _count(ops.equal(x, 0.0))  # NaN and inf are never 0
    if "nnan" in needed:
        out["nnan"] = _count(ops.isnan(x))
    if "ninf" in needed:
        out["ninf"] = _count(ops.isinf(x))
    if "hist" in needed:
        # Finite values outside the range count in the edge bins, so counts sum to n.
        out["hist"] = _bin_counts(xf, bins, hist_range, finite)
    return out


def _centred(deviations, n, finite=None):
    """The mean's correction (`dmean`) and the standard deviation, from the
    deviations about a first mean (`finite`: where they count, if not all).

    That mean is a float32 sum over n, off by its rounding: by more than the
    spread where the values lie within a few float32 steps of each other (0.1
    give or take one step: 13 steps off, over 1024 values summed by XLA's CPU).
    Where the deviations' mean (their drift) exceeds their range, it moves the
    mean (clipped to the range), and M2 is summed about the moved mean,
    corrected by the residuals' own sum (corrected two-pass: a constant tensor
    has sd 0 and its exact value as mean). Summed about the first mean, the
    correction cancelled most of Σd²: the std of those 0.1s was 5e-5 off.
    Elsewhere the mean stays, and the sums are those of a plain corrected
    two-pass. The correction is a partial of its own, added to the mean on the
    host in float64: added here, the mean was one float32, rounded (see the
    module docstring). The residuals are squared over the deviations' largest
    |value| (`_scale`; a residual is at most twice that), so that the squares of
    tiny ones do not flush to 0 (std read 0 for values under 1e-19) and those of
    huge ones do not overflow."""
    n = ops.maximum(n, 1.0)
    inf = float("inf")
    low = ops.min(deviations if finite is None else ops.where(finite, deviations, inf),
                  initial=inf)
    high = ops.max(deviations if finite is None else ops.where(finite, deviations, -inf),
                   initial=-inf)
    largest = ops.maximum(ops.maximum(high, -low), 0.0)
    # The mean moves only where it is off by more than the deviations' range (a
    # constant's, or values a few float32 steps apart): elsewhere residuals off
    # its float32 grid would round (a std 1e-8 off read 9e-7), and M2 about the
    # first mean loses no more than (drift / std)**2 float32 roundings. Moved,
    # it stays within the range, as it is but for rounding (TF divides by
    # multiplying by 1/n): a constant's residuals are 0, and its std too. A
    # drift that is not finite is left out: a mean whose sum overflowed is inf,
    # and its deviations -inf (corrected, it read NaN).
    drift = ops.sum(deviations) / n
    moves = ops.logical_and(ops.isfinite(low + high), ops.abs(drift) > high - low)
    drift = ops.where(moves, ops.clip(drift, low, high), 0.0)
    residuals = deviations - drift
    if finite is not None:
        residuals = ops.where(finite, residuals, 0.0)
    scale = _scale(largest)
    rest = ops.sum(residuals)
    m2 = ops.sum(ops.square(residuals / scale)) - ops.square(rest / scale) / n
    shift = ops.nan_to_num(drift + rest / n, nan=0.0, posinf=0.0, neginf=0.0)
    return shift, scale * ops.sqrt(ops.maximum(m2, 0.0) / n)


def _from_bits(value, bitcast):
    """The float32 values of a bfloat16 or float16 tensor `value`, worked out from
    its bits with integer ops (`bitcast(tensor, dtype_name)` reinterprets them).

    A compiler that computes a half-precision value in float32 drops the round
    trip of the layer's cast to it and the statistics' cast back (torch.compile's
    Inductor fuses the two and keeps the float32 value; XLA, allowed excess
    precision, simplifies the pair away): the statistics would be of values the
    layer never returned (a mean off by 1e-4 of the spread, a min no bfloat16
    holds). Reading the bits needs the value in its own dtype, rounded as the
    layer's output is stored (torch's and XLA's own conversion: ties to even,
    NaN, inf and overflow included), and no compiler folds the integer ops that
    follow; a plain cast back, or a bitcast there and back (its views cancel),
    does not survive. Exact for all 2**16 bit patterns of either dtype
    (`tests/test_half_stats.py`)."""
    bits = ops.cast(bitcast(value, "int16"), "int32")  # sign-extended
    if keras.backend.standardize_dtype(value.dtype) == "bfloat16":
        return bitcast(bits * 65536, "float32")  # float32's upper half (in int32's range)
    magnitude = ops.bitwise_and(bits, 0x7FFF)  # exponent and mantissa
    # Normal values: the exponent rebiased (15 to 127) and the mantissa widened;
    # inf and NaN (exponent 31) to float32's 255, their mantissa kept.
    wide = magnitude * 8192 + (112 << 23)
    wide = bitcast(ops.where(magnitude >= 0x7C00, wide + (112 << 23), wide), "float32")
    # Zero and subnormal values: the mantissa times 2**-24, exactly.
    small = ops.cast(magnitude, "float32") * 2.0**-24
    magnitude = ops.where(magnitude < 0x400, small, wide)
    return ops.where(bits < 0, -magnitude, magnitude)


def _scale(largest):
    """What to divide values by before squaring them: their largest |value|,
    kept within 2**-100..2**100. XLA may divide by multiplying by the reciprocal
    (JAX run op by op does, and TF's XLA folds `x * r * r` into one), and the
    reciprocal of a number over 8.5e37 is subnormal, which a CPU flushes to 0.
    Within those bounds it is a normal number; values over 2**100 then square to
    at most 2**56, those under 2**-100 to at least 2**-52 (float32's smallest
    normal value over 2**-100): no square overflows, none flushes."""
    return ops.clip(largest, 2.0**-100, 2.0**100)


def _finite_partials(x, sums, needed, bins, hist_range, scale=None, moments=None):
    """`_masked_partials` of a tensor whose elements are all finite: the same
    values (the masks there select everything), without the masks. `sums` holds
    the sums that decided: of the values (`total`), and of their squares
    (`squares`, where `qm` is needed), over `scale`**2 where one is given. A TF
    tensor whose length is unknown when traced may be empty here: its sum is 0,
    and TF's min and max of nothing are the identities that `_masked_partials`
    gives."""
    size = ops.cast(ops.shape(x)[0], "float32")
    out = {}
    if "n" in needed:
        out["n"] = size
    if "qm" in needed:
        rms = ops.sqrt(sums["squares"] / ops.maximum(size, 1.0))
        out["qm"] = rms if scale is None else scale * rms
    if moments is not None:  # (mean, dmean, sd), found by the caller
        out["mean"], out["dmean"], out["sd"] = moments
    elif "mean" in needed or "sd" in needed:
        mean = sums["total"] / ops.maximum(size, 1.0)
        if "sd" in needed:
            out["dmean"], out["sd"] = _centred(x - mean, size)
        out["mean"] = mean
    if "min" in needed:
        out["min"] = ops.min(x)
    if "max" in needed:
        out["max"] = ops.max(x)
    if "absmax" in needed:
        out["absmax"] = ops.max(ops.abs(x))
    if "nzero" in needed and _counts_in_float32(x.shape[0]):
        # sign(x)**2 is 1 for a non-zero x, 0 for zero: a count without a compare.
        out["nzero"] = size - _sum_of_squares(ops.sign(x))
    elif "nzero" in needed:
        out["nzero"] = _count(ops.equal(x, 0.0))
    for name in ("nnan", "ninf"):
        if name in needed:
            out[name] = ops.zeros((), "float32")
    if "hist" in needed:
        out["hist"] = _bin_counts(x, bins, hist_range)
    return out


def _bin_counts(x, bins, hist_range, finite=None):
    """The histogram of flat `x` (of its `finite` elements, where given), as
    float32 counts, summed as `_count` sums."""
    dtype = "float32" if _counts_in_float32(x.shape[0]) else "int32"
    lo, width = _lo_width(hist_range, bins)
    index = ops.clip(ops.floor((x - lo) / width), 0, bins - 1)
    hot = ops.one_hot(ops.cast(index, "int32"), bins, dtype=dtype)
    if finite is not None:
        hot = hot * ops.expand_dims(ops.cast(finite, dtype), 1)
    return ops.cast(ops.sum(hot, axis=0), "float32")


# --------------------------------------------------------------------------
# One transfer per step: every point's partials packed into one array
# --------------------------------------------------------------------------
PACKED = "__callscope_partials__|"  # the packed entry's name, then its layout's number
_layouts: dict[tuple, int] = {}  # layout -> number (`pack` writes, `unpack` reads)
_by_number: list[tuple] = []  # number -> ((key, partial, shape, start, stop), ...)
_layouts_lock = threading.Lock()


def pack(sown: dict) -> dict:
    """A step's statistics partials (`"index|key"` -> {partial: [R, ...]}) as one
    float32 array `[R, total]` on the device: one output of the compiled step and
    one transfer to the host, not one per partial of every point. The layout
    (names and shapes, fixed when the step is traced) is kept by number, and the
    number goes in the entry's name; full tensors are left as they are.

    >>> step = {"0|a": partials(keras.ops.ones((2, 3)), ("mean", "hist"), 4, (0.0, 1.0))}
    >>> packed = pack(step)
    >>> [(name.startswith(PACKED), tuple(v.shape)) for name, v in packed.items()]
    [(True, (1, 6))]
    >>> host = unpack({k: keras.ops.convert_to_numpy(v) for k, v in packed.items()})
    >>> {k: v.tolist() for k, v in sorted(host["0|a"].items())}
    {'hist': [[0.0, 0.0, 0.0, 6.0]], 'mean': [1.0], 'n': [6.0]}
    """
    stats = [(name, value) for name, value in sown.items() if isinstance(value, dict)]
    if not stats:
        return sown
    # This runs every step on torch (eager): plain Python, and as few torch ops as
    # can be (a reshape each costs microseconds there).
    layout, parts = [], []
    for name, value in stats:
        for partial, part in value.items():
            # ints (traced dimensions: symbolic under torch.compile, where a
            # layout of them would be a guard on each step)
            layout.append((name, partial, tuple(int(d) for d in part.shape[1:])))
            parts.append(part)
    layout = tuple(layout)
    number = _layouts.get(layout)  # a known layout (every step after the first)
    if number is None:  # new: numbered once, under the lock
        with _layouts_lock:
            number = _layouts.get(layout)
            if number is None:
                entries, stop = [], 0
                for entry in layout:
                    start, stop = stop, stop + math.prod(entry[2])
                    entries.append((*entry, start, stop))
                _by_number.append(tuple(entries))
                number = _layouts[layout] = len(_by_number) - 1
    if _TORCH:  # inline, not a helper: each function a compiled step calls is a dynamo frame
        import torch

        if all(p.shape[0] == 1 for p in parts):  # one row (always, eagerly): flat
            rows = [p if p.ndim == 1 else p.reshape(-1) for p in parts]
        else:
            rows = [p.reshape(-1, math.prod(entry[2])) for p, entry in zip(parts, layout)]
        # Host arrays are a finite CPU tensor's scalar partials
        # (`_torch_finite_partials`): where all are, one host concatenation.
        tensors = [p for p in rows if not isinstance(p, np.ndarray)]
        if torch.compiler.is_compiling():  # tensors only (no finite path there)
            packed = torch.cat(rows, -1)
        elif not tensors:
            packed = torch.from_numpy(np.concatenate(rows, axis=-1))
        else:
            packed = torch.cat([torch.from_numpy(p).to(tensors[0].device)
                                if isinstance(p, np.ndarray) else p for p in rows], -1)
        if packed.ndim == 1:
            packed = packed[None]
    else:
        packed = ops.concatenate([ops.cast(ops.reshape(p, (-1, math.prod(entry[2]))), "float32")
                                  for p, entry in zip(parts, layout)], axis=1)
    rest = {name: value for name, value in sown.items() if not isinstance(value, dict)}
    return {**rest, f"{PACKED}{number}": packed}


def layout(number: int) -> tuple:
    """A packed layout by number: `(key, partial, shape, start, stop)` per column run."""
    return _by_number[number]


def unpack(values: Mapping, whole=np.asarray) -> dict:
    """`pack`'s entries back into `"index|key"` -> {partial: [R, ...]} (host
    arrays: views of the one transferred array). `whole` makes a packed entry one
    host array (several JAX processes: a gather)."""
    out = {}
    for name, value in values.items():
        if not name.startswith(PACKED):
            out[name] = value
            continue
        value = np.asarray(whole(value))
        for key, partial, shape, start, stop in _by_number[int(name[len(PACKED):])]:
            (out.get(key) or out.setdefault(key, {}))[partial] = columns(value, start, stop, shape)
    return out


def columns(packed: np.ndarray, start: int, stop: int, shape: tuple) -> np.ndarray:
    """One partial's `[R, *shape]` values: a view of packed rows' columns
    `start:stop` (one column where `shape` is `()`).

    >>> columns(np.arange(8.0).reshape(2, 4), 1, 3, (2,)).tolist()
    [[1.0, 2.0], [5.0, 6.0]]
    """
    return packed[:, start:stop].reshape(-1, *shape) if shape else packed[:, start]


def _lo_width(hist_range, bins):
    """`(lo, hi)` given as numbers, or a compiled step's input `[lo, bin width]`
    (`_inputs.py`; the width computed on the host as it is here)."""
    if isinstance(hist_range, tuple):
        lo, hi = hist_range
        return lo, (hi - lo) / bins
    return hist_range[0], hist_range[1]


def merge(rows: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Merges partials with a leading step axis into one set (float64).

    Rows with n == 0 hold no data: their mean and sd are left out, whatever they
    are. If no row has data, the merged mean is NaN. Each row's M2 is n * sd**2,
    in float64 (where float32 could not hold it).
    """
    merged = {}
    if "n" in rows:
        n = rows["n"].astype(np.float64)
        has = n > 0
        total = n.sum()
        merged["n"] = total
        if "mean" in rows:
            means = np.where(has, _mean(rows), 0.0)
            mean = (n * means).sum() / total if total > 0 else np.float64(np.nan)
            merged["mean"] = mean
            if "dmean" in rows:  # in `mean` now (float64)
                merged["dmean"] = np.float64(0.0)
            if "sd" in rows:
                sd = np.where(has, rows["sd"].astype(np.float64), 0.0)
                m2 = (n * sd ** 2).sum()
                if total > 0:
                    with np.errstate(invalid="ignore"):  # an overflowed mean: inf - inf
                        m2 += np.where(has, n * (means - mean) ** 2, 0.0).sum()
                merged["sd"] = np.sqrt(m2 / total) if total > 0 else np.float64(0.0)
        if "qm" in rows:  # the mean of squares, weighted by n; its root
            qm = np.where(has, rows["qm"].astype(np.float64), 0.0)
            merged["qm"] = np.sqrt((n * qm ** 2).sum() / total) if total > 0 else np.float64(0.0)
    for name in ("nzero", "nnan", "ninf"):
        if name in rows:
            merged[name] = rows[name].astype(np.float64).sum()
    # Empty partials hold the identities (+inf for min, -inf for max and absmax).
    for name, fn in (("min", np.min), ("max", np.max), ("absmax", np.max)):
        if name in rows:
            merged[name] = fn(rows[name].astype(np.float64))
    if "hist" in rows:
        merged["hist"] = rows["hist"].astype(np.float64).sum(axis=0)
    return merged


def _mean(part: Mapping[str, np.ndarray]) -> np.ndarray:
    """The mean of partials, in float64: `mean` plus its correction `dmean`
    where there is one."""
    mean = np.asarray(part["mean"], np.float64)
    return mean + np.asarray(part["dmean"], np.float64) if "dmean" in part else mean


def merge_each(steps: list[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One row per step: each step's partials (one row, or one per replica under
    `tf.distribute`) merged exactly, stacked along a new step axis."""
    if all(len(next(iter(step.values()))) == 1 for step in steps):
        return {k: np.concatenate([step[k] for step in steps]) for k in steps[0]}
    merged = [merge(step) for step in steps]
    return {k: np.stack([m[k] for m in merged]) for k in merged[0]}


def finalize(part: Mapping[str, np.ndarray], stat: str) -> np.ndarray:
    """The statistic `stat` from (merged or per-step) partials.

    NaN where n == 0 (no finite elements), for every statistic but the counts
    (`hist`, `nan_count`, `inf_count`).
    """
    if stat == "hist":
        return np.asarray(part["hist"])
    if stat == "nan_count":
        return np.asarray(part["nnan"])
    if stat == "inf_count":
        return np.asarray(part["ninf"])
    n = np.asarray(part["n"], np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if stat == "mean":
            value = _mean(part)
        elif stat == "std":
            value = np.asarray(part["sd"], np.float64)
        elif stat == "rms" and "qm" in part:
            value = np.asarray(part["qm"], np.float64)
        elif stat == "rms":  # with `std` (see `needs`)
            value = np.sqrt(np.asarray(part["sd"], np.float64) ** 2 + _mean(part) ** 2)
        elif stat == "frac_zero":
            value = np.asarray(part["nzero"], np.float64) / n
        else:
            value = np.asarray(part[stat], np.float64)
    return np.where(n > 0, value, np.nan)


def per_step(rows: Mapping[str, np.ndarray], stat: str) -> np.ndarray:
    """One value (or histogram row) per step, from partials with a step axis."""
    return finalize({k: np.asarray(v, np.float64) for k, v in rows.items()}, stat)


def hist_edges(bins: int, hist_range) -> np.ndarray:
    lo, hi = hist_range
    return np.linspace(lo, hi, bins + 1)


def to_numpy(x):
    """A host array of `x`, without a copy where the backend allows (JAX on CPU)."""
    if isinstance(x, np.ndarray):
        return x
    try:
        return np.asarray(x)
    except (TypeError, RuntimeError, ValueError):  # e.g. a torch tensor that needs grad
        return np.asarray(keras.ops.convert_to_numpy(x))


def _torch_partials(value, stats, bins, hist_range):
    """The same partials in plain torch: torch runs eagerly, where each op costs
    microseconds of dispatch; this is the one hot path where that shows
    (statistics of every selected layer, every step). So it runs as few ops as it
    can: the non-finite mask from `x - x` (NaN exactly where x is NaN or inf;
    `isfinite` is four ops), masked fills instead of `where` with a scalar,
    counts summed straight to float32, `ninf` as non-finite minus NaN, sums of
    squares in one place (`_torch_squares`), and the scalar partials
    stacked into one tensor split into [1]-shaped views. A finite CPU tensor's
    scalar partials are host arrays instead (`_torch_finite_partials`). Keep in
    step with `partials`."""
    import torch

    x = None
    if not torch.compiler.is_compiling() and value.is_cpu and value.numel():
        # A finite sum means every element is finite (a non-finite one, or an
        # overflow, makes it inf or NaN): of the values, or of their squares
        # where only `qm` needs a sum. Asking costs nothing on the CPU (on a
        # GPU it would wait for the device, and under torch.compile it would
        # break the graph: the masked path runs there, as it was before this
        # path, frame for frame: `tests/test_torch_compile.py` counts them).
        needed = _cached_needs(stats)
        x = value.reshape(-1)
        if x.requires_grad:  # no graph: the partials are never differentiated
            x = x.detach()
        if x.dtype != torch.float32:
            x = x.float()
        if "qm" in needed and "mean" not in needed:
            squares = _torch_squares(x).item()
            if math.isfinite(squares):
                return _torch_finite_partials(x, None, squares, needed, bins, hist_range)
        else:
            total = x.sum().item()
            if math.isfinite(total):
                return _torch_finite_partials(x, total, None, needed, bins, hist_range)
    needed = set(needs(stats))
    inf = float("inf")
    f32 = torch.float32
    with torch.no_grad():  # no graph: the partials are never differentiated
        if x is None:
            x = value.reshape(-1)
            if x.dtype != f32:
                if x.dtype in (torch.bfloat16, torch.float16) and torch.compiler.is_compiling():
                    # Inductor computes the value in float32 and, fused with this
                    # cast, keeps it unrounded: read from its bits (`_from_bits`).
                    # Eagerly the value is the layer's, stored in its own dtype.
                    x = _from_bits(x, lambda t, dtype: t.view(getattr(torch, dtype)))
                else:
                    x = x.float()
        size = x.numel()
        names, scalars, out = [], [], {}
        bad = (x - x) != 0  # NaN - NaN and inf - inf are NaN; NaN != 0

        def count(mask):  # as `_count`: float32 sums where they are exact
            return mask.sum(dtype=f32) if _counts_in_float32(size) else mask.sum()

        if needed.intersection(_FINITE_ONLY + ("ninf",)):
            nbad = count(bad)
        if needed.intersection(_FINITE_ONLY):
            xf = x.masked_fill(bad, 0.0)  # finite values, 0 elsewhere
        if "n" in needed:  # _NEEDS lists n with every mean
            n = (size - nbad).to(f32)
            names.append("n"), scalars.append(n)
        if "mean" in needed or "sd" in needed:
            at_least_1 = n.clamp(min=1.0)
            mean = xf.sum() / at_least_1
            names.append("mean"), scalars.append(mean)
            if "sd" in needed:  # corrected two-pass, scaled, as `_centred`
                centred = (xf - mean).masked_fill_(bad, 0.0)
                drift = centred.sum()
                shift = drift / at_least_1
                # (One op, not isfinite's four and a where: `_centred`.)
                names.append("dmean")
                scalars.append(shift.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0))
                # Scaled by the largest deviation (`_scale`): the variance is
                # Σ(d/scale)²/n less (shift/scale)², over scale². In as few
                # ops as that takes (10, against 4 unscaled: a GPU launches each).
                largest = (torch.linalg.vector_norm(centred, float("inf")) if size
                           else x.new_tensor(0.0))
                scale = largest.clamp_(2.0**-100, 2.0**100)
                mean_square = _torch_squares(centred / scale) / at_least_1
                ratio = shift / scale
                variance = torch.addcmul(mean_square, ratio, ratio, value=-1.0)
                names.append("sd"), scalars.append(variance.clamp_(min=0.0).sqrt_().mul_(scale))
        if "qm" in needed:  # scaled, as in `_masked_partials`
            largest = xf.abs().max() if size else x.new_tensor(0.0)
            scaled = xf / torch.where(largest > 0, largest, 1.0)
            qm = torch.where(largest > 0, largest, 1.0) * (
                _torch_squares(scaled) / n.clamp(min=1.0)).sqrt()
            names.append("qm"), scalars.append(qm)
        # The identities (+inf for min, -inf for max and absmax) where nothing is
        # finite, empty tensors included (torch's min and max reject those).
        for name, fill in (("min", inf), ("max", -inf), ("absmax", -inf)):
            if name in needed:
                if size == 0:
                    found = x.new_tensor(fill)
                else:
                    masked = (x.abs() if name == "absmax" else x).masked_fill(bad, fill)
                    found = masked.min() if name == "min" else masked.max()
                names.append(name), scalars.append(found)
        if "nzero" in needed:  # the finite zeros: n less xf's non-zeros
            zeros = (n - _torch_nonzero(xf) if _counts_in_float32(size)
                     else (x == 0).sum().to(f32))  # (NaN and inf are never 0)
            names.append("nzero"), scalars.append(zeros)
        if "nnan" in needed or "ninf" in needed:
            nnan = count(x != x)
            for name, found in (("nnan", nnan), ("ninf", None)):
                if name in needed:
                    found = nbad - nnan if found is None else found
                    names.append(name), scalars.append(found.to(f32))
        if scalars:
            out = dict(zip(names, torch.stack(scalars).split(1)))
        if "hist" in needed:
            lo, width = _lo_width(hist_range, bins)
            index = ((xf - lo) / width).floor().clamp(0, bins - 1).long()
            # Non-finite values go to an extra bin, dropped (no bincount weights:
            # those are nondeterministic on CUDA).
            index.masked_fill_(bad, bins)
            out["hist"] = torch.bincount(index, minlength=bins + 1)[None, :bins].float()
        return out


def _torch_squares(x):
    """The sum of the squares of a flat float32 torch tensor, as a 0-d tensor. On
    the CPU a square and torch's sum, whose cascade keeps float32's rounding
    whatever the length: its dot product (a BLAS call, twice as fast) sums in
    float32 accumulators whose errors grow with length and, for values alike,
    all lean one way (the rms of 256 x 512 constant values was off by 5e-5, of
    4M normal ones by 2e-6, against 1e-7 for JAX and TF). On a GPU, and under
    torch.compile, the dot product sums in a tree."""
    import torch

    if x.is_cpu and not torch.compiler.is_compiling():
        return x.square().sum()
    return torch.dot(x, x)


def _torch_nonzero(x):
    """How many elements of finite `x` are not zero, as a float32 scalar: sign(x)
    dotted with itself (1 for a non-zero x; exact below 2**24 elements, as the
    other float32 counts). torch's `count_nonzero` and `(x == 0).sum()` took 870
    and 200 µs on a 256 x 512 CPU tensor where |sign(x)| summed took 45 µs; this
    is one op fewer than that."""
    import torch

    signs = x.sign()
    return torch.dot(signs, signs)


# Below this mean square, float32 squares lose bits as subnormals (under 1.2e-38):
# the root mean square is then taken of the values scaled by the largest.
_SMALLEST_MEAN_SQUARE = 1e-30


def _torch_finite_partials(x, total, squares, needed, bins, hist_range):
    """`_torch_partials` of a flat float32 CPU tensor whose elements are all finite
    (the float that said so is given: their sum, `total`, or the sum of their
    squares, `squares`; the other is None): the same values, with no masks. On
    the CPU a scalar reads back for free, so the scalar partials are worked out
    in Python (float64) from a few sums: about half the ops and passes of the
    masked path (0.9 against 1.9 ms a step for 8 points of 256 x 512). They are
    host arrays (one, in [1]-shaped views), which `pack` joins into the step's
    one tensor: a tensor per point, and its split, cost more Python than the
    point's sums did (`bench/capture.py`, statistics in fit). M2 is the sum of
    squares less `total * mean`, one pass with no temporary; where that would
    cancel more than half of the sum of squares (a mean far from 0 against the
    spread), it loses bits, where the sum of squares overflows float32, it is
    lost, and where M2 is under size * 1e-30, squares lost bits as subnormals: M2
    is then summed about the mean, scaled by the largest deviation, as in
    `partials`. Its root, `sd`, is the partial."""
    import torch

    size = x.numel()
    host = {"n": float(size), "nnan": 0.0, "ninf": 0.0}
    if "qm" in needed:
        if squares is None:
            squares = _torch_squares(x).item()
        if math.isfinite(squares) and squares >= size * _SMALLEST_MEAN_SQUARE:
            host["qm"] = math.sqrt(squares / size)
        else:  # squares past float32's range, or near its subnormals: scaled
            largest = x.abs().max().item()
            scaled = x / (largest or 1.0)
            host["qm"] = largest * math.sqrt(_torch_squares(scaled).item() / size)
    if "mean" in needed or "sd" in needed:
        mean = total / size
        if "sd" in needed:
            squares = _torch_squares(x).item()
            m2 = squares - total * mean
            # Cancellation (or rounding below 0), squares past float32's range
            # (|x| > 1.8e19) where the centred values may still be within it, or
            # squares near its subnormals (a vanishing gradient's spread).
            if not (math.isfinite(squares) and 2 * m2 >= squares
                    and m2 >= size * _SMALLEST_MEAN_SQUARE):
                # Corrected two-pass, scaled, as `_centred`: about the float32
                # that the tensor's subtraction takes (the drift corrects it).
                mean = float(np.float32(mean))
                centred = x - mean
                drift = centred.sum().item()
                mean += drift / size
                scale = centred.abs().max().item() or 1.0
                scaled = _torch_squares(centred / scale).item()
                m2 = max(scale * scale * (scaled - (drift / scale) ** 2 / size), 0.0)
            host["sd"] = math.sqrt(m2 / size)
        # In float64 here: float32's mean and what it rounded off (`dmean`).
        host["mean"] = float(np.float32(mean))
        host["dmean"] = mean - host["mean"]
    if "min" in needed or "max" in needed or "absmax" in needed:
        low, high = (v.item() for v in torch.aminmax(x))
        host.update(min=low, max=high, absmax=max(-low, high))
    if "nzero" in needed:
        host["nzero"] = (size - _torch_nonzero(x).item() if _counts_in_float32(size)
                         else (x == 0).sum().item())
    names = _scalar_names(needed)
    out = {}
    if names:
        scalars = np.array([host[name] for name in names], np.float32)
        out = {name: scalars[i:i + 1] for i, name in enumerate(names)}
    if "hist" in needed:
        lo, width = _lo_width(hist_range, bins)
        index = ((x - lo) / width).floor_().clamp_(0, bins - 1).long()
        out["hist"] = torch.bincount(index, minlength=bins)[None, :bins].float()
    return out


@functools.lru_cache(maxsize=256)
def _scalar_names(needed: tuple) -> tuple:
    """The scalar partials of `needs`'s `needed`, in `_SCALARS`' order."""
    return tuple(name for name in _SCALARS if name in needed)


class Running:
    """An exact running merge of per-step partials (Chan's formula, float64).

    Steps' partials wait in a block of at most `block` rows and merge into the
    aggregate when it fills: adding is O(1) amortised, memory does not grow with
    the number of steps, and `result()` costs at most one block's merge.

    >>> running = Running(block=2)
    >>> for chunk in ([1.0, 2.0], [3.0], [4.0, 5.0, 6.0]):
    ...     step = partials(keras.ops.convert_to_tensor(chunk), ("mean", "std"))
    ...     running.add({k: keras.ops.convert_to_numpy(v) for k, v in step.items()})
    >>> merged = running.result()  # (std: 1.7078251..., to float32's rounding)
    >>> float(finalize(merged, "mean")), round(float(finalize(merged, "std")), 6)
    (3.5, 1.707825)
    """

    def __init__(self, block: int = 64):
        self._block_size = block
        self._block: list[dict] = []
        self._total: dict | None = None  # each value with a leading axis of 1

    def add(self, row: Mapping[str, np.ndarray]) -> None:
        self._block.append(row)
        if len(self._block) >= self._block_size:
            self._fold()

    def _fold(self) -> None:
        rows = self._block if self._total is None else [self._total, *self._block]
        stacked = {k: np.concatenate([np.asarray(r[k], np.float64) for r in rows])
                   for k in rows[0]}
        self._total = {k: np.expand_dims(v, 0) for k, v in merge(stacked).items()}
        self._block = []

    def result(self) -> dict[str, np.ndarray]:
        """The merged partials so far (as `merge` gives them)."""
        if self._block:
            self._fold()
        if self._total is None:
            raise ValueError("No partials were added: there is nothing to merge.")
        return {k: v[0] for k, v in self._total.items()}
