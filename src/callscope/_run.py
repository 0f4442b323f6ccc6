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
same model.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import keras

from callscope import _keras_compat


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
    gated: list = field(default_factory=list)  # [depth] while this run holds the gate

    def sink(self, kind: str, sown) -> None:
        for name, value in sown.items():
            index, key = name.split("|", 1)
            self.calls[int(index)].add(kind, key, value)


class Gate:
    """A re-entrant lock that its owner can open fully around callbacks."""

    def __init__(self):
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._depth = 0

    def enter(self) -> None:
        me = threading.get_ident()
        if self._owner == me:
            self._depth += 1
            return
        self._lock.acquire()
        self._owner, self._depth = me, 1

    def exit(self) -> None:
        if self._owner != threading.get_ident():
            return
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
            self._lock.release()

    def open(self) -> int:
        """Releases every level held by this thread; returns how many."""
        if self._owner != threading.get_ident():
            return 0
        depth, self._depth, self._owner = self._depth, 0, None
        self._lock.release()
        return depth

    def close(self, depth: int) -> None:
        if not depth:
            return
        self._lock.acquire()
        self._owner, self._depth = threading.get_ident(), depth


class GateReleasing(keras.callbacks.Callback):
    """Opens (first in the list) or closes (last) the model's gate around callbacks."""

    def __init__(self, gate: Gate, model, opens: bool, held: list):
        super().__init__()
        self._gate, self._owner, self._opens, self._held = gate, model, opens, held
        for hook in _HOOKS:
            setattr(self, hook, self._toggle)

    def _toggle(self, *args, **kwargs):
        if self._opens:
            if self._gate._owner == threading.get_ident():
                _keras_compat.sync_jax_state(self._owner)
                self._held.append(self._gate.open())
        elif self._held:
            self._gate.close(self._held.pop())


_HOOKS = tuple(
    f"on_{stage}_{when}"
    for stage in ("train", "test", "predict", "epoch",
                  "train_batch", "test_batch", "predict_batch")
    for when in ("begin", "end")
)


def with_gate_callbacks(callbacks, gate: Gate, model) -> list | Any:
    """The user's callbacks between an opening and a closing `GateReleasing`."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks  # fit's own list, passed to its validation: already bracketed
    held: list = []
    return [GateReleasing(gate, model, True, held), *(callbacks or []),
            GateReleasing(gate, model, False, held)]
