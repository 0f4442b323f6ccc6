"""`cs.capture`: a scope that fills a read-only mapping of intermediates.

A key is `point:kind` (kind `output`, `input` or `grad`), or `point:kind/stat` with
`reduce=`. The scope is held in a `ContextVar`: it sees
the calls made by the thread (or task) that opened it. Each call of the model made
inside it starts a run that gets its own sink (`_sinks.Call`, listed in
`cap.calls`); its spec becomes part of the model's compiled-function key, the
collector (`_record.py`) records inside the step, and the values leave it as extra
outputs that reach the run's sink before Keras's loop sees them, so outputs, logs,
callbacks and the progress bar are unchanged.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import shutil
import threading
import uuid
import warnings
import weakref
from collections.abc import Callable, Mapping

import numpy as np

from callscope import _backend, _record, _reduce, _scope, _sinks
from callscope._writer import WriteError
from callscope._points import (KINDS, Ranges, Spec, loop_points, nearest, normalize_select,
                               single_calls_hint, tree_points, unmatched_globs)

WAIT_S = 10.0  # how long a scope's exit waits for its calls in other threads


def begin_calls(captures, method: str, runs: tuple) -> tuple:
    """`(calls, landing)` of a call starting under `captures` (landing None without
    captures). Each capture counts its call as running from here until the
    landing ends, or until whatever fails before that: its exit waits for it."""
    calls = []
    try:
        for capture in captures:
            calls.append(capture._begin(method, runs))
        return tuple(calls), (_sinks.Landing(tuple(calls)) if calls else None)
    except BaseException:
        for call in calls:
            call.finish(failed=True)
        raise


class _Claimed:
    """The directories of this process's open streaming captures. Two captures
    writing one directory (or one inside the other) would mix their files: each
    names its first call `call_000`, and one run's writer appends to a file it
    already has open. So a second one is refused while the first is open."""

    def __init__(self):
        self._lock = threading.Lock()
        self._paths: set[str] = set()

    def claim(self, directory: str) -> str:
        path = os.path.realpath(directory)
        with self._lock:
            taken = next((p for p in self._paths if p == path or path.startswith(p + os.sep)
                          or p.startswith(path + os.sep)), None)
            if taken is not None:
                raise ValueError(
                    f"`{directory}` is {'the' if taken == path else 'inside, or holds, the'} "
                    f"directory of another open cs.capture (`{taken}`): two captures "
                    "writing there would mix their files. Give each open capture a "
                    f"directory of its own. Received: to={directory!r}")
            self._paths.add(path)
        return path

    def release(self, path: str) -> None:
        with self._lock:
            self._paths.discard(path)


_claimed = _Claimed()


# --------------------------------------------------------------------------
# The public scope and mapping
# --------------------------------------------------------------------------
class Capture(Mapping):
    """What `cs.capture` yields: a read-only `Mapping[str, numpy.ndarray]`.

    It fills in as calls finish and is complete when the scope exits. Keys are
    `point:kind`, or `point:kind/stat` with `reduce=`.

    Each call made in the scope records apart (`cap.calls`). The mapping itself
    reads the top-level calls, which must all be of one method (several `predict`s
    concatenate; several `fit`s give one row per step); calls of different
    methods, or whose rows of a key differ in shape or dtype, raise an error that
    says how to read each. Calls nested in another
    call of the model that this capture records (`fit`'s validation, a callback's
    `predict`) are only in `cap.calls`, with `nested=True`, and never mix into the
    outer call's rows. A capture opened inside such a callback reads its calls as
    top-level ones.
    """

    def __init__(self, model, spec: Spec, to: str | os.PathLike | None, log: bool = False,
                 overwrite: bool = False):
        self.model = model
        self._overwrite = overwrite
        self.spec = spec
        self.log = log
        self.calls: list[_sinks.Call] = []
        self._dir = os.fspath(to) if to is not None else None
        if self._dir == "":
            raise ValueError(
                "cs.capture(to=...) got an empty path, which would stream into (and "
                "with overwrite=True empty) the working directory. Give the directory "
                "to write, or leave `to` out to capture in memory. Received: to=''")
        self._id: str | None = None  # its files' owner (`_sinks.OWNER`)
        self._token = None
        self.dropped = False  # ended with the call it was opened in (`_scope`)
        self.reached = False  # a call of the model (or of one holding it) looked it up
        self._closed = False
        self._late = False  # calls outlived the scope: the last one writes the index
        self._claim: str | None = None  # the directory, claimed while the scope is open
        # Calls may start in copied contexts' threads; the scope's exit waits for
        # theirs (`_begin`, `__exit__`).
        self._lock = threading.Condition()

    def _begin(self, method: str, runs: tuple) -> _sinks.Call:
        """A new call's sink (called by the model when a call starts). `runs` are
        those in progress in this thread (`fit` for its validation, or the fit of
        a model that holds this one, for a callback's `predict`). The call is
        nested for this capture only where this capture records one of them too:
        a capture opened inside a callback reads the calls it saw as its own."""
        with self._lock:
            nested = self._records(runs)
            if self._closed and not nested:
                raise RuntimeError(
                    f"A `{method}` call of `{self.model.name}` started in a context "
                    "copied inside a cs.capture scope (`contextvars.copy_context()`, or "
                    "an asyncio task made there, which copies the context it is made in) "
                    "after that scope closed: its values would reach a capture that is "
                    "complete (and, with `to=`, whose index is written). Make the call "
                    "before the scope closes (await the task inside it), or open a "
                    "capture in that thread or task. "
                    f"Received: method={method!r}")
            directory = (None if self._dir is None
                         else os.path.join(self._dir, f"call_{len(self.calls):03d}"))
            call = _sinks.Call(self.spec, method, nested, directory, self._id)
            # Its condition and a weak reference, not the capture: a call holding
            # its capture would keep both, and its host buffers, alive until a
            # garbage collection (its buffers could not serve the next capture).
            call._running, call._thread = True, threading.get_ident()
            call._ended, call._capture = self._lock, weakref.ref(self)
            self.calls.append(call)
        return call

    def _running(self, others_only: bool) -> list[_sinks.Call]:
        me = threading.get_ident()
        return [c for c in self.calls if c._running and not (others_only and c._thread == me)]

    def _wait_for_other_threads(self) -> bool:
        """Waits for the calls recorded by this capture that run in other threads
        (started in contexts copied inside the scope), so that the capture is
        complete, and its index counts their rows, when the scope exits; False if
        some still run after `WAIT_S` (one may wait for this thread). Not for this
        thread's: the scope's own calls have returned, and a call still running
        here is the one whose callback closes the scope."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._running(True), timeout=WAIT_S)

    def _call_finished(self) -> None:
        """A call ended: the last of those that outlived the scope writes the index
        again (one process: several meet at barriers to write one), and lets the
        directory go. Under the lock, as the exit's write and its decision are: one
        of the two writes last and releases the directory, once."""
        with self._lock:
            if not self._late or self._running(False):
                return
            self._late = False
            try:
                self._write_index()
            except Exception as error:  # noqa: BLE001 - not the late call's failure
                warnings.warn(
                    f"cs.capture could not write the index of `{self._dir}` again when "
                    f"its last call ended: {error}. It counts the rows written when its "
                    f"scope closed. Received: to={self._dir!r}", stacklevel=2)
            finally:
                _claimed.release(self._claim)

    def _records(self, runs: tuple) -> bool:
        """Whether this capture records one of `runs`."""
        return any(any(call is mine for mine in self.calls)  # by identity: a Call is
                   for run in runs for call in run.calls)    # a Mapping

    def _top(self) -> list[_sinks.Call]:
        top = [c for c in self.calls if not c.nested and len(c)]
        methods = list(dict.fromkeys(c.method for c in top))
        if len(methods) > 1:
            raise ValueError(_sinks.MIXED_CALLS.format(methods=", ".join(methods), n=len(top)))
        return top

    def _names(self) -> list[str]:
        return list(dict.fromkeys(n for c in self._top() for n in c._names()))

    def __iter__(self):
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def __getitem__(self, key: str) -> np.ndarray:
        top = self._top()
        if not top:
            raise KeyError(f"{key!r} was not captured: no call in this capture recorded "
                           "anything yet")
        # (full rows: every call of the method that ran, to check each recorded it)
        joined = () if self.spec.stats else [
            (i, c) for i, c in enumerate(self.calls) if not c.nested and c.method == top[0].method]
        value = _sinks.read(top, key, joined)
        failed = [i for i, call in enumerate(self.calls)
                  if call.failed and key in call._names() and any(call is t for t in top)]
        if failed and len(top) > 1:  # (its rows stop early: the joined rows would not
            # line up with the calls' data, and nothing else would say so)
            warnings.warn(
                f"cs.capture: `{key}` joins the rows of {len(top)} calls, of which "
                f"cap.calls{failed} raised (its rows stop at the last step that ran). "
                "Read each call from `cap.calls[i][key]`.", stacklevel=2)
        return value

    def __contains__(self, key) -> bool:
        # (Mapping's reads the key: every row joined, and a failed call's warning)
        return key in self._names()

    def hist_edges(self, key: str) -> np.ndarray:
        """The bin edges of a `.../hist` key (the calls of one kind share them)."""
        top = self._top()
        if not top:
            raise KeyError(f"{key!r} was not captured: no call in this capture recorded "
                           "anything yet")
        return top[0].hist_edges(key)

    def __repr__(self) -> str:
        try:
            names = self._names()
        except ValueError:
            return f"Capture({len(self.calls)} calls of different kinds)"
        return f"Capture({len(names)} keys: {names[:4]}{'...' if len(names) > 4 else ''})"

    # -- the scope -----------------------------------------------------------
    def __enter__(self) -> Capture:
        if self._token is not None:
            raise RuntimeError("A `cs.capture` scope can be entered once. Open a new one.")
        # Now, not at the first call: a layer called outside any call of the model
        # (keras_hub's `generate`) is refused by its wrapper, not missed.
        _record.install_wrappers(self.model)
        if self._dir is not None:
            self._claim = _claimed.claim(self._dir)
            # Absolute from here: a later `os.chdir` must not move the files.
            self._dir = os.path.abspath(self._dir)
            try:
                self._made = not os.path.exists(self._dir)
                self._open_directory()
            except BaseException:
                _claimed.release(self._claim)
                raise
        self._token = _scope.enter_capture(self)
        self._thread, self.dropped = threading.current_thread().name, False
        return self

    def _open_directory(self) -> None:
        # Several JAX processes share one directory: each looks before any
        # writes (the barrier), and only the first deletes.
        first = _backend.process_index()[0] == 0
        # Only the first process looks at the directory's contents with
        # overwrite=True (another's look could race its delete).
        if os.path.exists(self._dir) and not os.path.isdir(self._dir):
            raise NotADirectoryError(
                f"`{self._dir}` is a file: cs.capture(to=...) writes a directory. Give "
                f"a new or empty directory. Received: to={self._dir!r}"
            )
        os.makedirs(self._dir, exist_ok=True)
        if self._overwrite and _holds_the_working_directory(self._dir):
            raise ValueError(
                f"cs.capture(to=..., overwrite=True) would empty `{self._dir}`, which is, "
                f"or holds, the working directory ({os.getcwd()!r}): your script and data "
                "would go with it. Give the capture a directory of its own (`to="
                f"'{os.path.join(self._dir, 'capture')}'`). Received: to={self._dir!r}")
        if self._overwrite and first:
            empty_directory(self._dir)
        if not self._overwrite and os.listdir(self._dir):
            raise FileExistsError(
                f"`{self._dir}` already holds a capture or other files: cs.capture(to=...) "
                "never writes into a directory that holds files. Choose a new or empty "
                "directory, or pass overwrite=True to delete what it holds first. "
                f"Received: to={self._dir!r}"
            )
        _backend.barrier(f"callscope-capture-open:{self._dir}")
        # The files' owner: a capture (or `load_capture`) whose directory was
        # emptied and written again by a later capture reads the owner's name,
        # not the later capture's files, which reuse the same names.
        owner = os.path.join(self._dir, _sinks.OWNER)
        if first:
            try:
                _write_json(owner, uuid.uuid4().hex)
            except OSError:  # (a full disk) the directory as it was found
                self._leave_directory()
                raise
        _backend.barrier(f"callscope-capture-owner:{self._dir}")
        self._id = _sinks.owner_of(self._dir)

    def __exit__(self, exc_type, exc, tb) -> None:
        # First, and alone: an exit where the scope is not open (another thread)
        # raises with the scope as it was, for the right exit.
        if not self.dropped:  # (ended with the call it was opened in: `ending_scopes...`)
            _scope.exit_capture(None if self._closed else self._token, self, self._thread)
        elif self._closed:
            raise RuntimeError("A `cs.capture` is not open: it was exited already.")
        late = whole = False
        try:
            with self._lock:
                self._closed = True
            whole = self._wait_for_other_threads()
            one_process = _backend.process_index()[1] == 1
            if not whole:
                warnings.warn(
                    "cs.capture: calls that it records, started in contexts copied "
                    "inside its scope, still run in other threads after the scope "
                    "closed (one may wait for this thread). Their values go on arriving "
                    "in the capture" + (
                        ", and its index on disk is written again when the last ends"
                        if self._dir is not None and one_process else "")
                    + ". Join those threads before the scope closes for a capture that "
                    f"is whole when it does. Received: {len(self._running(True))} "
                    f"call(s) running after WAIT_S={WAIT_S:g} s", stacklevel=2)
            empty = whole and not any(len(c) for c in self.calls)  # (no call: warned)
            # (Calls that all raised, their errors caught inside the scope, may have
            # failed before reaching what it selects: no error of selection.)
            nothing = empty and any(not c.failed for c in self.calls)  # (and a call ran)
            with self._lock:  # (the late calls' `_call_finished` waits for this)
                try:
                    if (self._dir is not None and (exc_type is not None or empty)
                            and whole and one_process
                            and not any(c._files for c in self.calls)):
                        self._leave_directory()  # as found: the same `to=` works next time
                    else:
                        self._write_index_or_say(exc)
                finally:  # (also where the index could not be written)
                    # A call still running writes it again when it ends, and lets the
                    # directory go then.
                    late = self._late = (self._dir is not None and one_process
                                         and bool(self._running(False)))
        finally:
            if self._claim is not None and not late:
                _claimed.release(self._claim)
        if exc_type is None and not (self.reached or self.dropped):
            warnings.warn(_scope.NO_CALL.format(what="cs.capture", model=self.model.name,
                                                effect="it is empty"), stacklevel=2)
        if exc_type is None and nothing:
            raise ValueError(self._nothing_matched())
        if exc_type is None and whole and any(not c.failed for c in self.calls):
            self._check_each_glob_matched()

    def _leave_directory(self) -> None:
        """A scope that raised, or selected nothing, before writing any file leaves
        its directory as it found it (empty, or not there), not as a capture."""
        empty_directory(self._dir)
        if self._made:
            os.rmdir(self._dir)

    def _write_index_or_say(self, exc) -> None:
        """Writes the index at the scope's end. Where it cannot (the disk the
        writer filled), the error says what is still readable, and how."""
        try:
            self._write_index(complete=exc is None)
        except OSError as error:
            keys = sorted({key for call in self.calls for key in call.files()})
            raise WriteError(
                f"cs.capture(to=...) could not write its index (`index.json`): {error}"
                f"{f' (after the {type(exc).__name__} above)' if exc is not None else ''}. "
                f"The rows on disk of {keys} are read through this scope's capture, in "
                "this process only: `cs.load_capture` needs the index. Copy what you need "
                "out (`np.save`), free space on the disk, and run the call again. "
                f"Received: to={self._dir!r}") from error

    def _write_index(self, complete: bool = True) -> None:
        if self._dir is None:
            return
        # (`failed`, `running`: a reader in another process learns that a call's
        # rows stop short, as the writer's `Call.failed` and warning said.)
        index = {"owner": self._id, "calls": [{"method": c.method, "nested": c.nested,
                            "dir": os.path.basename(c._dir), "files": c.files(),
                            "failed": c.failed, "running": c._running,
                            "steps": c._run_steps()}
                           for c in self.calls]}
        me, processes = _backend.process_index()
        if processes == 1:
            _write_json(os.path.join(self._dir, "index.json"), index)
            return
        # Several JAX processes: each writes its part; when every process got
        # here, the first merges them into the one index and the others wait.
        _write_json(os.path.join(self._dir, f"index.p{me}.json"), index)
        if complete:
            _backend.barrier(f"callscope-capture-parts:{self._dir}")
            if me == 0:
                _write_json(os.path.join(self._dir, "index.json"), _merged_index(self._dir))
                for k in range(processes):
                    os.remove(os.path.join(self._dir, f"index.p{k}.json"))
            _backend.barrier(f"callscope-capture-index:{self._dir}")

    def _check_each_glob_matched(self) -> None:
        """A glob of a list that matches no point of the model is an error (the
        points its own calls ran, those of its layers, run or not, and those
        recorded), and so is one whose points all lack the kinds asked for."""
        model = self.model
        if not model._cs.seen:
            # Run only inside other models, it noted no points of its own (they are
            # noted on the model that runs, named from it): nothing to tell a glob's
            # typo from a sown value or a loop's point that it did not record.
            return
        keys = [k.partition(":")[0] for call in self.calls for k in call._names()]
        recorded = {k.rpartition("@")[0] or k for k in keys}
        select = self.spec.select if isinstance(self.spec.select, tuple) else ()
        points = [*model._cs.seen, *model._cs.loops, *recorded]
        # Naming every tracked layer walks the whole model: only where a glob
        # matched no point that ran, or names one that no call in this scope ran.
        if unmatched_globs(self.spec.select, points, "", "", "") or any(
                not set("*?[") & set(w) and not any(p == w or p.startswith(w + "/")
                                                    for p in recorded) for w in select):
            points += [*tree_points(model), *loop_points(model)]
        message = unmatched_globs(self.spec.select, list(dict.fromkeys(points)),
                                  "cs.capture", f"of `{model.name}`",
                                  "the other globs' values were captured")
        if message:
            raise ValueError(message)
        for glob in select:
            matched = [p for p in model._cs.seen if fnmatch.fnmatchcase(p, glob)]
            if matched and all(set(self.spec.kinds).isdisjoint(_SORTS[model._cs.seen[p]][1])
                               for p in matched):
                raise ValueError(_no_kind(
                    matched, model._cs.seen, self.spec.select, self.spec.kinds,
                    f"cs.capture: the glob {glob!r} of `select` selected nothing "
                    "(the other globs' values were captured)"))
        # (A layer whose output is a tuple or dict records its elements, `point/i`.)
        if unreached := [w for w in select if w in points and not any(
                p == w or p.startswith(w + "/") for p in recorded)]:
            # (As a single such point's "selected nothing": left out, it was lost.)
            raise ValueError(
                f"cs.capture: {unreached} of the globs in `select` are points of the "
                f"model's layers that no call in this scope ran{_SKIPPED}; the other "
                f"globs' values were captured. Received: select={list(select)!r}")

    def _nothing_matched(self) -> str:
        points = self.model._cs_known_points()
        wanted = self.spec.select
        if callable(wanted):
            hint = "the `select` callable returned False for every point"
            near = points[:8]
        elif wanted is None:
            hint = "no layer called `cs.sow` during the run"
            if loops := {p: e for p, e in self.model._cs.loops.items() if e}:
                hint = ("no layer called `cs.sow` outside a loop body during the run: "
                        f"points inside one ({list(loops)[:4]}) are left out, since a "
                        "value made there cannot leave it. Capture "
                        f"{sorted(set(loops.values()))[:4]} instead, whose output holds "
                        "every step")
            near = points[:8]
        elif matched := [p for p in points if p in self.model._cs.seen  # ran
                         and self.spec.selects(p, None, False)]:
            seen, asked = self.model._cs.seen, set(self.spec.kinds) - {"grad"}
            if not (had := [p for p in matched if asked & set(_SORTS[seen[p]][1])]):
                return _no_kind(matched, seen, wanted, self.spec.kinds)
            # (`seen` is every call's, since the model was made: an earlier one ran them)
            hint = (f"{had[:8]} matched (points that earlier calls ran), but no call in this "
                    f"scope ran them{_SKIPPED}")
            near = had[:8]
        else:
            hint = f"no point matched {list(wanted)}"
            unreached = [w for w in wanted if w in points and w not in self.model._cs.seen]
            if unreached:  # named in the model's layers, but no call ran them
                hint += (f" that a call reached: {unreached} are points of the model's "
                         f"layers that no call in this scope ran{_SKIPPED}")
            if calls := single_calls_hint(wanted, points):
                hint += "." + calls.removesuffix(".")
            near = nearest(wanted, points)
        return (
            f"cs.capture selected nothing: {hint}. Nearest points: {near}. Use "
            "`cs.points(model, x)` to list every point. Received: "
            f"select={wanted!r}"
        )


_SKIPPED = (" (a layer its `call` skipped, such as one in a branch not taken: torch runs "
            "only the branch of `keras.ops.cond` that its condition picks; Keras's "
            "`MultiHeadAttention`, where it takes its fused attention, skips its `softmax`)")


# What each sort of point is (`_capturing._sorts`), and the kinds it has (every
# sort has `grad`).
_SORTS = {
    "sown": ("a sown value", ("output", "grad")),
    "element": ("an element of a layer's output", ("output", "grad")),
    "layer": ("a layer's call", ("output", "input", "grad")),
}


def _no_kind(matched: list[str], seen: Mapping[str, str], wanted, kinds,
             lead: str = "cs.capture selected nothing") -> str:
    """The error for points that matched but have none of the kinds asked for."""
    groups: dict[str, list[str]] = {}
    for point in matched:
        groups.setdefault(seen[point], []).append(point)
    parts = []
    for sort, points in groups.items():
        what, kinds_of = _SORTS[sort]
        has = " and ".join(f"`{k}`" for k in kinds_of if k != "grad")
        has = has if " and " in has else f"only {has}"
        one = len(points) == 1
        more = "" if len(points) <= 8 else f" (and {len(points) - 8} more)"
        parts.append(f"{', '.join(f'`{p}`' for p in points[:8])}{more} "
                     f"{'is' if one else 'are'} {what}, which {'has' if one else 'have'} "
                     f"{has} (and `grad`)")
    return (
        f"{lead}: {matched[:8]} matched, but "
        f"{'it has no kind' if len(matched) == 1 else 'none of them has a kind'} in "
        f"kinds={kinds!r}: {'; '.join(parts)}. `input` is what a layer's call "
        "receives; `grad` (d loss / d point, in fit, evaluate and the *_on_batch "
        "methods) is taken only where the value is floating point. Ask for kinds "
        "the points have, or select points that have the kinds asked for. "
        f"Received: select={wanted!r}, kinds={kinds!r}"
    )


def _holds_the_working_directory(path: str) -> bool:
    try:
        here, there = os.path.realpath(os.getcwd()), os.path.realpath(path)
        return os.path.commonpath([here, there]) == there
    except (OSError, ValueError):  # no working directory (deleted); another drive
        return False


def empty_directory(path: str) -> None:
    """Deletes what `path` holds, keeping the directory itself (its mode, a link
    to it, `.`, a mount point)."""
    for name in os.listdir(path):
        item = os.path.join(path, name)
        if os.path.isdir(item) and not os.path.islink(item):
            shutil.rmtree(item)
        else:
            os.remove(item)


def _write_json(path: str, value) -> None:
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(value, f, indent=1)
    except BaseException:  # (a full disk: no half file left behind)
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        raise
    os.replace(path + ".tmp", path)  # a reader never sees half an index


def _merged_index(directory: str) -> dict:
    """The processes' parts of a capture's index (`index.p<k>.json`) as one: each
    key's file parts side by side."""
    names = sorted(n for n in os.listdir(directory)
                   if n.startswith("index.p") and n.endswith(".json"))
    parts = []
    for name in names:
        with open(os.path.join(directory, name)) as f:
            parts.append(json.load(f))
    merged = parts[0]
    for other in parts[1:]:
        for call, theirs in zip(merged["calls"], other["calls"]):
            for flag in ("failed", "running"):  # (one process's says it of the call)
                call[flag] = call.get(flag, False) or theirs.get(flag, False)
            for key, entry in theirs["files"].items():
                mine = call["files"].setdefault(key, {**entry, "parts": []})
                mine["parts"] = mine.get("parts", []) + entry.get("parts", [])
    return merged


def load_capture(path: str | os.PathLike) -> Capture:
    """Reads back a capture streamed with `cs.capture(..., to=path)`, in any process.

    It gives what the capture gave when it closed: the same keys, calls and
    values, and each call's `failed`. A directory written by several JAX processes
    (each streams the shards it holds) reads back as the whole arrays, in global
    batch order. An index written while calls of other threads still ran (the
    capture's exit warned) warns here too: their rows stop where they were, until
    the last call ends and writes it again.

    Example:

    >>> import keras, numpy as np, tempfile, callscope as cs
    >>> model = cs.Sequential([keras.Input((2,)), keras.layers.Dense(3, name="hidden")],
    ...                       name="mlp")
    >>> path = tempfile.mkdtemp()
    >>> with cs.capture(model, "*/hidden", to=path) as cap:
    ...     _ = model.predict(np.ones((4, 2)), batch_size=2, verbose=0)
    >>> cs.load_capture(path)["mlp/hidden:output"].shape
    (4, 3)
    """
    path = os.fspath(path)
    index_file = os.path.join(path, "index.json")
    if os.path.exists(index_file):
        with open(index_file) as f:
            index = json.load(f)
    elif os.path.isdir(path) and any(n.startswith("index.p") and n.endswith(".json")
                                     for n in os.listdir(path)):
        index = _merged_index(path)  # a run that failed before its index was merged
    else:
        raise FileNotFoundError(
            f"`{path}` holds no capture index (`index.json`): it is written when a "
            "`cs.capture(..., to=path)` scope closes. Pass the directory given as "
            f"`to=`, after the scope has closed. Received: path={path!r}"
        )
    spec = Spec(None, ("output",), None, 32)
    capture = Capture(None, spec, path)
    for item in index["calls"]:
        call = _sinks.Call(spec, item["method"], item["nested"],
                           os.path.join(path, item["dir"]), index.get("owner"))
        call._files, call.failed = item["files"], item.get("failed", False)
        call._ended_steps = item.get("steps", 0)  # (an older index: unknown, 0)
        capture.calls.append(call)
    if running := [i for i, item in enumerate(index["calls"]) if item.get("running")]:
        warnings.warn(
            f"cs.load_capture: the index of `{path}` was written while calls it records "
            "still ran in other threads (the capture's scope closed first, and warned): "
            "their rows stop where they were then. The index is written again when the "
            "last of them ends: load it again after that, or join those threads before "
            f"the scope closes. Received: calls {running} running", stacklevel=2)
    return capture


def _given_ranges(hist_range) -> tuple:
    """`hist_range=` as `((kind or "*", lo, hi), ...)`, checked."""
    if hist_range is None:
        return ()
    items = hist_range.items() if isinstance(hist_range, Mapping) else [("*", hist_range)]
    out = []
    for kind, pair in items:
        try:
            lo, hi = (float(v) for v in pair)
        except (TypeError, ValueError):
            lo = hi = float("nan")
        if kind not in (*KINDS, "*") or not (np.isfinite(lo) and np.isfinite(hi) and hi > lo):
            raise ValueError(
                "`hist_range` takes (lo, hi) with finite lo < hi, or a dict "
                f"{{kind: (lo, hi)}} with kinds from {', '.join(KINDS)}. "
                f"Received: hist_range={hist_range!r}"
            )
        out.append((kind, lo, hi))
    return tuple(out)


def capture(
    model,
    select: str | list[str] | tuple[str, ...] | Callable | None = None,
    *,
    kinds: str | tuple[str, ...] = ("output",),
    reduce: str | tuple[str, ...] | None = None,
    bins: int = 32,
    hist_range: tuple[float, float] | Mapping[str, tuple[float, float]] | None = None,
    to: str | os.PathLike | None = None,
    overwrite: bool = False,
    log: bool = False,
) -> Capture:
    """A scope that captures intermediates of every call of `model` inside it.

    Args:
        model: a `cs.Model`, `cs.Sequential` or `cs.enable`d model.
        select: a glob, a list of globs, or a callable `(point, layer) -> bool`.
            By default every sown point.
        kinds: `"output"` and/or `"input"` (layers only).
        reduce: a statistic or a tuple of them (`mean`, `std`, `min`, `max`,
            `absmax`, `rms`, `frac_zero`, `hist`), computed on the device.
            predict and evaluate give one exact aggregate; fit gives one row per step.
        bins: histogram bins for `hist`.
        hist_range: `(lo, hi)` for `hist`, or `{kind: (lo, hi)}` per kind
            (`output`, `input`, `grad`). Finite values outside the range count in
            the edge bins. Where no range is given, each key's range is the
            min and max of its finite values in the first batch of the first
            call of each kind in the scope (in `fit`, the first training batch,
            in training mode, as the step sees it; gradients' from the
            gradients themselves), so all calls of one kind share bin edges.
        to: a directory: full tensors stream there in shards, and are read back
            memory-mapped. It must be new or empty, unless `overwrite=True`.
        overwrite: with `to=`, delete whatever the directory holds first.
        log: with `reduce=`, each `fit` in the scope adds one exact per-epoch
            aggregate of every statistic to the epoch logs (History, CSVLogger,
            TensorBoard record them; the progress bar does not show them).

    Example:

    >>> import keras, numpy as np, callscope as cs
    >>> model = cs.Sequential([keras.Input((2,)), keras.layers.Dense(3, name="hidden")],
    ...                       name="mlp")
    >>> with cs.capture(model, "*/hidden", reduce=("mean", "max")) as cap:
    ...     _ = model.predict(np.ones((4, 2)), verbose=0)
    >>> sorted(cap)
    ['mlp/hidden:output/max', 'mlp/hidden:output/mean']
    """
    from callscope._mixin import ContextMixin

    if not isinstance(model, ContextMixin):
        raise TypeError(
            "`cs.capture` needs a callscope model: build it with `cs.Model`/"
            "`cs.Sequential`, or call `model = cs.enable(model)` first. "
            f"Received: model={type(model).__name__}"
        )
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ValueError(
            f"`kinds` takes one or more of {', '.join(KINDS)}. Received: kinds={kinds!r}"
        )
    select = normalize_select(select)
    stats = _reduce.check_stats(reduce)
    given = _given_ranges(hist_range)
    if stats and to is not None:
        raise ValueError("`to=` streams full tensors; it cannot be combined with `reduce=`.")
    if log and not stats:
        raise ValueError("`log=True` puts statistics into the epoch logs: give `reduce=` too. "
                         f"Received: log={log}, reduce={reduce!r}")
    found = Ranges() if stats and "hist" in stats else None
    spec = Spec(select, kinds, stats, int(bins), given, found, owner=id(model))
    return Capture(model, spec, to, log=log, overwrite=overwrite)
