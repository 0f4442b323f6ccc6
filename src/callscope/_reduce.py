"""On-device statistics of captured tensors, and their exact merge on the host.

A compiled step cannot hand back a running aggregate, so each step returns small
*partials* per captured tensor: element count, mean, centred sum of squares (M2),
min, max, absmax, zero count and histogram counts, each with a leading axis of 1
so that Keras can concatenate them across steps. The host merges partials with
Chan's parallel formula in float64, which is exact up to rounding (never an
average of per-batch means). Statistics are computed in float32 whatever the
compute dtype, so mixed precision does not overflow them.
"""

from __future__ import annotations

from collections.abc import Mapping

import keras
import numpy as np
from keras import ops

_TORCH = keras.backend.backend() == "torch"
STATS = ("mean", "std", "min", "max", "absmax", "rms", "frac_zero", "hist")
_NEEDS = {
    "mean": ("n", "mean"),
    "std": ("n", "mean", "m2"),
    "rms": ("n", "mean", "m2"),
    "min": ("min",),
    "max": ("max",),
    "absmax": ("absmax",),
    "frac_zero": ("n", "nzero"),
    "hist": ("hist",),
}


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


def partials(value, stats, bins=32, hist_range=None):
    """Device-side partial statistics of `value` (a tensor), each of shape [1, ...]."""
    if _TORCH:
        return _torch_partials(value, stats, bins, hist_range)
    # Statistics never need gradients: on torch this also keeps them off the tape.
    x = ops.reshape(ops.cast(ops.stop_gradient(value), "float32"), (-1,))
    needed = {p for s in stats for p in _NEEDS[s]}
    n = ops.cast(ops.size(x), "float32")
    out = {}
    if "n" in needed:
        out["n"] = n
    if "mean" in needed or "m2" in needed:
        mean = ops.mean(x)
        out["mean"] = mean
        if "m2" in needed:
            out["m2"] = ops.sum(ops.square(x - mean))
    if "min" in needed:
        out["min"] = ops.min(x)
    if "max" in needed:
        out["max"] = ops.max(x)
    if "absmax" in needed:
        out["absmax"] = ops.max(ops.abs(x))
    if "nzero" in needed:
        out["nzero"] = ops.sum(ops.cast(ops.equal(x, 0.0), "float32"))
    if "hist" in needed:
        lo, hi = hist_range
        width = (hi - lo) / bins
        # Values outside the range count in the edge bins, so counts sum to n.
        index = ops.clip(ops.floor((x - lo) / width), 0, bins - 1)
        out["hist"] = ops.sum(ops.one_hot(ops.cast(index, "int32"), bins), axis=0)
    return {k: ops.expand_dims(v, 0) for k, v in out.items()}


def merge(rows: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Merges partials with a leading step axis into one set (float64)."""
    merged = {}
    if "n" in rows:
        n = rows["n"].astype(np.float64)
        total = n.sum()
        merged["n"] = total
        if "mean" in rows:
            means = rows["mean"].astype(np.float64)
            mean = (n * means).sum() / total
            merged["mean"] = mean
            if "m2" in rows:
                merged["m2"] = rows["m2"].astype(np.float64).sum() + (n * (means - mean) ** 2).sum()
        if "nzero" in rows:
            merged["nzero"] = rows["nzero"].astype(np.float64).sum()
    for name, fn in (("min", np.min), ("max", np.max), ("absmax", np.max)):
        if name in rows:
            merged[name] = fn(rows[name].astype(np.float64))
    if "hist" in rows:
        merged["hist"] = rows["hist"].astype(np.float64).sum(axis=0)
    return merged


def finalize(part: Mapping[str, np.ndarray], stat: str) -> np.ndarray:
    """The statistic `stat` from (merged or per-step) partials."""
    if stat == "mean":
        return np.asarray(part["mean"])
    if stat == "std":
        return np.sqrt(np.asarray(part["m2"]) / part["n"])
    if stat == "rms":
        return np.sqrt(np.asarray(part["m2"]) / part["n"] + np.asarray(part["mean"]) ** 2)
    if stat == "frac_zero":
        return np.asarray(part["nzero"]) / part["n"]
    if stat == "hist":
        return np.asarray(part["hist"])
    return np.asarray(part[stat])


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
    """The same partials in plain torch: torch runs eagerly, where each `keras.ops`
    call costs tens of microseconds of dispatch; this is the one hot path where that
    shows (statistics of every selected layer, every step)."""
    import torch

    needed = {p for s in stats for p in _NEEDS[s]}
    with torch.no_grad():
        x = value.detach().reshape(-1).float()
        n = torch.tensor(float(x.numel()), device=x.device)
        out = {}
        if "n" in needed:
            out["n"] = n
        if "mean" in needed or "m2" in needed:
            mean = x.mean()
            out["mean"] = mean
            if "m2" in needed:
                out["m2"] = ((x - mean) ** 2).sum()
        if "min" in needed:
            out["min"] = x.min()
        if "max" in needed:
            out["max"] = x.max()
        if "absmax" in needed:
            out["absmax"] = x.abs().max()
        if "nzero" in needed:
            out["nzero"] = (x == 0).sum().float()
        if "hist" in needed:
            lo, hi = hist_range
            index = ((x - lo) / ((hi - lo) / bins)).floor().clamp(0, bins - 1).long()
            out["hist"] = torch.bincount(index, minlength=bins).float()
        return {k: v.unsqueeze(0) for k, v in out.items()}
