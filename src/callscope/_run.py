"""One run per call: everything a call of a model needs, made once, held by the caller.

Each entry point (`fit`, `evaluate`, `predict`, the `*_on_batch` methods, a direct
`model(x)`, and `fit`'s inner validation) makes one `Run`: its method, its key
entry (compiled functions and step closures), its dynamic values, its patches and
the sinks of the captures open in the caller's scope. The run is held in a
`ContextVar` (`_scope.running`), so the host side of the call (the wrapper around
the made `*_function`) finds it in the caller's thread, and a call nested in it
(validation, a callback's `predict`) is a run of its own. Nothing about a call is
stored on the model.

`Gate` serialises calls on one model where the backend needs it (JAX: stock Keras
purges a model's variables while its loop runs, so two concurrent calls would read
None). It is never held while callbacks run: `GateReleasing` callbacks, first and
last in the list, open it around every callback hook, after syncing the JAX state
back into the variables, so a callback may wait on another thread's call into the
same model. A `CallbackList` the user built is never changed: a `GatedCallbackList`
made for the call opens the gates around its hooks instead. A callback that touches
the weights (`self.model`) takes the gate back first (`Engine.jax_state_sync`), so it
never sees them purged by another call.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np

from callscope import _backend, _inputs, _keras_compat, _keys, _record, _scope



@dataclass(frozen=True, eq=False)
class Run:
    """One call of a model (see the module docstring). Immutable but for its sinks."""

    model: Any
    method: str
    entry: Any  # _keys.Entry, pinned while the run lasts
    dynamic: tuple = ()  # ((variable, numpy value), ...)
    calls: tuple = ()  # one _capture.Call per open capture: this run's sinks
    patches: tuple = ()
    nested: bool = False  # another run of the same model is in progress below it
    replicated: bool = False  # under a tf.distribute strategy with several replicas
    offset: Any = None  # RowOffset, for patches that take the batch
    ranges: tuple = ()  # specs whose histogram ranges the first step fixes
    host: Any = None  # _sinks.Landing: the calls' values on their way to the host
    scopes: tuple = ()  # the caller's scopes as the call began (`_scope.scopes_now`)
    # kind of step -> its dynamic inputs (`_inputs.py`), made at its first step
    inputs: dict = field(default_factory=dict)
    # kind of step -> the patched points its eager steps reached (torch, or
    # `run_eagerly`: their Python runs every step, so this run's own reach is
    # known; a compiled step's is its trace's, kept by the key)
    eager_hits: dict = field(default_factory=dict)
    # kind of step -> the numbers of the traces its patched compiled steps ran
    traces: dict = field(default_factory=dict)
    # the casts of patches that lost a value in a compiled step (`_record._unheld`)
    casts: StepNotes = field(default_factory=lambda: StepNotes(_lost_casts))

    @property
    def has_inputs(self) -> bool:
        return bool(self.ranges) or any(hasattr(fn, "values") for _, _, fn in self.patches)

    def inputs_for(self, kind: str) -> dict:
        """This run's inputs of `kind` steps (JAX: on the device), made once and
        checked against what the compiled step reads."""
        values = self.inputs.get(kind)
        if values is None:
            values = _inputs.of_run(self, kind)
            _inputs.check_used(self.entry, kind, values)
            if keras.backend.backend() == "jax":
                values = _inputs.placed(values)
            self.inputs[kind] = values
        return values

    def ran_trace(self, kind: str, number) -> None:
        """A patched compiled step of `kind` ran the trace `number` (an array)."""
        if kind not in self.traces:
            self.traces[kind] = StepNotes(_trace_numbers)
        self.traces[kind].add(number)

    def reached(self, kind: str, traced: dict) -> set:
        """The patched points that this run's steps of `kind` reached: its eager
        steps', and those of the traces its compiled steps ran (`traced`: the
        key's, by trace number; `_keys.UNTRACKED` counts for every run)."""
        found = set(self.eager_hits.get(kind, ())) | traced.get(_keys.UNTRACKED, set())
        for number in self.traces[kind].read() if kind in self.traces else ():
            found |= traced.get(number, set())
        return found

    def sink(self, kind: str, sown) -> None:
        """A step's captured values (`"index|key"` names) to the calls' sinks. A
        failure there is raised when the next step starts (`check`), else by `end`."""
        if self.host is not None:
            self.host.put(kind, sown)

    def check_before_step(self, model, kind: str, args: tuple) -> None:
        """Raises, before the step of `kind` that `args` start, what failed in a
        sink, or a scope opened while the call runs (the loop stops there).

        Not Keras's `stop_*` flags: they belong to the model, so another thread's
        loop on it would stop too. And not at the failing step's end: on JAX, the
        state that step returned would be lost (its input was donated). Before the
        next step it is that step's input, which becomes the loop's last state
        (`_keras_compat.keep_loop_state`: after validation, or a callback's
        predict, it is the only copy of the weights), and the failed call puts it
        back (`_keras_compat.settle_failed_call`)."""
        problem = self.host.failure if self.host is not None else None
        if problem is None:  # Ctrl-C in a step of a call this one is nested in
            problem = next((run.host.failure for run in _scope.runs_here()
                            if run.host is not None and run.host.failure is not None
                            and not isinstance(run.host.failure, Exception)), None)
        if problem is None and self.scopes:
            problem = self._opened_since(model)
        if problem is None:
            return
        if keras.backend.backend() == "jax":
            _keras_compat.keep_loop_state(model, kind, args[0])
        raise problem

    def _opened_since(self, model) -> Exception | None:
        """A scope the caller opened after the call began (a callback's, kept open
        across steps) that the call would otherwise ignore: its key, captures and
        patches were fixed when it began, and a compiled JAX or TF step runs no
        Python again (torch's eager step did see some of it, on one backend only).
        Compared by identity at every step: a scope closed before the next step
        (a callback's own `predict` inside it) leaves the same objects behind."""
        frame, captures, patches = now = _scope.scopes_now()
        if all(a is b for a, b in zip(now, self.scopes)):
            return None
        began, captured, patched = self.scopes
        readable = set(model._cs.names) | set(self.entry.reads)
        for name, value in frame.values.items():
            if value is not None and name in readable:
                _scope.read_from(frame, name)  # (compared: the call's own, or refused)
            if value is not None and name in readable and not _same_value(
                    model, name, began.values.get(name), value):
                return _scope.StrayValueError(_opened(
                    f"`cs.context({name}={value!r})`", self.method,
                    f"`{name}` stays {began.values.get(name)!r}",
                    f"pass the value to the call (`{self.method}(..., {name}=...)`)",
                    f"{name}={value!r}"))
        owns = model._cs_owns()
        for scope_of, opened, held, model_of, effect, received in (
                ("cs.capture", captures, captured, lambda c: c.model, "the capture stays empty",
                 lambda c: f"a capture of `{c.model.name}`"),
                ("cs.patch", patches, patched, lambda p: p[0], "its points stay unpatched",
                 lambda p: f"patches={sorted(p[1])}")):
            for scope in opened:
                if not any(scope is h for h in held) and owns(model_of(scope)):
                    return RuntimeError(_opened(
                        f"A `{scope_of}`", self.method, effect,
                        f"open it around the call (`with {scope_of}(...): "
                        f"model.{self.method}(...)`)", received(scope)))
        return None

    def end(self, error: BaseException | None = None) -> None:
        """The run ended (or raised `error`): the last values land, files close."""
        if self.host is not None:
            self.host.end(error)

    def noted_casts(self, flags: dict) -> None:
        """A patched compiled step's flags of narrowing casts (`_record._unheld`)."""
        self.casts.add(flags)

    def check_casts(self) -> None:
        """Raises where a patch gave a compiled step values that the point's dtype
        could not hold: read at the end (a read waits for its step)."""
        if lost := self.casts.read():
            raise ValueError(_record.unheld_message(*sorted(lost)[0].split("\t")))


