"""PNG plots of captured statistics: one panel per block, axes labelled."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _grid(n):
    cols = min(4, n)
    return math.ceil(n / cols), cols


def _figure(n, stats, wanted):
    """A grid with one panel per block, and a function that saves and closes it;
    with no block (no key of `stats` is `wanted`), an error that says so."""
    if not n:
        keys = sorted(stats)
        raise ValueError(
            f"Nothing to plot: no key of the statistics given is {wanted}. Capture "
            "those first (e.g. cs.capture(..., reduce=...)). Received: "
            f"keys={keys[:5] + ['...'] if len(keys) > 5 else keys}")
    plt = _pyplot()
    rows, cols = _grid(n)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)

    def finish(title, path):
        for ax in list(axes.flat)[n:]:
            ax.axis("off")
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        return path

    return list(axes.flat)[:n], finish


def _points(stats, suffix):
    return sorted({k[: -len(suffix)] for k in stats if k.endswith(suffix)})


def plot_step_statistics(stats: Mapping[str, np.ndarray], path, stat_names=("mean", "std",
                                                                           "frac_zero"),
                         kind="output", title="Activation statistics per training step"):
    """One panel per point: each statistic against the training step."""
    points = _points(stats, f":{kind}/{stat_names[0]}")
    axes, finish = _figure(len(points), stats, f"`<point>:{kind}/{stat_names[0]}`")
    for ax, point in zip(axes, points):
        for stat in stat_names:
            key = f"{point}:{kind}/{stat}"
            if key in stats:
                values = np.atleast_1d(stats[key])
                ax.plot(np.arange(len(values)), values, label=stat)
        ax.set_title(point, fontsize=9)
        ax.set_xlabel("training step")
        ax.set_ylabel("value")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    return finish(title, path)


def plot_histograms(stats: Mapping[str, np.ndarray], edges: Mapping[str, np.ndarray], path,
                    title="Activation histograms: first and last training step"):
    """One panel per point: the first and last step's histogram, overlaid."""
    keys = sorted(k for k in stats if k.endswith("/hist"))
    axes, finish = _figure(len(keys), stats, "`<point>:<kind>/hist`")
    for ax, key in zip(axes, keys):
        counts = np.asarray(stats[key])
        counts = counts if counts.ndim == 2 else counts[None]
        e = edges[key]
        width = np.diff(e)
        shown = ((counts[0], "first step"), (counts[-1], "last step")) if len(counts) > 1 \
            else ((counts[0], "all data"),)
        for row, label in shown:
            ax.bar(e[:-1], row / max(row.sum(), 1), width=width, align="edge", alpha=0.5,
                   label=label)
        ax.set_title(key.rsplit(":", 1)[0], fontsize=9)
        ax.set_xlabel("activation value")
        ax.set_ylabel("fraction")
        ax.legend(fontsize=7)
    return finish(title, path)


def plot_grad_norms(stats: Mapping[str, np.ndarray], path, stat="rms",
                    title="Gradient of the loss per block (rms) per training step"):
    """One panel per point: d loss / d output, its `stat`, against the step."""
    points = _points(stats, f":grad/{stat}")
    axes, finish = _figure(len(points), stats, f"`<point>:grad/{stat}`")
    for ax, point in zip(axes, points):
        values = np.atleast_1d(stats[f"{point}:grad/{stat}"])
        ax.plot(np.arange(len(values)), values, color="tab:red")
        ax.set_yscale("log")
        ax.set_title(point, fontsize=9)
        ax.set_xlabel("training step")
        ax.set_ylabel(f"grad {stat}")
        ax.grid(alpha=0.3)
    return finish(title, path)
