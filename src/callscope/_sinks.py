"""Sinks: where one call's captured values land on the host, and how they read back.

Each step's captured values start their copy to the host as soon as the step
returns (`Landing`, one per run), and land later where waiting for them at once
would stall the device (JAX, or a GPU): the device runs ahead. Full tensors land
one step later, so the device holds at most one step of them whatever the number
of batches; a step of statistics only (one packed row) lands once the device
is done with it (JAX's `is_ready`, a torch CUDA copy's event; TF on a GPU cannot
tell), with at most `STATS_AHEAD` rows waiting. They land in a
`Call`, what one call of a model recorded for one capture:

- full tensors in `HostBuffer`s, one array per key that doubles when full, so
  adding a batch is O(1) amortised and reading is a view of the filled rows;
- statistics partials, merged exactly as they arrive (`_reduce.Running`) in
  predict and evaluate, or one row per step in fit: there each step's packed
  row of every point's partials is appended whole (`StepRows`), and each partial
  reads as columns of it (`Columns`), so a step costs one append however many
  points and partials it holds;
- or files, appended by the run's background `Writer` and read back memory-mapped.

Several calls of one method read back as one array (`read`); calls of different
methods never merge. A call counts its run's steps (`Landing.put` takes every
step, one that recorded nothing too) and notes which recorded each key: full rows
of a key that some steps skipped (a branch not taken) read as an error, since
they would not line up with the data's rows (`unaligned`).
"""

from __future__ import annotations

import collections
import contextlib
import difflib
import functools
import json
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

from callscope import _backend, _reduce
from callscope._points import CALL_KINDS, Spec
from callscope._writer import Writer


# --------------------------------------------------------------------------
# Host buffers
# --------------------------------------------------------------------------
_RESERVE = 64 * 2**20  # bytes a key's first buffer may span (see `append`)