class StepNotes:
    """What compiled steps returned for the run to read at its end (trace numbers,
    cast flags): kept as the steps' arrays, since reading one waits for its step,
    and folded into a set every 256 steps (the earlier steps are done by then)."""

    def __init__(self, found_in):
        self._found_in = found_in  # one step's array or dict -> set
        self._arrays: list = []
        self._found: set = set()

    def add(self, array) -> None:
        self._arrays.append(array)
        if len(self._arrays) > 256:
            self.read()

    def read(self) -> set:
        for array in self._arrays:
            self._found |= self._found_in(array)
        self._arrays.clear()
        return self._found


def _lost_casts(flags: dict) -> set[str]:
    """The casts whose flag one step raised (`Run.noted_casts`)."""
    return {name for name, flag in flags.items()
            if np.any(keras.ops.convert_to_numpy(_local(flag)))}


def _trace_numbers(array) -> set[int]:
    """The trace numbers that one step returned (one per element)."""
    return {int(n) for n in np.ravel(keras.ops.convert_to_numpy(_local(array)))}


def _local(array):
    """An array that spans JAX processes is read from a shard of this one's."""
    return array.addressable_shards[0].data if _backend.spans_processes(array) else array


def _opened(what: str, method: str, effect: str, fix: str, received: str) -> str:
    return (
        f"{what} was opened while `{method}` runs (in a callback), and is not that "
        f"call's: a call's context values, captures and patches are fixed when it "
        f"begins, so its steps would go on without the scope ({effect}). Fix: {fix}; or, "
        f"in the callback, make a call of its own inside the scope "
        f"(`model.predict(...)`), which sees it. Received: {received}")


