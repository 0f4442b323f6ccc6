"""Context arguments: the values in effect, and the keys that compiled steps use.

A context argument is a keyword (`debugging`, `mode`, `temperature`) that flows
from a model's entry point (`fit`, `predict`, `model(x)`, ...) into every nested
layer that declares it. Its value lives in a thread-local *scope*: a stack of
immutable mappings, pushed by `cs.context(...)`, by each entry point, and again
*inside* every compiled step, so that a trace reads the value of the call that
made it, also in the replica threads of `tf.distribute`.

Static values (bool, int, float, str, None and tuples of them) are frozen into a
hashable key: one compiled function per key. Dynamic values are numbers or arrays
held in variables: changing them never retraces.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import keras
import numpy as np

_EMPTY: Mapping[str, Any] = MappingProxyType({})
_local = threading.local()

STATIC_TYPES = (bool, int, float, str, type(None))


def _scope() -> Mapping[str, Any]:
    return getattr(_local, "scope", _EMPTY)


@contextlib.contextmanager
def pushed(values: Mapping[str, Any]) -> Iterator[None]:
    """Pushes `values` over the current thread's scope; pops it on exit."""
    previous = _scope()
    _local.scope = MappingProxyType({**previous, **values}) if values else previous
    try:
        yield
    finally:
        _local.scope = previous


def scope_values() -> Mapping[str, Any]:
    """The raw mapping in effect (dynamic names map to their variables)."""
    return _scope()


@contextlib.contextmanager
def context(**values: Any) -> Iterator[None]:
    """Sets context arguments for every call of an enabled model in this scope.

    Values set here reach `fit`, `evaluate`, `predict`, the `*_on_batch` methods
    and `model(x)` of every model that registered the names, exactly as if they
    had been passed as keyword arguments. An explicit keyword argument wins over
    the scope. Scopes nest; the inner value wins. The scope is thread-local.

    Example:

    >>> import callscope as cs
    >>> with cs.context(debugging=True):
    ...     cs.current("debugging")
    True
    >>> cs.current("debugging") is None
    True
    """
    with pushed(values):
        yield


def current(name: str, default: Any = None) -> Any:
    """The value of context argument `name` in effect, or `default`.

    Works in a layer's `call`, in `train_step`/`test_step`/`predict_step`
    (including the stateless JAX style) and in callbacks. Inside a compiled step
    a static value is a plain Python value; a dynamic one is a tensor.

    Example:

    >>> import callscope as cs
    >>> cs.current("mode", default="eval")
    'eval'
    >>> with cs.context(mode="train"):
    ...     cs.current("mode")
    'train'
    """
    value = _scope().get(name)
    if value is None:
        return default
    if isinstance(value, keras.Variable):
        return value.value
    return value


# --------------------------------------------------------------------------
# Keys and validation
# --------------------------------------------------------------------------
def is_tensor_like(value: Any) -> bool:
    return (
        isinstance(value, (np.ndarray, np.generic, keras.Variable))
        or keras.ops.is_tensor(value)
        or type(value).__module__.split(".")[0] in ("jax", "jaxlib", "torch", "tensorflow")
    )


def check_static(name: str, value: Any) -> None:
    """Raises a clear error unless `value` can be part of a compiled-function key."""
    if is_tensor_like(value):
        raise TypeError(
            f"Context argument `{name}` is static: each distinct value gets its own "
            "compiled function, so it must be a bool, int, float, str, None or a "
            "tuple of these, not a tensor or array (a tensor would retrace on every "
            f"call). To pass numbers or arrays that change without retracing, "
            f"register it with `model.register_context_args({name!r}, dynamic=True)`. "
            f"Received: {name}={type(value).__name__}"
        )
    if isinstance(value, tuple):
        for item in value:
            check_static(name, item)
        return
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


def unknown_argument_error(method: str, name: str, registered: set[str]) -> TypeError:
    known = ", ".join(sorted(registered)) or "none"
    return TypeError(
        f"`{method}()` got an unexpected keyword argument `{name}`. It is neither an "
        f"argument of `{method}()` nor a registered context argument "
        f"(registered: {known}). To pass it to the model's layers, declare it with "
        f"`model.register_context_args({name!r})` or decorate the model class with "
        f"`@callscope.context_args({name!r})`. Received: {name}=..."
    )
