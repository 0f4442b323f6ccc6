"""Sinks: where one call's captured values land on the host, and how they read back.

A `Call` holds what one call of a model recorded for one capture: full tensors
(batches concatenated on first read), statistics partials (merged exactly on
read), or files streamed to disk (read back memory-mapped). Several calls of one
method read back as one array (`read`); calls of different methods never merge.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np
from keras import ops

from callscope import _backend, _reduce
from callscope._points import CALL_KINDS, Spec

_TORCH = keras.backend.backend() == "torch"


# --------------------------------------------------------------------------
# One call's records
# --------------------------------------------------------------------------
class Call(Mapping):
    """What one call recorded for one capture: a read-only `Mapping[str, ndarray]`.

    Attributes:
        method: `"fit"`, `"evaluate"`, `"predict"`, `"train_on_batch"`,
            `"test_on_batch"`, `"predict_on_batch"` or `"__call__"`.
        nested: True for a call made while another call of the same model was
            running in the same thread: `fit`'s validation, or a callback's
            `predict`.
    """

    def __init__(self, spec: Spec, method: str, nested: bool, directory: str | None):
        self.spec = spec
        self.method = method
        self.nested = nested
        self._full: dict[str, list] = {}
        self._rows: dict[str, list[dict]] = {}
        self._per_step = False
        self._dir = directory
        self._files: dict[str, dict] = {}
        self._cache: dict[str, np.ndarray] = {}

    # -- filling (on the host, by the run) -----------------------------------
    def add(self, kind: str, key: str, value: Any) -> None:
        # Kept as device arrays until read: converting each batch on arrival would
        # synchronise every step and stall JAX's asynchronous dispatch. Only
        # streaming converts at once, to keep host memory bounded.
        self._cache.clear()
        if kind == "train" and _TORCH:  # torch keeps the autograd graph alive
            value = keras.tree.map_structure(ops.stop_gradient, value)
        if self._dir is not None and _backend.spans_processes(value):
            self._stream_blocks(key, value)  # each process writes the shards it holds
            return
        if _backend.process_index()[1] > 1:  # gathered now, while every process is here
            value = keras.tree.map_structure(_backend.gathered, value)
        if self.spec.stats:
            self._per_step |= kind == "train"
            self._rows.setdefault(key, []).append(value)
        elif self._dir is None:
            self._full.setdefault(key, []).append(value)
        else:
            self._stream(key, _reduce.to_numpy(value))

    def _stream(self, key: str, array: np.ndarray) -> None:
        entry = self._files.get(key)
        if entry is None:
            os.makedirs(self._dir, exist_ok=True)
            name = f"{len(self._files):04d}.bin"
            entry = self._files[key] = {
                "file": name, "dtype": array.dtype.str, "row": list(array.shape[1:]), "rows": 0,
            }
            open(os.path.join(self._dir, name), "xb").close()  # never truncates a file
        if list(array.shape[1:]) != entry["row"]:
            raise ValueError(
                f"Captured `{key}` changed shape from (N, {entry['row']}) to {array.shape}; "
                "streaming to disk needs a fixed shape per row. Capture it without `to=`."
            )
        with open(os.path.join(self._dir, entry["file"]), "ab") as f:
            f.write(np.ascontiguousarray(array, dtype=entry["dtype"]).tobytes())
        entry["rows"] += array.shape[0]

    def _stream_blocks(self, key: str, value) -> None:
        """Several JAX processes: this process appends the shards it holds to its
        own file, each block with its corner in the call's global rows."""
        entry = self._files.get(key)
        if entry is None:
            os.makedirs(self._dir, exist_ok=True)
            me, _ = _backend.process_index()
            name = f"{len(self._files):04d}.p{me}.bin"
            entry = self._files[key] = {
                "dtype": np.dtype(value.dtype).str, "row": list(value.shape[1:]), "rows": 0,
                "parts": [{"file": name, "blocks": []}],
            }
            open(os.path.join(self._dir, name), "xb").close()
        if list(value.shape[1:]) != entry["row"]:
            raise ValueError(
                f"Captured `{key}` changed shape from (N, {entry['row']}) to {value.shape}; "
                "streaming to disk needs a fixed shape per row. Capture it without `to=`."
            )
        part = entry["parts"][0]
        with open(os.path.join(self._dir, part["file"]), "ab") as f:
            for start, block in _backend.local_blocks(value):
                start[0] += entry["rows"]
                part["blocks"].append({"at": f.tell(), "start": start, "shape": block.shape})
                f.write(np.ascontiguousarray(block, dtype=entry["dtype"]).tobytes())
        entry["rows"] += value.shape[0]

    # -- reading -------------------------------------------------------------
    def _names(self) -> list[str]:
        if self.spec.stats:
            return [f"{k}/{s}" for k in self._rows for s in self.spec.stats]
        return list(self._files) if self._dir is not None else list(self._full)

    def __iter__(self):
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self._cache:
            self._cache[key] = read([self], key)
        return self._cache[key]

    def hist_edges(self, key: str) -> np.ndarray:
        """The bin edges of a `.../hist` key."""
        base = key.rpartition("/")[0] if key.endswith("/hist") else key
        return _reduce.hist_edges(self.spec.bins,
                                  self.spec.range_for(base, CALL_KINDS[self.method]))

    def __repr__(self) -> str:
        kind = "nested " if self.nested else ""
        return f"Call({kind}{self.method}: {len(self)} keys)"