def _same_value(model, name: str, before: Any, now: Any) -> bool:
    """Whether `now`, set again for `name`, is the value the call holds: a dynamic
    value as its variable holds it (0.1 as float32, `True` as the bool it is, by
    the conversion the call itself made), any other as its key tells values apart
    (`1` is not `1.0`; a tensor only as itself)."""
    if before is now:
        return True
    if before is None:
        return False
    if name in model._cs.dynamic:  # (the frame holds the call's converted array)
        try:
            now = model._cs_dynamic_array(name, now)
        except (TypeError, ValueError):  # a value the call could not hold
            return False
        return before.shape == now.shape and bool(np.array_equal(before, now))
    if _keys.is_tensor_like(before) or _keys.is_tensor_like(now):
        return False
    try:
        return _keys.freeze(before) == _keys.freeze(now)
    except Exception:  # noqa: BLE001 (a value whose `==` raises: not the same)
        return False


class RowOffset:
    """The rows a run's steps have seen so far: each step's `batch.start`.

    `target` is where the value goes: the hidden variable (TF, torch) or its
    position in the JAX state. `limit` is the rows of the shortest array patch,
    `arrays` the rows of each."""

    def __init__(self, target, arrays: tuple = ()):
        self.target, self.arrays, self.rows = target, arrays, 0
        self.limit = min(arrays) if arrays else None

    def advance(self, rows: int) -> None:
        # Checked when the call ends (`check_end`), never inside Keras's loop: an
        # exception there would lose the JAX loop's state. A step past the end
        # reads clamped rows, and the call raises.
        self.rows += rows

    def check_end(self) -> None:
        """An array patch gives one row per row of the call's data."""
        if self.limit is not None and self.rows > self.limit:
            raise ValueError(
                f"An array patch has {self.limit} rows, but this call's data runs to "
                f"row {self.rows}: a patch array gives one row per row of the data, "
                "in order. Pass an array with a row for every row of the data. "
                f"Received: {self.limit} rows"
            )
        longer = [n for n in self.arrays if n != self.rows]
        if longer:
            raise ValueError(
                f"An array patch has {longer[0]} rows, but this call's data had "
                f"{self.rows}: a patch array gives one row per row of the data, in "
                "order, so a longer one is the wrong array. Pass one with a row for "
                f"every row of the data. Received: {longer[0]} rows"
            )


class Gate:
    """A re-entrant lock that its owner opens fully around callbacks: a turn.

    `open` (before a callback) releases every level this thread holds and stashes
    the depth; `close` (after it) takes the gate back at that depth. When the gate
    passes from a thread in the middle of its call to another, `on_switch(prev,
    new)` moves the state they share out of the way (the JAX loop's weights, the
    model's metrics) and back when `prev` resumes. What a call stashed is dropped
    when it ends, so a callback that raised cannot leave a stale depth behind.
    """

    def __init__(self, on_switch=None):
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._depth = 0
        self._opened: dict[int, list[int]] = {}  # thread -> stashed depths
        self._on_switch = on_switch
        self._last: int | None = None  # the thread that held it last

    def _taken(self, me: int) -> None:
        previous, self._last = self._last, me
        if self._on_switch is not None and previous not in (None, me):
            self._on_switch(previous if previous in self._opened else None, me)

    def enter(self) -> int:
        """Takes one level; returns a token for `exit`."""
        me = threading.get_ident()
        token = len(self._opened.get(me, ()))
        if self._owner == me:
            self._depth += 1
            return token
        self._lock.acquire()
        self._owner, self._depth = me, 1
        try:
            self._taken(me)
        except BaseException:
            # Never left held by a call that did not start (it would hang the
            # paused call, which waits in `close`).
            self._owner, self._depth = None, 0
            self._lock.release()
            raise
        return token

    def exit(self, token: int) -> None:
        me = threading.get_ident()
        stash = self._opened.get(me)
        if stash is not None:
            del stash[token:]
            if not stash:
                del self._opened[me]
        if self._owner != me:
            return
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
            self._lock.release()

    def open(self) -> None:
        """Releases every level held by this thread, and stashes how many."""
        me = threading.get_ident()
        if self._owner != me:
            return
        self._opened.setdefault(me, []).append(self._depth)
        self._depth, self._owner = 0, None
        self._lock.release()

    def close(self) -> None:
        """Takes back what this thread's last `open` released, if it is open."""
        me = threading.get_ident()
        stash = self._opened.get(me)
        if not stash or self._owner == me:
            return
        self._lock.acquire()
        # The stash is dropped only now: until this thread holds the gate again,
        # others must see its call as paused (its state parked, not finished).
        depth = stash.pop()
        if not stash:
            del self._opened[me]
        self._owner, self._depth = me, depth
        self._taken(me)

    def is_open_for(self) -> bool:
        """True in a thread whose call opened the gate (inside its callbacks)."""
        me = threading.get_ident()
        return bool(self._opened.get(me)) and self._owner != me

    @contextlib.contextmanager
    def held(self):
        token = self.enter()
        try:
            yield
        finally:
            self.exit(token)


