"""Keys: the frozen form of a call's static values, and the per-key function table.

A static context value selects a compiled function, so the key must tell apart
what Python's `==` merges: `True == 1 == 1.0` would share one dict key, and one
trace. Each value is frozen with its type (`("bool", True)`, `("int", 1)`), tuples
recursively. NaN never equals itself and would miss the cache on every call, so
it is refused.

`KeyTable` is a bounded LRU of `Entry`s (the compiled functions and step closures
of one key). An entry in use by a running call is pinned: it is never evicted
under that call, whatever the bound.
"""

from __future__ import annotations

import collections
import math
import os
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

STATIC_TYPES = (bool, int, float, str, type(None))
DYNAMIC = ("dynamic",)  # stands for a dynamic value in a key
KINDS = ("train", "test", "predict")


def is_tensor_like(value: Any) -> bool:
    return (
        isinstance(value, (np.ndarray, np.generic, keras.Variable))
        or keras.ops.is_tensor(value)
        or type(value).__module__.split(".")[0] in ("jax", "jaxlib", "torch", "tensorflow")
    )


def check_static(name: str, value: Any) -> None:
    """Raises a clear error unless `value` can be part of a compiled-function key."""
    # The plain types first: a compiled torch step checks the values again, and
    # dynamo cannot trace `is_tensor_like`'s `str.split` of a module name.
    if type(value) in STATIC_TYPES and not (isinstance(value, float) and math.isnan(value)):
        return
    if is_tensor_like(value):
        raise TypeError(
            f"Context argument `{name}` is static: each distinct value gets its own "
            "compiled function, so it must be a bool, int, float, str, None or a "
            "tuple of these, not a tensor or array (a tensor would retrace on every "
            f"call). To pass numbers or arrays that change without retracing, "
            f"register it with `model.register_context_args({name!r}, dynamic=True)`"
            + (f", or pass it as a Python value: `{name}=value.item()`"
               if isinstance(value, np.generic) else "")
            + f". Received: {name}={_tensor_described(value)}"
        )
    if isinstance(value, tuple):
        for item in value:
            check_static(name, item)
        return
    if isinstance(value, float) and math.isnan(value):
        raise ValueError(
            f"Context argument `{name}` is static, and NaN cannot select a compiled "
            "function (NaN != NaN, so it would retrace on every call). Pass another "
            f"sentinel (None, a string), or register it with "
            f"`model.register_context_args({name!r}, dynamic=True)`. Received: {name}=nan"
        )
    if not isinstance(value, STATIC_TYPES):
        try:
            hash(value)
        except TypeError:
            raise TypeError(
                f"Context argument `{name}` must be hashable (bool, int, float, str, "
                "None or a tuple of these), because its value selects a compiled "
                "function. Pass a tuple instead of a list, or register the name "
                "with `dynamic=True` for numbers and arrays. "
                f"Received: {name}={value!r}"
            ) from None


def _tensor_described(value) -> str:
    """`np.True_`, or `<torch.Tensor of shape (2,)>`: the type said in full (numpy
    2 calls its bool `bool`), never a whole array."""
    if isinstance(value, np.generic):
        return repr(value)
    kind = type(value)
    return f"<{kind.__module__}.{kind.__qualname__} of shape {tuple(value.shape)}>"


def freeze(value: Any) -> Any:
    """A key item that differs whenever the type differs (`True`, `1`, `1.0`), and
    for `-0.0` and `0.0` (equal, yet `copysign`, `1 / x` and `atan2` tell them apart)."""
    if isinstance(value, tuple):
        return ("tuple", tuple(freeze(v) for v in value))
    if isinstance(value, float) and value == 0.0:
        return (type(value).__qualname__, value, math.copysign(1.0, value))
    return (type(value).__qualname__, value)


def static_key(values: dict, static: set) -> tuple:
    return tuple(sorted((n, freeze(v) if n in static else DYNAMIC) for n, v in values.items()))


def describe(key: tuple) -> str:
    names = [f"{item[0]}={item[1]!r}" for item in key if isinstance(item[0], str)
             and not item[0].startswith("<")]
    scopes = [item[0].strip("<>") for item in key if isinstance(item[0], str)
              and item[0].startswith("<")]
    return ", ".join(names + [f"with a {scope}" for scope in scopes])


class Entry:
    """The compiled functions and step closures of one key."""

    def __init__(self, key: tuple, make_steps: Callable | None = None, values=None):
        self.key = key
        self.functions: dict[str, Any] = dict.fromkeys(KINDS)
        self.reads: set[str] = set()  # names outside the key its traces looked up
        self.hits: dict[str, set] = {}  # kind of step -> patched points its traces reached
        self.inputs: dict[str, set] = {}  # kind of step -> dynamic inputs its traces read
        self.steps = (make_steps(key, values or {}, self.reads, self.hits, self.inputs)
                      if make_steps else {})
        self.users = 0  # running calls that use this entry (pins it)


class KeyTable:
    """A bounded LRU of entries; the default key `()` is always kept."""

    def __init__(self, make_steps: Callable[[tuple, dict, set, dict, dict], dict]):
        self._make_steps = make_steps
        self._entries: collections.OrderedDict[tuple, Entry] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.default = Entry((), make_steps)

    def acquire(self, key: tuple, values: dict, limit: int) -> Entry:
        """The entry of `key`, made if new, and pinned until `release`."""
        if not key:
            self.default.users += 1
            return self.default
        evicted = []
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = Entry(key, self._make_steps, values)
                free = [k for k, e in self._entries.items() if e.users == 0 and k != key]
                while len(self._entries) > max(1, int(limit)) and free:
                    evicted.append(free.pop(0))
                    del self._entries[evicted[-1]]
            self._entries.move_to_end(key)
            entry.users += 1
        for key_ in evicted:
            warnings.warn(
                f"callscope evicted the compiled functions of context ({describe(key_)}) "
                f"(more than context_cache_size={limit} distinct keys). It will retrace "
                "if used again. Raise `model.context_cache_size` to keep more.",
                stacklevel=_user_stacklevel(),
            )
        return entry

    def release(self, entry: Entry) -> None:
        with self._lock:
            entry.users -= 1

    def clear(self) -> None:
        with self._lock:
            for key in [k for k, e in self._entries.items() if e.users == 0]:
                del self._entries[key]
            self.default.functions = dict.fromkeys(KINDS)
            for entry in self._entries.values():
                entry.functions = dict.fromkeys(KINDS)

    def __len__(self) -> int:
        return len(self._entries)


def _user_stacklevel() -> int:
    """The `stacklevel` that names the user's line: the first frame outside
    callscope and Keras (how deep the call is depends on the entry point)."""
    inside = (os.path.dirname(os.path.abspath(__file__)) + os.sep,  # (not keras_hub/)
              os.path.dirname(os.path.abspath(keras.__file__)) + os.sep)
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(inside):
        frame, level = frame.f_back, level + 1
    return level
