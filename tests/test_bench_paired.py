"""The benchmarks' paired statistics (`bench/_paired.py`): the interval for the
median covers what it says, and the verdict reads a target the way it is printed."""

import importlib.util
import math
import os

import numpy as np
import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench", "_paired.py")
_spec = importlib.util.spec_from_file_location("_paired", _PATH)
paired = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(paired)


def _binomial_below(n, k):
    """P(Binomial(n, 1/2) <= k)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


@pytest.mark.parametrize("n", [7, 9, 15, 21])
def test_the_interval_is_the_narrowest_order_statistics_that_cover_95_percent(n):
    low, high, coverage = paired.median_interval(list(range(n)))
    k = low + 1  # ranks of the order statistics taken: k and n - k + 1
    assert high == n - k
    assert coverage == pytest.approx(1 - 2 * _binomial_below(n, k - 1))
    assert coverage >= 0.95
    assert 1 - 2 * _binomial_below(n, k) < 0.95  # one rank narrower would not cover


def test_the_interval_holds_the_true_median_as_often_as_it_says():
    # Ratios drawn from a skewed distribution whose median is known exactly.
    rng = np.random.default_rng(0)
    median = math.exp(0.0)
    trials, held = 4000, 0
    for _ in range(trials):
        low, high, coverage = paired.median_interval(np.exp(rng.normal(0, 0.1, 9)))
        held += low <= median <= high
    assert coverage == pytest.approx(0.9609375)
    assert abs(held / trials - coverage) < 0.015


def test_the_verdict_reads_targets_in_both_directions():
    assert paired.verdict((1.02, 1.08, 0.96), "target <= 1.10") == "holds"
    assert paired.verdict((1.02, 1.12, 0.96), "target <= 1.10") == "undecided"
    assert paired.verdict((1.11, 1.20, 0.96), "target <= 1.10") == "misses"
    assert paired.verdict((1.6, 1.9, 0.96), "calls: 0  target >= 1.5") == "holds"
    assert paired.verdict((1.2, 1.4, 0.96), "target >= 1.5") == "misses"
    assert paired.verdict((1.2, 1.4, 0.96), "diagnostic") == ""
    assert paired.verdict((1.02, 1.08, 0.96), "target <= 1.10.") == "holds"


def test_a_table_says_when_there_are_too_few_repeats_to_judge():
    few = paired.Figure(1.0, 1.0, paired.median_interval([0.9, 1.0, 1.3]), 0.1)
    enough = paired.Figure(1.0, 1.0, paired.median_interval([1.0] * 9), 0.1)
    text = paired.table("t", [("few", few, "target <= 1.05"),
                              ("enough", enough, "target <= 1.05")])
    assert "interval covers 75%: too few repeats to judge" in text
    assert text.splitlines()[-1].endswith("target <= 1.05  holds")