class SharedState:
    """`on_switch` for a model's gate: parks the state of a call in the middle of
    its loop while another call runs, and puts it back when it resumes.

    - JAX: the loop keeps the weights out of the variables (`sync`, first, puts
      the paused loop's state back into them; its loop reads them again after).
    - Metrics, fit's cached validation iterator and `model.history` (what `fit`
      returns): Keras keeps them on the model, so each paused call's are parked
      and restored around the others'.
    """

    def __init__(self, model, sync: bool, metrics: bool):
        self._model, self._sync, self._metrics = model, sync, metrics
        self._parked: dict[int, list] = {}

    def __call__(self, previous: int | None, current: int) -> None:
        model = self._model
        if previous is not None and self._sync:
            _keras_compat.sync_jax_state(model)
        if not self._metrics:
            return
        if previous is not None:
            self._parked[previous] = (
                {id(v): (v, _backend.host_values(v)) for v in model.metrics_variables},
                _keras_compat.eval_iterator(model), getattr(model, "history", None))
        values, iterator, history = self._parked.pop(current, (None, None, None))
        _keras_compat.set_eval_iterator(model, iterator)
        if history is not None:  # fit returns `model.history`, which each fit's History
            model.history = history  # callback sets: the resuming call's own, back
        if values is not None:
            _put_back_metrics(model, values)
            _keras_compat.mark_jax_state_stale(model)

    def forget(self, thread: int) -> None:
        """Drops what a call that ended (or raised) had parked."""
        self._parked.pop(thread, None)


def _put_back_metrics(model, parked: dict) -> None:
    """Gives the metrics a resuming call had when it paused their values back.
    A metric made since, by another call's first step (TF builds the compiled
    metrics there), starts from its reset state: it held the other call's totals,
    which the resuming call's `fit` added to, silently, when values were put
    back only where the number of variables had not changed."""
    for metric in model.metrics:
        kept = [parked.get(id(v), (None,))[0] is v for v in metric.variables]
        if not all(kept):
            metric.reset_state()
        for variable, was_kept in zip(metric.variables, kept):
            if was_kept:
                _backend.assign_values(variable, parked[id(variable)][1])


def _open(gates: tuple) -> None:
    for gate in reversed(gates):
        gate.open()


def _close(gates: tuple) -> None:
    for gate in gates:
        gate.close()


@contextlib.contextmanager
def _gates_open(gates: tuple):
    """The gates open for a callback's hook, closed again even if it raises."""
    _open(gates)
    try:
        yield
    finally:
        _close(gates)


class GateReleasing(keras.callbacks.Callback):
    """Opens (first in the list) or closes (last) the gates around callbacks.

    It takes the epoch-level hooks, and only those batch-level hooks that one of
    the user's callbacks overrides: a batch hook of its own would stop Keras from
    dispatching batch callbacks asynchronously, and cost a sync per step."""

    def __init__(self, gates: tuple, opens: bool, hooks: tuple):
        super().__init__()
        self._gates, self._opens = gates, opens
        for hook in hooks:
            setattr(self, hook, self._toggle)

    def _toggle(self, *args, **kwargs):
        (_open if self._opens else _close)(self._gates)


