"""Tables of statistics: a text table for the terminal, and CSV files."""

from __future__ import annotations

import csv
from collections.abc import Mapping

import numpy as np


def statistics_table(stats: Mapping[str, np.ndarray]) -> str:
    """Formats `{"point:kind/stat": value}` as one row per `point:kind`.

    Example:

    Values show 5 significant digits (a std of 3e-7 is `3e-07`, not 0); the
    CSV (`write_csv`) keeps every digit.

    >>> print(statistics_table({"m/a:output/mean": 1.0, "m/a:output/std": 3e-7}))
    point:kind mean   std
    m/a:output    1 3e-07
    """
    rows: dict[str, dict[str, str]] = {}
    columns: list[str] = []
    for key, value in stats.items():
        base, _, stat = key.rpartition("/")
        if np.ndim(value) > 0:
            continue  # histograms and per-step rows go to plots and CSV
        if stat not in columns:
            columns.append(stat)
        rows.setdefault(base, {})[stat] = f"{float(value):.5g}"
    header = ["point:kind", *columns]
    table = [header] + [[base, *(r.get(c, "") for c in columns)] for base, r in rows.items()]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = []
    for row in table:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append(" ".join(cells))
    return "\n".join(lines)


def write_csv(path, stats: Mapping[str, np.ndarray]) -> None:
    """One row per (key, step): `key, step, value` (histograms: the counts,
    space-separated). Every digit is kept: a value as Python's `repr` writes it
    (it reads back as the same float64), counts as integers.

    >>> import pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "s.csv"
    >>> write_csv(path, {"m/a:output/min": 123456.78, "m/a:output/hist": [1234567.0, 0.0]})
    >>> print(path.read_text().strip())
    key,step,value
    m/a:output/min,0,123456.78
    m/a:output/hist,0,1234567 0
    """
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["key", "step", "value"])
        for key, value in stats.items():
            array = np.asarray(value)
            if key.endswith("/hist"):
                rows = array if array.ndim == 2 else array[None]
                for step, counts in enumerate(rows):
                    writer.writerow([key, step, " ".join(str(int(c)) for c in counts)])
            else:
                for step, v in enumerate(np.atleast_1d(array)):
                    writer.writerow([key, step, repr(float(v))])
