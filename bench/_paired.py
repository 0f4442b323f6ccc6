"""Paired timing for the benchmarks: callscope and its reference, alternating.

A ratio's median over a few pairs moves by several percent from run to run on a
shared machine, so each figure also carries a 95% interval for the median (from
the order statistics of the pairs' ratios: it assumes nothing about their
distribution), and a figure with a target says whether the interval decides it:
`holds` (all of it meets the target), `misses` (none of it does) or `undecided`.
The interval takes the pairs as independent: a machine whose speed drifts
within a run makes it narrower than it should be.

    >>> import _paired
    >>> ratios = [1.0, 1.1, 0.9, 1.2, 1.05, 0.95, 1.0, 1.15, 1.02]
    >>> low, high, coverage = _paired.median_interval(ratios)
    >>> low, high, round(coverage, 3)
    (0.95, 1.15, 0.961)
    >>> [_paired.verdict(i, "target <= 1.10") for i in ((1.02, 1.08), (1.02, 1.12), (1.11, 1.2))]
    ['holds', 'undecided', 'misses']
"""

import argparse
import gc
import math
import os
import re
import statistics
import subprocess
import sys
import time
from typing import NamedTuple

BACKENDS = ("jax", "tensorflow", "torch")


class Figure(NamedTuple):
    best: float  # best ours / best reference: the least disturbed runs
    median: float  # median of the pairs' ratios
    interval: tuple  # (low, high, coverage): a 95% interval for that median
    reference: float  # the best reference time, seconds


def median_interval(ratios, confidence=0.95) -> tuple:
    """`(low, high, coverage)`: the narrowest pair of order statistics
    `(r_k, r_{n-k+1})` that holds the median with at least `confidence` (binomial,
    p = 1/2), and the chance that it does. With fewer than 6 ratios no pair
    reaches 95%: the whole range, with its lower coverage.
    """
    ratios, n = sorted(ratios), len(ratios)
    k, outside = 1, 2 / 2**n  # P(the median falls outside (r_1, r_n))
    while k < n // 2:
        wider = outside + 2 * math.comb(n, k) / 2**n  # the same for (r_{k+1}, r_{n-k})
        if wider > 1 - confidence:
            break
        k, outside = k + 1, wider
    return ratios[k - 1], ratios[n - k], 1 - outside


def verdict(interval: tuple, note: str) -> str:
    """`holds`, `misses` or `undecided` for a note with "target <= 1.10" (or >=) in
    it; '' where it has none."""
    found = re.search(r"target (<=|>=) ([0-9]+(?:\.[0-9]+)?)", note)
    if found is None:
        return ""
    bound = float(found[2])
    low, high = interval[:2]
    meets = (lambda r: r <= bound) if found[1] == "<=" else (lambda r: r >= bound)
    if meets(low) and meets(high):
        return "holds"
    if not meets(low) and not meets(high):
        return "misses"
    return "undecided"


def seconds(fn) -> float:
    """How long one call of `fn` takes, in seconds."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def timed_pairs(ours, reference, repeats: int) -> list:
    """`(ours seconds, reference seconds)` for `repeats` runs of each, alternating
    which goes first, after one warm-up call of each (compiles both).

    Each run starts from a collected heap: otherwise a full collection of the
    heap the backends built (tens of ms) lands in whichever run crosses the
    collector's threshold, a few percent of noise on either side. What a run
    allocates is still collected within it, as for a user."""
    ours(), reference()
    pairs = []
    for i in range(repeats):
        order = (ours, reference) if i % 2 == 0 else (reference, ours)
        times = {}
        for fn in order:
            gc.collect()
            times[fn] = seconds(fn)
        pairs.append((times[ours], times[reference]))
    return pairs


def paired(ours, reference, repeats: int) -> Figure:
    """The `Figure` of `timed_pairs`."""
    pairs = timed_pairs(ours, reference, repeats)
    ratios = [a / b for a, b in pairs]
    best = min(a for a, _ in pairs) / min(b for _, b in pairs)
    return Figure(best, statistics.median(ratios), median_interval(ratios),
                  min(b for _, b in pairs))


def table(title: str, rows, reference_word: str = "reference") -> str:
    """Rows of `(name, Figure, note)` as printed by the benchmarks."""
    lines = [f"\n{title}",
             f"  {'':<46} {'best':>7} {'median':>7}  {'95% interval':<15}"]
    for name, figure, note in rows:
        low, high, coverage = figure.interval
        judged = verdict(figure.interval, note) if coverage >= 0.95 else (
            f"(interval covers {coverage:.0%}: too few repeats to judge)" if "target" in note
            else "")
        lines.append(
            f"  {name:<46} {figure.best:6.3f}x {figure.median:6.3f}x  "
            f"[{low:5.3f}, {high:5.3f}]  ({reference_word} {figure.reference * 1000:7.1f} ms)"
            f"  {note}{'  ' + judged if judged else ''}")
    return "\n".join(lines)


def backend_parser(doc: str, repeats: int) -> argparse.ArgumentParser:
    """A benchmark's command line: `--backend` (one, in this process; without it,
    each in a process of its own) and `--repeats`."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--backend", choices=BACKENDS)
    parser.add_argument("--repeats", type=int, default=repeats)
    return parser


def use_backend(backend: str) -> None:
    """Makes this process's Keras `backend`. Keras reads KERAS_BACKEND when first
    imported (a benchmark's run_backend imports it): without this, `--backend
    torch` would silently time keras.json's backend."""
    os.environ["KERAS_BACKEND"] = backend


def each_backend(script: str, *argv: str) -> None:
    """Runs `script --backend B *argv` for each backend, each in a process of its
    own: Keras fixes its backend at import."""
    for backend in BACKENDS:
        subprocess.run([sys.executable, script, "--backend", backend, *argv],
                       env={**os.environ, "KERAS_BACKEND": backend}, check=True)


def per_backend(script: str, doc: str, run_backend, repeats: int) -> None:
    """The whole `main` of a benchmark whose `run_backend(repeats)` times the
    backend this process runs."""
    args = backend_parser(doc, repeats).parse_args()
    if args.backend:
        use_backend(args.backend)
        run_backend(args.repeats)
    else:
        each_backend(script, "--repeats", str(args.repeats))