_EPOCH_HOOKS = tuple(f"on_{stage}_{when}" for stage in ("train", "test", "predict", "epoch")
                     for when in ("begin", "end"))
_BATCH_HOOKS = {
    f"on_{stage}_batch_{when}": (f"on_{stage}_batch_{when}",) + (
        (f"on_batch_{when}",) if stage == "train" else ())
    for stage in ("train", "test", "predict") for when in ("begin", "end")
}


def _hooks_for(callbacks) -> tuple:
    """The epoch hooks, and each batch hook some callback overrides."""
    def overrides(callback, name):
        # An instance's own hook counts too: LambdaCallback sets the ones it is given.
        return name in getattr(callback, "__dict__", {}) or (
            getattr(type(callback), name, None) is not getattr(keras.callbacks.Callback, name))

    batch = [hook for hook, names in _BATCH_HOOKS.items()
             if any(overrides(c, n) for c in callbacks for n in names)]
    return (*_EPOCH_HOOKS, *batch)


class GatedCallbackList(keras.callbacks.CallbackList):
    """A `CallbackList` the user built, seen by Keras's loop through this, and left
    as it was: never a callback added to it, nor its model or params set (stock
    Keras sets neither on a list it is given).

    Each hook goes to the user's list, with the gates open around it for the hooks
    `GateReleasing` would take (the epoch hooks, and the batch hooks one of its
    callbacks overrides when the call starts). `first` (callscope's own
    `EpochStatistics`) take `on_epoch_begin`/`on_epoch_end` just before the user's
    list, and add to a copy of the epoch logs that the list then receives. Any
    other attribute is the user's list's."""

    def __init__(self, user, gates: tuple, model, first: tuple = ()):
        keras.callbacks.Callback.__init__(self)  # no callbacks of its own
        self.user, self._gates, self._first = user, gates, tuple(first)
        self._bracketed = frozenset(_hooks_for(list(user.callbacks)))
        for callback in self._first:
            callback.set_model(model)

    def __getattr__(self, name):
        if name.startswith("__") or name == "user":
            raise AttributeError(name)
        return getattr(self.user, name)

    def _hook(self, name: str, *args, **kwargs) -> None:
        if name not in self._bracketed:
            return getattr(self.user, name)(*args, **kwargs)
        with _gates_open(self._gates):
            getattr(self.user, name)(*args, **kwargs)

    def on_epoch_begin(self, epoch, logs=None):
        with _gates_open(self._gates):
            for callback in self._first:
                callback.on_epoch_begin(epoch, logs)
            self.user.on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        with _gates_open(self._gates):
            if self._first and logs is not None:
                logs = dict(logs)  # Keras's own epoch logs stay as they were
            for callback in self._first:
                callback.on_epoch_end(epoch, logs)
            self.user.on_epoch_end(epoch, logs)

    def set_model(self, model):  # Keras sets nothing on a list it is given
        keras.callbacks.Callback.set_model(self, model)

    def set_params(self, params):
        keras.callbacks.Callback.set_params(self, params)


def _delegating(name: str):
    def hook(self, *args, **kwargs):
        return self._hook(name, *args, **kwargs)

    hook.__name__ = hook.__qualname__ = name
    return hook


for _name in (*_EPOCH_HOOKS, *_BATCH_HOOKS, "on_batch_begin", "on_batch_end"):
    if _name not in ("on_epoch_begin", "on_epoch_end"):
        setattr(GatedCallbackList, _name, _delegating(_name))


def with_gate_callbacks(callbacks, gates: tuple, model, first: tuple = ()) -> list | Any:
    """The user's callbacks (after callscope's own, `first`) between an opening and
    a closing `GateReleasing`.

    A `CallbackList` is fit's own, passed to its validation (already bracketed:
    returned as it is), or one the user built: never changed, but wrapped in a
    `GatedCallbackList`, made again for each call (a list may be reused across
    calls and models, and gain callbacks in between)."""
    if isinstance(callbacks, GatedCallbackList) or (
            isinstance(callbacks, keras.callbacks.CallbackList)
            and any(isinstance(c, GateReleasing) for c in callbacks.callbacks)):
        return callbacks
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return GatedCallbackList(callbacks, gates, model, first)
    listed = [*first, *(callbacks or [])]
    hooks = _hooks_for(listed)
    return [GateReleasing(gates, True, hooks), *listed, GateReleasing(gates, False, hooks)]