def read(calls: list[Call], key: str) -> np.ndarray:
    """One key over several calls of one method: batches concatenated, or one
    exact aggregate (predict, evaluate), or one row per step (fit)."""
    spec = calls[0].spec
    if spec.stats:
        base, _, stat = key.rpartition("/")
        rows = []
        for call in calls:
            if base in call._rows:
                call._rows[base] = [{k: _reduce.to_numpy(v) for k, v in r.items()}
                                    for r in call._rows[base]]
                rows += call._rows[base]
        if not rows or stat not in spec.stats:
            raise KeyError(missing(key, calls))
        if calls[0]._per_step:
            return _reduce.per_step(_reduce.merge_each(rows), stat)
        stacked = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
        return _reduce.finalize(_reduce.merge(stacked), stat)
    parts = []
    for call in calls:
        if call._dir is not None and key in call._files and "parts" in call._files[key]:
            parts.append(assemble(call._dir, call._files[key]))
        elif call._dir is not None and key in call._files:
            entry = call._files[key]
            parts.append(np.memmap(os.path.join(call._dir, entry["file"]), dtype=entry["dtype"],
                                   mode="r", shape=(entry["rows"], *entry["row"])))
        elif key in call._full:
            done = [_reduce.to_numpy(p) for p in call._full[key]]
            call._full[key] = [done[0] if len(done) == 1 else np.concatenate(done)]
            parts.append(call._full[key][0])
    if not parts:
        raise KeyError(missing(key, calls))
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def assemble(directory: str, entry: dict) -> np.ndarray:
    """One key streamed by several processes: their blocks put back in place."""
    array = np.empty((entry["rows"], *entry["row"]), entry["dtype"])
    filled = 0
    for part in entry["parts"]:
        raw = np.memmap(os.path.join(directory, part["file"]), dtype=np.uint8, mode="r")
        for block in part["blocks"]:
            n = int(np.prod(block["shape"]))
            at = block["at"]
            data = raw[at:at + n * array.itemsize].view(array.dtype).reshape(block["shape"])
            array[tuple(slice(s, s + d) for s, d in zip(block["start"], block["shape"]))] = data
            filled += n
    if filled != array.size:
        raise ValueError(
            f"The capture files in `{directory}` hold {filled} of the {array.size} values "
            "of a key: a process's files or its part of the index are missing. Read the "
            "directory after every process has left its `cs.capture`. "
            f"Received: parts={[p['file'] for p in entry['parts']]}"
        )
    return array


def missing(key: str, calls) -> str:
    names = list(dict.fromkeys(n for c in calls for n in c._names()))
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.3)
    return f"{key!r} was not captured. Nearest keys: {close or names[:5]}"


MIXED_CALLS = (
    "This capture holds calls of different kinds ({methods}), and their rows are "
    "never merged. Read each call apart: `cap.calls` lists them in order, each a "
    "mapping with `.method` (e.g. `[c for c in cap.calls if c.method == 'predict']`), "
    "or open one capture per kind of call. Received: {n} top-level calls"
)