class _Recycled:
    """Large host buffers, reused once nothing outside refers to them.

    Fresh memory costs a page fault per page when it is first written (the OS
    zeroes it): for a full capture, more than copying the rows themselves (128 MiB
    took 50 ms fresh, 7 ms reused). So a buffer of a capture that was dropped (its
    arrays, their views and the capture are gone: only this list refers to it)
    serves the next capture of the same size, whose pages are already mapped. At
    most `keep` bytes of buffers are kept, free or in use (unused ones make room
    for new ones); a buffer past that is an ordinary array, freed with its last
    view.

    >>> recycled = _Recycled(keep=2**30)
    >>> a = recycled.empty((2**18, 2), np.float32)
    >>> address = a.ctypes.data
    >>> recycled.empty((2**18, 2), np.float32).ctypes.data == address  # a is alive
    False
    >>> del a
    >>> recycled.empty((2**19,), np.int32).ctypes.data == address  # same bytes
    True
    """

    SMALLEST = 2**20  # smaller arrays come from malloc's heap, already mapped
    # What `_unused` reads for an object only a list refers to (the list's
    # reference and getrefcount's argument: 2 on CPython 3.11), measured in the
    # same form rather than assumed, as interpreters count differently.
    _ALONE = (lambda items: sys.getrefcount(items[0]))([object()])

    def _unused(self, i: int) -> bool:
        # Every view of a buffer refers to it (numpy's `base`): no view, no user.
        return sys.getrefcount(self._buffers[i]) == self._ALONE

    def __init__(self, keep: int):
        self._keep = keep
        self._buffers: list[np.ndarray] = []
        self._lock = threading.Lock()

    def empty(self, shape: tuple, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if nbytes < self.SMALLEST or dtype.hasobject:
            return np.empty(shape, dtype)
        with self._lock:
            for i in range(len(self._buffers)):
                if self._buffers[i].nbytes == nbytes and self._unused(i):
                    return self._buffers[i].view(dtype).reshape(shape)
            raw = np.empty(nbytes, np.uint8)
            if sum(b.nbytes for b in self._buffers) + nbytes > self._keep:
                # Make room by letting go of unused buffers of other sizes.
                self._buffers = [self._buffers[i] for i in range(len(self._buffers))
                                 if not self._unused(i)]
            if sum(b.nbytes for b in self._buffers) + nbytes <= self._keep:
                self._buffers.append(raw)
        return raw.view(dtype).reshape(shape)


_recycled = _Recycled(keep=512 * 2**20)

class HostBuffer:
    """The rows of one key on the host: one array, room for up to 64 MiB of rows
    (64 batches at least) from the start, whose capacity doubles when full.

    `append` is O(1) amortised (`grows` counts the reallocations: O(log rows)),
    and `view` is the filled rows, read-only, without a copy. A view stays valid
    while more rows arrive. A batch whose rows have another shape cannot join
    the array: the key then reads as an error that says so.

    >>> buffer = HostBuffer("h")
    >>> for start in range(0, 200, 2):
    ...     buffer.append(np.arange(start, start + 2.0).reshape(2, 1))
    >>> buffer.view()[:4, 0].tolist(), buffer.view().shape, buffer.grows
    ([0.0, 1.0, 2.0, 3.0], (200, 1), 1)
    """

    def __init__(self, key: str):
        self.key = key
        self.rows = 0
        self.grows = 0
        self._data: np.ndarray | None = None
        self._scalar = False  # 0-d values: one row each
        self._error: str | None = None

    def append(self, array: np.ndarray) -> None:
        array = np.asarray(array)
        if self._data is None:
            self._scalar = array.ndim == 0
        if self._scalar:
            array = array.reshape(1)
        if self._data is not None and array.shape[1:] != self._data.shape[1:]:
            self._error = self._error or (
                f"Captured `{self.key}` changed shape from (N, "
                f"{', '.join(map(str, self._data.shape[1:]))}) to {array.shape} within "
                "one call: its batches cannot be stacked into one array. Give every "
                "batch the same shape (e.g. pad to a fixed length), sow a value "
                "whose rows are not its first axis with `cs.sow(..., batch_axis=)`, "
                f"or capture another point. Received: a batch of shape {array.shape}")
        if self._data is not None and array.dtype != self._data.dtype:
            # Not cast to the first batch's dtype: a float batch after an int one
            # would read truncated, as the model never saw it.
            self._error = self._error or changed_dtype(self.key, self._data.dtype,
                                                       array.dtype)
        if self._error is not None:
            return
        needed = self.rows + array.shape[0]
        if self._data is None or needed > len(self._data):
            if self._data is None:
                # Room for many batches at once. Rows never written cost address
                # space only (the OS maps a page when it is first written; numpy
                # asks for huge pages): one large buffer spares the copies of
                # growing a small one, and the page faults of many fresh ones.
                # So does doubling: the spare half of a grown buffer is never given
                # back by a copy, which would fault in every page again.
                row = max(array[:1].nbytes, 1)
                capacity = max(needed, min(64 * needed, _RESERVE // row))
            else:
                capacity = max(needed, 2 * len(self._data))
            grown = _recycled.empty((capacity, *array.shape[1:]), array.dtype)
            if self._data is not None:
                _backend.copy_rows(grown[:self.rows], self._data[:self.rows])
                self.grows += 1
            self._data = grown
        _backend.copy_rows(self._data[self.rows:needed], array)
        self.rows = needed

    def view(self) -> np.ndarray:
        if self._error is not None:
            raise ValueError(self._error)
        view = self._data[:self.rows]
        if self._scalar and self.rows == 1:
            view = view[0]
        view = view.view()
        view.flags.writeable = False
        return view


class Columns:
    """One partial of one key in fit: columns of the run's packed rows (`StepRows`),
    read as a view. It stands where a `HostBuffer` of its own would (`rows`,
    `view`), without a copy per step.

    >>> rows = HostBuffer("partials")
    >>> rows.append(np.array([[4.0, 0.5, 1.0, 2.0]]))
    >>> rows.append(np.array([[2.0, 0.25, 3.0, 4.0]]))
    >>> Columns(rows, 0, 1, ()).view().tolist(), Columns(rows, 2, 4, (2,)).view().tolist()
    ([4.0, 2.0], [[1.0, 2.0], [3.0, 4.0]])
    """

    def __init__(self, rows: HostBuffer, start: int, stop: int, shape: tuple):
        self._rows, self._start, self._stop, self._shape = rows, start, stop, shape

    @property
    def rows(self) -> int:
        return self._rows.rows

    def view(self) -> np.ndarray:
        return _reduce.columns(self._rows.view(), self._start, self._stop, self._shape)

    def own(self, key: str) -> HostBuffer:
        """A `HostBuffer` of its own holding the same rows (a copy)."""
        buffer = HostBuffer(key)
        if self.rows:
            buffer.append(np.array(self.view()))
        return buffer


class StepRows:
    """fit's statistics of one run: every step's packed partials (`_reduce.pack`:
    one row of every point's partials) appended whole to one `HostBuffer`, each
    partial of each key a `Columns` view of it. Per step that is one append,
    however many points and partials there are (it was one per partial of each
    point).

    It holds while every step has one layout and one row. Anything else (a step
    traced with another set of points, rows per replica under `tf.distribute`,
    several JAX processes, a key that already has rows) makes it `give_up`: each
    key gets its own buffers back, and steps add per key as before.
    """

    def __init__(self, calls: tuple):
        self.calls = calls
        self.on = True
        self._number: int | None = None  # the one layout
        self._rows: HostBuffer | None = None

    def add(self, kind: str, name: str, value: np.ndarray) -> bool:
        """Takes one step's packed entry; False where it must be added per key."""
        if not self.on:
            return False
        number = int(name[len(_reduce.PACKED):])
        if self._number is None:
            if not self._takes(kind, number, value):
                self.give_up()
                return False
            self._begin(number)
        if number != self._number or len(value) != 1:
            self.give_up()
            return False
        self._rows.append(value)
        return True

    def _takes(self, kind: str, number: int, value) -> bool:
        if len(value) != 1 or _backend.process_index()[1] > 1:
            return False
        for call, key, _ in self._columns(number):
            if not (call.spec.stats and (call._per_step or kind == "train")):
                return False
            if key in call._steps or key in call._stats:
                return False
        return True

    def _begin(self, number: int) -> None:
        self._number, self._rows = number, HostBuffer("partials")
        for call, key, (partial, shape, start, stop) in self._columns(number):
            call._per_step = True
            call._steps.setdefault(key, {})[partial] = Columns(self._rows, start, stop, shape)

    def _columns(self, number: int):
        """`(call, key, (partial, shape, start, stop))` per column run of a layout."""
        for name, *where in _reduce.layout(number):
            index, key = name.split("|", 1)
            yield self.calls[int(index)], key, where

    def give_up(self) -> None:
        """Every key back on buffers of its own (a copy of its rows so far)."""
        self.on = False
        for call in self.calls:
            for key, rows in call._steps.items():
                for name, buffer in rows.items():
                    if isinstance(buffer, Columns):
                        rows[name] = buffer.own(f"{key}/{name}")


# --------------------------------------------------------------------------
# One run's values on their way to the host
# --------------------------------------------------------------------------
STATS_AHEAD = 64  # steps of statistics that may wait on the device (a row each)


class Landing:
    """One run's path to the host (see the module docstring): `put` each step's
    captured values as the step returns, `end` when the run ends or fails.

    `put` never raises: it runs inside Keras's loop, where an exception would lose
    the JAX loop's state (its weights are donated to each step). A failure (the
    writer's, or a streamed key that changed shape) stops the sinks and is kept
    in `failure`; the run raises it before its next step (`Run.check_before_step`),
    or `end` does if there is none. (A step of statistics may land up to
    `STATS_AHEAD` steps after it ran, so its failure surfaces as late.)
    """

    def __init__(self, calls: tuple):
        self.calls = calls
        # (kind, structure, handles, statistics only) of the steps on their way
        self._pending = collections.deque()
        self._lock = threading.RLock()  # a capture may be read from another thread
        self._writer: Writer | None = None
        self.failure: BaseException | None = None
        self.steps = 0  # the run's steps so far, each put, whether it recorded or not
        self._step_rows = StepRows(calls)
        for call in calls:
            call._landing = self

    def put(self, kind: str, sown: Mapping) -> None:
        """One step's values (none, for a step that reached no point selected)."""
        values = {name: value for name, value in sown.items() if "|" in name}
        with self._lock:
            step, self.steps = self.steps, self.steps + 1
            if self.failure is not None or not values:
                return
            try:
                leaves = keras.tree.flatten(values)
                stats_only = all(name.startswith(_reduce.PACKED) for name in values)
                pending = self._pending
                pending.append((kind, values, _backend.start_host_copy(leaves), stats_only,
                                step))
                if not _backend.copy_lags(leaves):
                    # At once: several JAX processes must land every step in
                    # step with each other (gathering is a collective), which
                    # landing by readiness would not keep.
                    self.land()
                    return
                # Full tensors land one step late: the device holds one step of
                # them. A step of statistics only is one packed row of a few
                # floats: up to `STATS_AHEAD` of them wait, so the host does not
                # wait for the device at each step, as Keras's own loop does not
                # (that wait cost JAX's fit 4% with statistics, 7% with
                # gradient statistics, on a CPU: `bench/capture.py`). A step of
                # full tensors waits behind no other: it is the newest or first.
                bound = STATS_AHEAD if stats_only else 1
                while len(pending) > 1 and (len(pending) > bound or not pending[0][3]
                                            or _backend.is_ready(pending[0][2])):
                    self._land_first()
            except BaseException as failure:  # nothing more lands (see `_land_first`)
                # An interrupt too (Ctrl-C while the writer's queue is full): raised
                # before the next step, not here, where JAX would lose the state
                # this step returned (its input was donated).
                self.failure = failure
                self._pending.clear()

    def land(self) -> None:
        """Every pending step's values into the calls' buffers (waits for them)."""
        with self._lock:
            while self._pending:
                self._land_first()

    def _land_first(self) -> None:
        """The first pending step into the calls' buffers. It leaves the queue once
        its copy is read (an interrupt while waiting keeps it, so no step after
        it lands before it). After a failure nothing more lands: the run raises,
        and a capture with a step missing in the middle would read as whole."""
        kind, structure, handles, _, step = self._pending[0]
        try:
            values = keras.tree.pack_sequence_as(structure, _backend.to_host(handles))
        except Exception:
            self._pending.clear()
            raise
        self._pending.popleft()
        try:
            rows = self._step_rows
            if rows.on:
                values = {name: value for name, value in values.items()
                          if not (name.startswith(_reduce.PACKED)
                                  and rows.add(kind, name, value))}
            for name, value in _reduce.unpack(values, _backend.gathered).items():
                index, key = name.split("|", 1)
                self.calls[int(index)].add(kind, key, value, step)
        except BaseException:
            # Half added (an interrupt too, while the writer's queue is full): the
            # steps behind it must not land after it, in its rows' place (where
            # full tensors land a step late, the next one landed at the run's end).
            self._pending.clear()
            raise

    def held(self) -> int:
        """How many arrays are still on their way (on the device): at most one
        step's full tensors beside up to `STATS_AHEAD` steps' packed statistics."""
        with self._lock:
            return sum(len(entry[2]) for entry in self._pending)

    def flush(self) -> None:
        """Everything so far readable: landed, and written to disk."""
        with self._lock:
            try:
                self.land()
            except BaseException as failure:  # the run stops and raises it too, at its end
                self.failure = self.failure or failure
                raise
            if self._writer is not None:
                self._writer.drain()

    def writer(self) -> Writer:
        if self._writer is None:
            self._writer = Writer()
        return self._writer

    def end(self, error: BaseException | None = None) -> None:
        """Lands the last step, flushes and closes the files, and raises what
        failed. After a failure of the run (`error`), adds it to that as a note."""
        problems, ended = [], False
        try:
            with self._lock:
                problems = [self.failure] if self.failure is not None else []
                stopped = None  # an interrupt while the last step lands: the files close
                for finish in (self.land, self._close_writer):
                    try:
                        finish()
                    except Exception as problem:
                        problems.append(problem)
                    except BaseException as interrupt:
                        stopped = stopped or interrupt
                if stopped is not None:
                    raise stopped
            ended = True
        finally:
            # Released last, whatever happened (an interrupt too): a capture's exit
            # waits for its calls run in other threads, then writes an index of
            # what is on disk. Outside the lock: that exit holds its capture's lock
            # while it reads this landing's calls. A call whose last step failed
            # to land or write raises here, after its run: it failed too (its rows
            # stop at the step before).
            self._release(failed=error is not None or bool(problems) or not ended)
        if not problems:
            return
        if error is None:
            raise problems[0]
        # Not where the run raised this failure itself, or one that reads the same
        # (fit and its validation, writing to one full disk).
        if problems[0] is not error and str(problems[0]) != str(error):
            error.add_note(f"callscope could not finish the capture: {problems[0]}")

    def _release(self, failed: bool) -> None:
        calls = list(self.calls)
        try:
            while calls:
                calls.pop(0).finish(failed)
        finally:  # one that raised (an interrupt) leaves the others finished too
            for call in calls:
                call.finish(failed)

    def _close_writer(self) -> None:
        if self._writer is not None:
            self._writer.close()


# --------------------------------------------------------------------------
# One call's records
# --------------------------------------------------------------------------
class Call(Mapping):
    """What one call recorded for one capture: a read-only `Mapping[str, ndarray]`.

    Attributes:
        method: `"fit"`, `"evaluate"`, `"predict"`, `"train_on_batch"`,
            `"test_on_batch"`, `"predict_on_batch"` or `"__call__"`.
        nested: True for a call made while another call of the same model, one
            this capture records too, was running in the same thread: `fit`'s
            validation, or a callback's `predict`.
        failed: True for a call that raised (an error caught inside the scope, or
            the one that left it): its rows stop at the last step that ran (a
            Ctrl-C that cut a step's values short may leave its keys a step
            apart). `cs.load_capture` gives it back.
    """

    def __init__(self, spec: Spec, method: str, nested: bool, directory: str | None,
                 owner: str | None = None):
        self.spec = spec
        self.method = method
        self.nested = nested
        self._full: dict[str, HostBuffer] = {}
        self._stats: dict[str, _reduce.Running] = {}  # predict, evaluate: merged
        self._steps: dict[str, dict[str, HostBuffer]] = {}  # fit: one row per step
        self._per_step = CALL_KINDS.get(method) == "train"
        self._dir = directory
        self._owner = owner  # the capture's `OWNER`: its files are still these
        # Running from `Capture._begin` to `finish`: the capture's exit waits for
        # the calls of other threads, notified through its condition (`_ended`).
        self._running = False
        self.failed = False  # the call raised (what it reached may be partial)
        self._thread = 0  # that started it
        self._ended: threading.Condition | None = None
        self._capture = None  # a weak reference: told when a call that outlived it ends
        self._files: dict[str, dict] = {}
        self._queued: dict[str, int] = {}  # rows handed to the writer, per key
        self._offsets: dict[str, int] = {}  # bytes handed to the writer, per file
        self._landing: Landing | None = None  # the run's, while it runs
        self._ended_steps = 0  # the run's steps, once it ended (while it runs: its landing's)
        # key -> [the last step that recorded it, the steps before that did not]
        self._reach: dict[str, list] = {}

    # -- filling (on the host, by the run's landing) -------------------------
    def add(self, kind: str, key: str, value: Any, step: int = 0) -> None:
        if not self.spec.stats:  # (full rows alone must line up: `_skipped`)
            reach = self._reach.get(key) or self._reach.setdefault(key, [-1, []])
            if step > reach[0] + 1:  # the steps since the last that recorded it did not
                reach[1].extend(range(reach[0] + 1, step))
            reach[0] = step
        if self._dir is not None and _backend.spans_processes(value):
            self._stream_blocks(key, value)  # each process writes the shards it holds
            return
        if _backend.process_index()[1] > 1:  # gathered now, while every process is here
            value = keras.tree.map_structure(_backend.gathered, value)
        if self.spec.stats:
            self._per_step |= kind == "train"
            if self._per_step:
                # One row per step: a step's replicas' rows (tf.distribute) merged;
                # one device's single row goes in as it is (no copy per step).
                if len(next(iter(value.values()))) > 1:
                    value = _reduce.merge_each([value])
                rows = self._steps.setdefault(key, {})
                for name, part in value.items():
                    buffer = rows.get(name) or rows.setdefault(name, HostBuffer(f"{key}/{name}"))
                    buffer.append(part)  # never a `Columns`: `StepRows` gave those up
            else:
                (self._stats.get(key) or self._stats.setdefault(key, _reduce.Running())).add(value)
        elif self._dir is None:
            (self._full.get(key) or self._full.setdefault(key, HostBuffer(key))).append(value)
        else:
            self._stream(key, _backend.owned(np.asarray(value)))

    def _new_file(self, key: str, name: str, dtype, row, **extra) -> dict:
        entry = self._files[key] = {"dtype": dtype_name(dtype), "row": list(row),
                                    "rows": 0, **extra}
        self._queued[key] = 0
        self._offsets[name] = 0
        return entry

    def _check_row(self, key: str, entry: dict, shape, dtype) -> None:
        if list(shape[1:]) != entry["row"]:
            raise ValueError(
                f"Captured `{key}` changed shape from (N, {entry['row']}) to {shape}; "
                "streaming to disk needs a fixed shape per row. Capture it without `to=`, "
                "or sow a value whose rows are not its first axis with "
                "`cs.sow(..., batch_axis=)`."
            )
        if dtype_name(dtype) != entry["dtype"]:
            raise ValueError(changed_dtype(key, dtype_of(entry["dtype"]), dtype))

    def _stream(self, key: str, array: np.ndarray) -> None:
        entry = self._files.get(key)
        if entry is None:
            if array.dtype.hasobject:
                raise ValueError(
                    f"Captured `{key}` holds {_objects(array)}, which cannot be "
                    "streamed to disk: a file holds fixed-size values. Capture it "
                    "without `to=` (in memory), or leave it out of the selection. "
                    f"Received: a batch of dtype {array.dtype}")
            name = f"{len(self._files):04d}.bin"
            entry = self._new_file(key, name, array.dtype, array.shape[1:], file=name)
        self._check_row(key, entry, array.shape, array.dtype)
        self._queued[key] += array.shape[0]
        self._landing.writer().write(
            os.path.join(self._dir, entry["file"]),
            array.astype(dtype_of(entry["dtype"]), copy=False),
            functools.partial(_count_rows, entry, array.shape[0]))

    def _stream_blocks(self, key: str, value) -> None:
        """Several JAX processes: this process appends the shards it holds to its
        own file, each block with its corner in the call's global rows."""
        entry = self._files.get(key)
        if entry is None:
            me, _ = _backend.process_index()
            name = f"{len(self._files):04d}.p{me}.bin"
            entry = self._new_file(key, name, value.dtype, value.shape[1:],
                                   parts=[{"file": name, "blocks": []}])
        self._check_row(key, entry, value.shape, value.dtype)
        part = entry["parts"][0]
        writer = self._landing.writer()
        for start, block in _backend.local_blocks(value):
            start[0] += self._queued[key]
            block = np.asarray(block, dtype_of(entry["dtype"]))
            record = {"at": self._offsets[part["file"]], "start": start,
                      "shape": list(block.shape)}
            self._offsets[part["file"]] += block.nbytes
            writer.write(os.path.join(self._dir, part["file"]), block,
                         functools.partial(part["blocks"].append, record))
        self._queued[key] += value.shape[0]
        writer.write(os.path.join(self._dir, part["file"]), np.empty(0, np.uint8),
                     functools.partial(_count_rows, entry, value.shape[0]))

    def files(self) -> dict:
        """The index's entries of this call, as now (its run may be adding keys)."""
        with self.held():
            return {key: dict(entry) for key, entry in self._files.items()}

    def finish(self, failed: bool) -> None:
        """The call ended (or `failed`, maybe before its run began): its capture
        may close."""
        self.failed = failed
        if self._landing is not None:
            self._ended_steps = self._landing.steps
            for key, entry in self._files.items():  # kept in the index (`load_capture`)
                if skipped := self._skipped(key):
                    entry["skipped"] = skipped
        self._landing = None
        if self._ended is None:
            return
        with self._ended:
            self._running = False
            self._ended.notify_all()
        capture = self._capture()
        if capture is not None:
            capture._call_finished()

    # -- reading -------------------------------------------------------------
    def flush(self) -> None:
        """Lands and writes what the run in progress holds (a no-op after it)."""
        landing = self._landing
        if landing is not None:
            landing.flush()

    def held(self):
        """Holds off the run's landing while a reader looks (another thread may be
        adding this call's values: a half-added step must never be read)."""
        landing = self._landing
        return landing._lock if landing is not None else contextlib.nullcontext()

    def _skipped(self, key: str) -> list[int]:
        """The steps of this call (numbered from 0) that ran without recording
        `key`, which it recorded in others: a branch not taken for that batch.
        Not the steps after the last that landed, in a call that stopped short (it
        raised, or a sink failed): its rows stop early (`failed`)."""
        if key not in self._reach:
            return list(self._files.get(key, {}).get("skipped", ()))  # a loaded call
        last, before = self._reach[key]
        landing = self._landing
        if self.failed or (landing is not None and landing.failure is not None):
            return list(before)
        return [*before, *range(last + 1, self._run_steps())]

    def _run_steps(self) -> int:
        """How many steps this call's run ran (so far, while it runs)."""
        landing = self._landing
        return landing.steps if landing is not None else self._ended_steps

    def steps(self, key: str) -> int:
        """fit's statistics: how many steps `key` has rows for."""
        self.flush()
        rows = self._steps.get(key)
        return next(iter(rows.values())).rows if rows else 0

    def step_rows(self, key: str, start: int = 0) -> dict[str, np.ndarray]:
        """fit's statistics: the partials of `key`'s steps from `start` on (views)."""
        self.flush()
        return {name: buffer.view()[start:] for name, buffer in self._steps[key].items()}

    def _names(self) -> list[str]:
        if self.spec.stats:
            return [f"{k}/{s}" for k in (self._steps if self._per_step else self._stats)
                    for s in self.spec.stats]
        return list(self._files) if self._dir is not None else list(self._full)

    def __iter__(self):
        self.flush()
        return iter(self._names())

    def __len__(self) -> int:
        self.flush()
        return len(self._names())

    def __getitem__(self, key: str) -> np.ndarray:
        return read([self], key)

    def __contains__(self, key) -> bool:
        # (Mapping's reads the key, which raises for rows some steps skipped)
        self.flush()
        return key in self._names()

    def hist_edges(self, key: str) -> np.ndarray:
        """The bin edges of a `.../hist` key."""
        base = key.rpartition("/")[0] if key.endswith("/hist") else key
        return _reduce.hist_edges(self.spec.bins,
                                  self.spec.range_for(base, CALL_KINDS[self.method]))

    def __repr__(self) -> str:
        kind = "nested " if self.nested else ""
        return f"Call({kind}{self.method}: {len(self)} keys)"


def dtype_name(dtype) -> str:
    """A dtype as the index stores it: numpy's string (`<f4`), or the name of an
    ml_dtypes type (`bfloat16`, `float8_e5m2`), whose string numpy cannot read
    back (`<V2`, or `<f1` for `float8_e5m2`, whose kind is "f")."""
    dtype = np.dtype(dtype)
    try:
        if np.dtype(dtype.str) == dtype:
            return dtype.str
    except TypeError:
        pass
    return dtype.name


def dtype_of(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # installed with jax and tensorflow

        return np.dtype(getattr(ml_dtypes, name))


def changed_dtype(key: str, was, now) -> str:
    return (f"Captured `{key}` changed dtype from {np.dtype(was).name} to "
            f"{np.dtype(now).name} within one call: its batches cannot be joined "
            "without casting some (a float batch read as ints, say). Give every "
            "batch the same dtype (cast in the data pipeline), or capture another "
            f"point. Received: a batch of dtype {np.dtype(now).name}")


def _objects(array: np.ndarray) -> str:
    first = next(iter(array.reshape(-1)), None)
    return "strings" if isinstance(first, (bytes, str)) else "Python objects"


def _count_rows(entry: dict, rows: int) -> None:
    entry["rows"] += rows  # on the writer's thread, once the rows are on disk


def read(calls: list[Call], key: str, joined=()) -> np.ndarray:
    """One key over several calls of one method: batches concatenated, or one
    exact aggregate (predict, evaluate), or one row per step (fit). One call's
    batches read as a view, without a copy. `joined`: `(number, call)` for every
    call of that method (those that recorded nothing too), whose full rows must
    each hold the key, checked with every call held (a running call counts a
    step before its values land)."""
    with contextlib.ExitStack() as stack:
        for call in {id(c): c for c in [*calls, *(c for _, c in joined)]}.values():
            stack.enter_context(call.held())
            call.flush()
        if joined:
            _check_every_call_recorded(key, joined)
        return _read(calls, key)


def _check_every_call_recorded(key: str, joined: list) -> None:
    """Raises where some of the calls whose rows `cap[key]` joins ran steps
    without recording `key` (a branch not taken), which others recorded: the
    joined rows would not line up with the calls' data."""
    names = {id(call): call._names() for _, call in joined}
    without = [i for i, call in joined if call._run_steps() and not call.failed
               and key not in names[id(call)]]
    if without and any(key in n for n in names.values()):
        raise ValueError(
            f"`{key}` was recorded by some of the calls whose rows `cap[{key!r}]` "
            f"joins, not by cap.calls{without} (their steps ran without reaching it: a "
            "branch not taken), so the joined rows would not line up with the calls' "
            "data. Read each call that recorded it from `cap.calls[i][key]`, or "
            f"capture a point that every call reaches. Received: {len(joined)} calls, "
            f"{len(without)} without `{key}`")


def _read(calls: list[Call], key: str) -> np.ndarray:
    spec = calls[0].spec
    if spec.stats:
        base, _, stat = key.rpartition("/")
        if stat not in spec.stats:
            raise KeyError(missing(key, calls))
        if calls[0]._per_step:
            rows = [call._steps[base] for call in calls if base in call._steps]
            if not rows:
                raise KeyError(missing(key, calls))
            stacked = {k: _joined([r[k].view() for r in rows]) for k in rows[0]}
            return _reduce.per_step(stacked, stat)
        merged = [call._stats[base].result() for call in calls if base in call._stats]
        if not merged:
            raise KeyError(missing(key, calls))
        stacked = {k: np.stack([m[k] for m in merged]) for k in merged[0]}
        return _reduce.finalize(_reduce.merge(stacked), stat)
    for call in calls:
        if skipped := (key in call._full or key in call._files) and call._skipped(key):
            raise ValueError(unaligned(key, call.method, skipped, call._run_steps()))
    parts = []
    for directory, owner in {(os.path.dirname(c._dir), c._owner) for c in calls
                             if c._dir is not None and key in c._files}:
        check_owner(directory, owner, key)
    for call in calls:
        if call._dir is not None and key in call._files and "parts" in call._files[key]:
            parts.append(assemble(call._dir, call._files[key]))
        elif call._dir is not None and key in call._files:
            entry = call._files[key]
            if not entry["rows"]:  # nothing reached the disk (mmap refuses 0 bytes)
                parts.append(np.empty((0, *entry["row"]), dtype_of(entry["dtype"])))
                continue
            parts.append(_mapped(os.path.join(call._dir, entry["file"]), key,
                                 dtype_of(entry["dtype"]), (entry["rows"], *entry["row"])))
        elif key in call._full:
            parts.append(call._full[key].view())
    if not parts:
        raise KeyError(missing(key, calls))
    shapes = list(dict.fromkeys(part.shape[1:] for part in parts))
    if len(shapes) > 1:
        raise ValueError(
            f"`{key}` has rows of different shapes in the calls of this capture "
            f"({', '.join(map(str, shapes))}: inputs of another length, say), which "
            "cannot be concatenated. Read each call's rows from `cap.calls[i][key]`. "
            f"Received: {len(parts)} calls"
        )
    dtypes = list(dict.fromkeys(part.dtype for part in parts))
    if len(dtypes) > 1:  # (np.concatenate would promote them: int32 and float32 to float64)
        raise ValueError(
            f"`{key}` has rows of different dtypes in the calls of this capture "
            f"({', '.join(map(str, dtypes))}: inputs of another dtype, say), which "
            "cannot be concatenated without a cast. Read each call's rows from "
            f"`cap.calls[i][key]`. Received: {len(parts)} calls"
        )
    return _joined(parts)


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """One part as it is (a view, a memmap), several concatenated: a copy, made
    read-only as the parts are."""
    if len(parts) == 1:
        return parts[0]
    joined = np.concatenate(parts)
    joined.flags.writeable = False
    return joined


def _mapped(path: str, key: str, dtype, shape) -> np.memmap:
    """A streamed file, read in place; one that is gone, or shorter than the index
    says, raises an error that says so (numpy's named neither)."""
    try:
        return np.memmap(path, dtype=dtype, mode="r", shape=shape)
    except (FileNotFoundError, ValueError) as error:
        what = f" of captured `{key}`" if key else ""
        raise ValueError(
            f"The capture file `{path}`{what} is gone or shorter than the capture's index "
            "says: it was deleted, moved or cut short after the capture wrote it. Read a "
            "capture's directory as its scope left it. "
            f"Received: {type(error).__name__}: {error}") from error


def assemble(directory: str, entry: dict) -> np.ndarray:
    """One key streamed by several processes: their blocks put back in place."""
    array = np.empty((entry["rows"], *entry["row"]), dtype_of(entry["dtype"]))
    filled = 0
    for part in entry["parts"]:
        raw = _mapped(os.path.join(directory, part["file"]), "", np.uint8, None)
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


OWNER = "owner.json"  # a streaming capture's id, written when it opens


_owners: dict[str, tuple] = {}  # path -> (its stat, its owner): read once per change


def owner_of(directory: str) -> str | None:
    path = os.path.join(directory, OWNER)
    try:
        stat = os.stat(path)
        seen = (stat.st_ino, stat.st_dev, stat.st_mtime_ns, stat.st_size)
        known = _owners.get(path)
        if known is not None and known[0] == seen:
            return known[1]
        with open(path) as f:
            owner = json.load(f)
    except FileNotFoundError:
        return None
    _owners[path] = (seen, owner)
    return owner


def check_owner(directory: str, owner: str | None, key: str) -> None:
    """Refuses to read calls whose directory now holds another capture's files
    (an `overwrite=True` capture reuses the names `call_000/0000.bin`, ...)."""
    if owner is not None and owner_of(directory) != owner:
        raise ValueError(
            f"The files of this capture in `{directory}` were deleted or replaced (by "
            "a later cs.capture(to=..., overwrite=True) on that directory, say): "
            "reading them would give another capture's values. Read a capture "
            "before its directory is written again, or give each capture a "
            f"directory of its own. Received: key={key!r}")


def missing(key: str, calls) -> str:
    names = list(dict.fromkeys(n for c in calls for n in c._names()))
    if not names:
        which = "this call" if len(calls) == 1 else "these calls"
        if not any(c._run_steps() for c in calls):
            if any(c._landing is not None for c in calls):
                return f"{key!r} was not captured: no step of {which} has ended yet"
            return f"{key!r} was not captured: {which} ran no step (it raised first)"
        return (f"{key!r} was not captured: {which} recorded nothing (no step reached "
                "a point that the capture selects)")
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.3)
    return f"{key!r} was not captured. Nearest keys: {close or names[:5]}"


def unaligned(key: str, method: str, skipped: list[int], steps: int) -> str:
    """The error for a full capture whose key some steps of a call did not record:
    its rows would not line up with the data's."""
    shown = skipped if len(skipped) <= 8 else [*skipped[:8], "..."]
    return (
        f"`{key}` was recorded by {steps - len(skipped)} of the {steps} steps of this "
        f"`{method}`: steps {shown} (numbered from 0) ran without reaching it (a branch "
        "that a batch's shape or values took, in a step traced for that shape or run "
        "eagerly), so its rows would not line up with the data's rows. Capture a "
        "point that every step reaches, or `cs.sow` the value in every branch (a "
        "filler, such as NaN, where the point does not run); statistics "
        "(`reduce=`) aggregate the rows that reached it. Received: "
        f"key={key!r}, steps without it={shown}")


MIXED_CALLS = (
    "This capture holds calls of different kinds ({methods}), and their rows are "
    "never merged. Read each call apart: `cap.calls` lists them in order, each a "
    "mapping with `.method` (e.g. `[c for c in cap.calls if c.method == 'predict']`), "
    "or open one capture per kind of call. Received: {n} top-level calls"
)


