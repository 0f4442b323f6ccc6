"""Keys: the frozen form of a call's static values, and the per-key function table.

A static context value selects a compiled function, so the key must tell apart
what Python's `==` merges: `True == 1 == 1.0` would share one dict key, and one
trace, and so would a namedtuple and a plain tuple, or two classes' members that
compare equal. Each value is frozen with its type itself (`(bool, True)`,
`(int, 1)`), tuples recursively. Only values that cannot change are static: a
mutable object that hashes by identity would keep selecting the trace of its
first state. NaN never equals itself and would miss the cache on every call, so
it is refused.

`KeyTable` is a bounded LRU of `Entry`s (the compiled functions and step closures
of one key). An entry in use by a running call is pinned: it is never evicted
under that call, whatever the bound.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
import os
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

STATIC_TYPES = (bool, int, float, str, type(None))
# Objects hashed by identity that never change as a key sees them: Enum members,
# functions and classes (keyed as Python code is, by identity).
_BY_IDENTITY = (enum.Enum, types.FunctionType, type)
_STATIC_KINDS = ("a bool, int, float, str, None, an Enum member, a function or class, "
                 "an object hashed by value (a frozen dataclass), or a tuple (a namedtuple "
                 "too) or frozenset of these")
DYNAMIC = ("dynamic",)  # stands for a dynamic value in a key
KINDS = ("train", "test", "predict")


def is_tensor_like(value: Any) -> bool:
    return (
        isinstance(value, (np.ndarray, np.generic, keras.Variable))
        or keras.ops.is_tensor(value)
        or type(value).__module__.split(".")[0] in ("jax", "jaxlib", "torch", "tensorflow")
    )


def check_static(name: str, value: Any, registered: Callable[[], str] | None = None,
                 whole: Any = None) -> None:
    """Raises a clear error unless `value` can be part of a compiled-function key.
    `registered()` lists the model's context arguments for the message (called
    only for one: this runs for every static value of every call); `whole` is the
    value passed, where `value` is an item of it."""
    # The plain types first: a compiled torch step checks the values again, and
    # dynamo cannot trace `is_tensor_like`'s `str.split` of a module name.
    # (NaN as `value != value`: `math.isnan` of the float dynamo makes symbolic,
    # once a key's float changed, breaks its graph.)
    if type(value) in STATIC_TYPES and not (isinstance(value, float) and value != value):
        return
    given = value if whole is None else whole
    if is_tensor_like(value) and hasattr(value, "shape"):  # (not a torch.dtype)
        raise TypeError(
            f"Context argument `{name}` is static{_known(registered)}: each distinct value "
            f"gets its own compiled function, so it must be {_STATIC_KINDS}, not a tensor or "
            "array (a tensor would retrace on every call). To pass numbers or arrays "
            f"that change without retracing, register it with "
            f"`model.register_context_args({name!r}, dynamic=True)`"
            + (f", or pass it as a Python value: `{name}=value.item()`"
               if isinstance(value, np.generic) and whole is None else "")
            + f". Received: {name}={shown(given)}"
        )
    if isinstance(value, tuple | frozenset):
        for item in value:
            check_static(name, item, registered, given)
        return
    if _is_dataclass(value):  # keyed field by field (`freeze`): each must be static
        if not type(value).__dataclass_params__.frozen:
            raise TypeError(
                f"Context argument `{name}` is static{_known(registered)}: its value "
                f"selects a compiled function by type and value, and a {type(value).__name__} "
                "can change after its trace (a dataclass that is not frozen): the "
                "function would still run with the value it had then. Make it "
                "`@dataclasses.dataclass(frozen=True)`, or pass a new value instead of "
                f"changing one. Received: {name}={shown(given)}")
        for field in _compared(value):
            check_static(name, getattr(value, field.name), registered, given)
        return
    if isinstance(value, float) and math.isnan(value):
        raise ValueError(
            f"Context argument `{name}` is static, and NaN cannot select a compiled "
            "function (NaN != NaN, so it would retrace on every call). Pass another "
            f"sentinel (None, a string), or register it with "
            f"`model.register_context_args({name!r}, dynamic=True)`. "
            f"Received: {name}={shown(given)}"
        )
    if _bound_to_an_object(value):
        # A bound method stands for its object's state: it is static where that
        # is, and keyed by it (`freeze`).
        owner = value.__self__
        if not (type(owner).__hash__ is object.__hash__ and not _is_dataclass(owner)
                and not isinstance(owner, _BY_IDENTITY)):
            check_static(name, owner, registered, given)
        else:
            raise TypeError(
                f"Context argument `{name}` is static{_known(registered)}: its value "
                "selects a compiled function, and a bound method "
                f"(`{getattr(value, '__qualname__', value)}`) is keyed by its object, a "
                f"{type(value.__self__).__name__}, which can change after its trace "
                "(hashed by identity): the function would still run with the state it "
                "had then. Pass a function (or a staticmethod) with what it reads as "
                "its own static values, or make the object a frozen dataclass. "
                f"Received: {name}={shown(given)}")
        return
    if isinstance(value, STATIC_TYPES + _BY_IDENTITY) or is_tensor_like(value):
        return  # (the latter: a framework's constant, `torch.float32`)
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"Context argument `{name}` must be hashable ({_STATIC_KINDS}), because "
            f"its value selects a compiled function{_known(registered)}. Pass a tuple instead of a "
            "list, or register the name with `dynamic=True` for numbers and arrays. "
            f"Received: {name}={shown(given)}"
        ) from None
    if type(value).__hash__ is not object.__hash__:
        return  # hashed by value: equal values, one key
    raise TypeError(
        f"Context argument `{name}` is static{_known(registered)}: its value selects a compiled "
        f"function by type and value, so it must be {_STATIC_KINDS}. A value of type "
        f"{type(value).__name__} is hashed by identity: changed after its trace, it "
        "would still select the function traced for its first state. Give its class "
        "value equality and a hash (a frozen dataclass), or pass the values it holds "
        "as a tuple or namedtuple, or register the name with `dynamic=True` for numbers "
        f"and arrays. Received: {name}={shown(given)}"
    )


def _known(registered: Callable[[], str] | None) -> str:
    return f" (the model's context arguments: {registered()})" if registered else ""


def shown(value: Any) -> str:
    """`value` for an error's `Received:`: its repr, cut short; a tensor's type and
    shape, never a whole array."""
    if is_tensor_like(value) and hasattr(value, "shape"):
        return _tensor_described(value)
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _tensor_described(value) -> str:
    """`np.True_`, or `<torch.Tensor of shape (2,)>`: the type said in full (numpy
    2 calls its bool `bool`), never a whole array."""
    if isinstance(value, np.generic):
        return repr(value)
    kind = type(value)
    return f"<{kind.__module__}.{kind.__qualname__} of shape {tuple(value.shape)}>"


def freeze(value: Any) -> Any:
    """A key item that differs whenever the type differs (`True`, `1`, `1.0`; a
    namedtuple and a tuple; two classes of one name), and for `-0.0` and `0.0`
    (equal, yet `copysign`, `1 / x` and `atan2` tell them apart). A frozen
    dataclass is keyed by its compared fields so (its own `==` merges `Cfg(0.0)`
    and `Cfg(-0.0)`, `Cfg(1)` and `Cfg(True)`: each later value ran the trace of
    the first); `compare=False` fields are left out, as its `==` does (a cache)."""
    kind = type(value)
    if isinstance(value, tuple):
        fields = getattr(kind, "_fields", None)
        if fields is not None:  # a namedtuple: by its name and fields, as a class
            # made per call (`namedtuple("Cfg", "a b")(1, 2)`) is the same key
            kind = (_NAMEDTUPLE, kind.__module__, kind.__qualname__, tuple(fields))
        return (kind, tuple(freeze(v) for v in value))
    if isinstance(value, frozenset):
        return (kind, frozenset(freeze(v) for v in value))
    if isinstance(value, float):  # (-0.0: what `==` merges, repr tells apart)
        return (kind, float.__repr__(value))  # (not a subclass's own, which may round)
    if isinstance(value, complex):
        return (kind, complex.__repr__(value))
    if _is_dataclass(value):
        return (kind, tuple((field.name, freeze(getattr(value, field.name)))
                            for field in _compared(value)))
    if _bound_to_an_object(value):  # (it compares its object by identity: equal frozen
        # dataclasses' methods were two keys, a trace per new object)
        return (kind, type(value.__self__), freeze(value.__self__),
                getattr(value, "__func__", value.__name__))
    return (kind, value)


_NAMEDTUPLE = "namedtuple"  # a frozen namedtuple's kind: (_NAMEDTUPLE, module, name, fields)


def _bound_to_an_object(value: Any) -> bool:
    """A bound method (Python's or a builtin's) of an instance: not a
    classmethod's class, nor a module's function (`math.sin`)."""
    return (isinstance(value, types.MethodType | types.BuiltinMethodType)
            and not isinstance(value.__self__, type | types.ModuleType | None))


def _is_dataclass(value: Any) -> bool:
    """A dataclass instance (not the class, which is keyed by identity)."""
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _compared(value: Any) -> list:
    """The fields of dataclass `value` that its `==` compares."""
    return [field for field in dataclasses.fields(value) if field.compare]


def static_key(values: dict, static: set) -> tuple:
    return tuple(sorted((n, freeze(v) if n in static else DYNAMIC) for n, v in values.items()))


def describe(key: tuple) -> str:
    names = [f"{item[0]}={_said(item[1])}" for item in key if isinstance(item[0], str)
             and not item[0].startswith("<")]
    scopes = [item[0].strip("<>") for item in key if isinstance(item[0], str)
              and item[0].startswith("<")]
    return ", ".join(names + [f"with a {scope}" for scope in scopes])


def _said(frozen: tuple) -> str:
    """A frozen value (`freeze`) as the value was written."""
    if frozen == DYNAMIC:
        return "<dynamic>"
    kind, value = frozen
    if isinstance(kind, tuple):  # a namedtuple
        fields = ", ".join(f"{f}={_said(v)}" for f, v in zip(kind[3], value))
        return f"{kind[2].rpartition('.')[2]}({fields})"
    if issubclass(kind, float | complex):
        return value  # (its repr)
    if dataclasses.is_dataclass(kind):
        return f"{kind.__name__}({', '.join(f'{f}={_said(v)}' for f, v in value)})"
    if issubclass(kind, tuple | frozenset):
        items = ", ".join(_said(item) for item in value)
        if issubclass(kind, frozenset):
            return f"frozenset({{{items}}})" if value else "frozenset()"
        return f"({items}{',' if len(value) == 1 else ''})"
    return repr(value)


UNTRACKED = 0  # `Entry.hits`' trace number for the traces and steps that return none


class Entry:
    """The compiled functions and step closures of one key."""

    def __init__(self, key: tuple, make_steps: Callable | None = None, values=None):
        self.key = key
        self.functions: dict[str, Any] = dict.fromkeys(KINDS)
        self.reads: set[str] = set()  # names outside the key its traces looked up
        # kind of step -> {trace number: the patched points that trace reached}
        self.hits: dict[str, dict[int, set]] = {}
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
        with _TABLES_LOCK:
            _TABLES.add(self)

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

    def users(self) -> int:
        """Calls running now, over every key."""
        with self._lock:
            return self.default.users + sum(e.users for e in self._entries.values())

    def clear(self) -> None:
        with self._lock:
            for key in [k for k, e in self._entries.items() if e.users == 0]:
                del self._entries[key]
            self.default.functions = dict.fromkeys(KINDS)
            for entry in self._entries.values():
                entry.functions = dict.fromkeys(KINDS)

    def __len__(self) -> int:
        return len(self._entries)


_TABLES: weakref.WeakSet[KeyTable] = weakref.WeakSet()  # every callscope model's
_TABLES_LOCK = threading.Lock()  # a WeakSet cannot be listed while one is added


def every_table() -> list[KeyTable]:
    with _TABLES_LOCK:
        return list(_TABLES)


def _user_stacklevel() -> int:
    """The `stacklevel` that names the user's line: the first frame outside
    callscope and Keras (how deep the call is depends on the entry point)."""
    inside = (os.path.dirname(os.path.abspath(__file__)) + os.sep,  # (not keras_hub/)
              os.path.dirname(os.path.abspath(keras.__file__)) + os.sep)
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(inside):
        frame, level = frame.f_back, level + 1
    return level
