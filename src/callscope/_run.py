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
same model. A callback that touches the weights (`self.model`) takes the gate back
first (`Engine.jax_state_sync`), so it never sees them purged by another call.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any

import keras



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

    def sink(self, kind: str, sown) -> None:
        for name, value in sown.items():
            index, key = name.split("|", 1)
            self.calls[int(index)].add(kind, key, value)


class Gate:
    """A re-entrant lock that its owner can open fully around callbacks.

    `open` (before a callback) releases every level this thread holds and stashes
    the depth; `close` (after it, or as soon as the callback touches the model's
    weights) takes the gate back at that depth. What a run stashed is dropped when
    the run ends, so a callback that raised cannot leave a stale depth behind.
    """

    def __init__(self, on_handover=None):
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._depth = 0
        self._opened: dict[int, list[int]] = {}  # thread -> stashed depths
        self._on_handover = on_handover  # run by the next taker after an `open`
        self._open_mid_call = False
        self._opened_by: int | None = None

    def enter(self) -> int:
        """Takes one level; returns a token for `exit`."""
        me = threading.get_ident()
        token = len(self._opened.get(me, ()))
        if self._owner == me:
            self._depth += 1
            return token
        self._lock.acquire()
        self._owner, self._depth = me, 1
        self._handover()
        return token

    def _handover(self) -> None:
        # Opened around a callback, the gate leaves the holder's weights where its
        # loop keeps them (JAX: out of the variables). Syncing them back every
        # callback would cost a copy per step, so the next other taker does it.
        if self._open_mid_call:
            self._open_mid_call = False
            if self._on_handover is not None:
                self._on_handover()

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
        self._open_mid_call, self._opened_by = True, me
        self._lock.release()

    def close(self) -> None:
        """Takes back what this thread's last `open` released, if it is open."""
        me = threading.get_ident()
        stash = self._opened.get(me)
        if not stash or self._owner == me:
            return
        depth = stash.pop()
        if not stash:
            del self._opened[me]
        self._lock.acquire()
        self._owner, self._depth = me, depth
        if self._opened_by == me:
            self._open_mid_call = False  # nobody opened it since: our loop state holds
        else:
            self._handover()  # another call opened it mid-loop: take its weights back

    @contextlib.contextmanager
    def held(self):
        token = self.enter()
        try:
            yield
        finally:
            self.exit(token)


class GateReleasing(keras.callbacks.Callback):
    """Opens (first in the list) or closes (last) the gate around callbacks."""

    def __init__(self, gate: Gate, model, opens: bool):
        super().__init__()
        self._gate, self._owner, self._opens = gate, model, opens
        for hook in _HOOKS:
            setattr(self, hook, self._toggle)

    def _toggle(self, *args, **kwargs):
        if self._opens:
            self._gate.open()
        else:
            self._gate.close()


_HOOKS = tuple(
    f"on_{stage}_{when}"
    for stage in ("train", "test", "predict", "epoch",
                  "train_batch", "test_batch", "predict_batch")
    for when in ("begin", "end")
)


def with_gate_callbacks(callbacks, gate: Gate, model) -> list | Any:
    """The user's callbacks between an opening and a closing `GateReleasing`.

    A `CallbackList` is fit's own, passed to its validation (already bracketed),
    or one the user built: its callbacks are bracketed in place."""
    pair = (GateReleasing(gate, model, True), GateReleasing(gate, model, False))
    if isinstance(callbacks, keras.callbacks.CallbackList):
        if not any(isinstance(c, GateReleasing) for c in callbacks.callbacks):
            callbacks.callbacks[:0] = [pair[0]]
            callbacks.callbacks.append(pair[1])
            for callback in pair:
                callback.set_model(model)
        return callbacks
    return [pair[0], *(callbacks or []), pair[1]]
