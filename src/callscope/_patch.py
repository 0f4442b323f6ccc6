"""Interventions: replace a point's output inside every call.

`cs.patch(model, {point: fn_or_array})` is a scope. Its patches become part of the
model's compiled-function key, so a patched run compiles its own variant and the
unpatched one is untouched; nothing stays installed after the scope. A patch is

- `fn(value)`: the same function of the value in every batch;
- `fn(value, batch)`: a function of the value and of where the batch sits in the
  call's data (`batch.start`, `batch.rows`; see `cs.Batch`), for activation
  patching across batches;
- `fn(value, values)` or `fn(value, batch, values)`: `values` are the numbers and
  arrays given as `cs.patch(..., values={...})`;
- an array with one row per row of the call's data: callscope takes this
  batch's rows (splice a clean run's activations into a corrupted run).

Arrays (a patch array, `values=`) enter the compiled step as inputs (`_inputs.py`):
the key holds their shapes and dtypes, so a sweep over new arrays of one shape
compiles once. A function is keyed by identity: a new `fn` object is a new key,
so define it once, outside the sweep, and pass what changes as `values`. A patch
whose output has another shape than the value raises; so does a patch on a point
that a call never reached, when that call ends.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import keras
import numpy as np
from keras import ops

from callscope import _inputs, _record, _scope


class Shape(NamedTuple):
    """The shape and dtype of a patch value, as the compiled key holds it."""

    shape: tuple
    dtype: str


class DynamicPatch:
    """A patch whose arrays (`values`: name -> numpy array) enter the compiled step
    as inputs (`_inputs.py`): keyed by their shapes and dtypes, never by the
    arrays, so a sweep of new values of one shape compiles once. `keyed()` is the
    form the key holds: shapes only, so no compiled function keeps an array alive."""

    takes_batch = True
    rows = None

    def __init__(self, values: dict):
        self.values = values

    def structure(self) -> tuple:
        return tuple((n, tuple(a.shape), str(a.dtype)) for n, a in sorted(self.values.items()))

    def keyed(self) -> DynamicPatch:
        twin = copy.copy(self)
        twin.values = {n: Shape(tuple(a.shape), str(a.dtype)) for n, a in self.values.items()}
        twin.rows = None
        return twin

    def _identity(self) -> tuple:
        return (type(self), self.structure())

    def __eq__(self, other):
        return isinstance(other, DynamicPatch) and other._identity() == self._identity()

    def __hash__(self):
        return hash(self._identity())


class ArrayPatch(DynamicPatch):
    """A patch by a full-data array: each batch gets its own rows (`batch.start`
    onwards). The array is an input of the compiled step (see `DynamicPatch`)."""

    def __init__(self, array, point: str, given=None):
        super().__init__({"array": np.asarray(array)})
        self.rows = len(self.values["array"])
        self.point = point
        self.given = given  # the dtype the user passed, where `_widened` changed it

    def __call__(self, value, batch, values):
        array = values["array"]
        _check_kind(self.point, array.dtype, value.dtype, self.given)
        # Clamped, so a batch past the end never fails inside the step: the run
        # raises a clear error when the step returns (`RowOffset.check_end`).
        rows = ops.minimum(ops.arange(batch.rows, dtype="int32") + batch.start,
                           array.shape[0] - 1)
        return ops.take(array, rows, axis=0)  # (cast to the point's dtype, checked, after)


def _check_kind(point: str, given, wanted, passed=None) -> None:
    """An array patch is cast to the point's dtype: refused where the cast would
    change values beyond rounding (floats to ints truncate, numbers to bools).
    `passed`: the dtype the user passed, where it was widened to `given`."""
    if _inputs.may_hold(wanted, given):
        return
    given, wanted = (keras.backend.standardize_dtype(d) for d in (given, wanted))
    given = str(passed) if passed is not None else given
    raise TypeError(
        f"The array patch of `{point}` holds {given} values, and the point's value is "
        f"{wanted}: the cast would change them ({_inputs.cast_loss(wanted)}). Pass an "
        f"array of the point's kind (e.g. `np.round(a).astype({wanted!r})`). Received: an array of "
        f"dtype {given} for a point of dtype {wanted}"
    )


class ValuesPatch(DynamicPatch):
    """A patch `fn(value, values=...)` or `fn(value, batch, values=...)`: the scope's
    `values` enter the compiled step as inputs; the key holds `fn` by identity."""

    def __init__(self, fn, values: dict, takes_batch: bool):
        super().__init__(values)
        self.fn, self.takes_batch = fn, takes_batch

    def __call__(self, value, batch, values):
        if self.takes_batch:
            return self.fn(value, batch, values=values)
        return self.fn(value, values=values)

    def _identity(self) -> tuple:
        return (function_identity(self.fn), self.takes_batch, self.structure())


class BatchPatch:
    """A patch `fn(value, batch)`."""

    takes_batch = True
    rows = None

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, value, batch):
        return self.fn(value, batch)

    # The same function is the same key: no retrace per scope.
    def __eq__(self, other):
        return isinstance(other, BatchPatch) and (
            function_identity(other.fn) == function_identity(self.fn))

    def __hash__(self):
        return hash(("BatchPatch", function_identity(self.fn)))


def function_identity(fn) -> tuple:
    """What makes two patch functions the same key. A bound method is a new object
    at each attribute access (`obj.zero_unit`): it is its object and function, or
    a sweep would compile once per scope. (The key holds `fn`, so the ids stay
    those of live objects.)"""
    owner, function = getattr(fn, "__self__", None), getattr(fn, "__func__", None)
    if owner is not None and function is not None:
        return ("method", id(owner), id(function))
    return ("function", id(fn))


def keyed(fn):
    """The form of a patch that a compiled key holds."""
    return fn.keyed() if isinstance(fn, DynamicPatch) else fn


def _parameters(fn) -> list:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: fn(value)
        return []


def _takes_batch(fn) -> bool:
    parameters = [p for p in _parameters(fn) if p.name != "values"]
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    return len(required) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in parameters)


def _takes_values(fn) -> bool:
    return any(p.name == "values" and p.kind is not p.POSITIONAL_ONLY for p in _parameters(fn))


def _numbers(array: np.ndarray, what: str) -> np.ndarray:
    """`array`, or a clear error where it holds no numbers: it enters the compiled
    step as a tensor (the backend's own error named neither patch nor point)."""
    if array.dtype.kind in "USOMm":  # (bfloat16's kind is 'V': numbers)
        raise TypeError(
            f"{what} enters the compiled step as a tensor: it takes numbers or bools. "
            "Put strings and other settings in a patch function itself. Received: an "
            f"array of numpy dtype {array.dtype}")
    return _widened(array)


def _narrowed_ints(array: np.ndarray, point: str) -> np.ndarray:
    """JAX without `jax_enable_x64` holds 64-bit numbers as 32-bit: an array patch in
    those, or an error where its values do not fit (2**32 + 5 read 5, 1e300 inf)."""
    held = {np.dtype(np.int64): np.dtype(np.int32), np.dtype(np.uint64): np.dtype(np.uint32),
            np.dtype(np.float64): np.dtype(np.float32)}.get(array.dtype)
    if held is None or keras.backend.backend() != "jax":
        return array
    import jax

    if jax.config.jax_enable_x64:
        return array
    if not _inputs.holds(array, held):
        raise ValueError(
            f"The array patch of `{point}` holds {array.dtype} values from "
            f"{np.nanmin(array)} to {np.nanmax(array)}, and JAX holds them as {held} (it "
            "has no 64-bit numbers unless `jax_enable_x64` is set), which cannot: they "
            f"would patch wrapped around, or as inf. Pass values within {held}'s range. "
            f"Received: an array of dtype {array.dtype}")
    return array.astype(held)


def _widened(array: np.ndarray) -> np.ndarray:
    """A float8 or float4 array as float32, an int4 or int2 one as (u)int8: exact,
    and held by every backend (TF has no kernel to take rows of float8, torch
    converts no ml_dtypes array; JAX took them). The point's cast applies after."""
    if array.dtype.itemsize != 1 or array.dtype in (np.int8, np.uint8, np.bool_):
        return array
    import ml_dtypes  # (Keras's own dependency)

    try:
        ml_dtypes.finfo(array.dtype)
        return array.astype("float32")
    except ValueError:
        pass
    try:
        return array.astype("int8" if ml_dtypes.iinfo(array.dtype).min < 0 else "uint8")
    except ValueError:
        return array


def _value_array(name, value) -> np.ndarray:
    """A `values=` entry as the array the step gets: floats in floatx, Python and
    64-bit ints in int32 (what JAX computes in), other dtypes kept."""
    if isinstance(value, str) or value is None or callable(value):
        raise TypeError(
            "`cs.patch(..., values=)` takes numbers and arrays (they enter the compiled "
            "step as inputs). Put strings and other settings in the function itself. "
            f"Received: values[{name!r}]={value!r}"
        )
    array = _numbers(np.asarray(keras.ops.convert_to_numpy(value)), f"values[{name!r}]")
    if array.dtype.kind == "f":
        return array.astype(keras.config.floatx())
    if array.dtype.kind in "iu" and array.dtype.itemsize == 8:
        if not _inputs.holds(array, "int32"):
            raise ValueError(
                f"`cs.patch(..., values=)` passes integers as int32. values[{name!r}] "
                f"does not fit. Received: values[{name!r}] with range "
                f"[{array.min()}, {array.max()}]"
            )
        return array.astype("int32")
    return array


def _normalized(point, fn, values):
    if not isinstance(point, str):
        raise TypeError(f"`cs.patch` takes {{point (str): fn or array}}. Received: {point!r}")
    if isinstance(fn, np.ndarray) or (not callable(fn) and hasattr(fn, "shape")):
        array = np.asarray(ops.convert_to_numpy(fn))
        if array.ndim < 1:
            raise ValueError(
                f"An array patch of `{point}` gives one row per row of the data, so it "
                f"needs a batch axis. Received: an array of shape {array.shape}"
            )
        held = _narrowed_ints(_numbers(array, f"The array patch of `{point}`"), point)
        return ArrayPatch(held, point, array.dtype if held.dtype != array.dtype else None)
    if not callable(fn):
        raise TypeError(
            "`cs.patch` takes {point (str): fn(value), fn(value, batch) or an array}. "
            f"Received: {point!r}: {fn!r}"
        )
    if _takes_values(fn):
        if values is None:
            raise TypeError(
                f"The patch of `{point}` takes `values`, but `cs.patch` was given none. "
                "Pass them as `cs.patch(model, {point: fn}, values={name: number or "
                "array})`. Received: values=None"
            )
        return ValuesPatch(fn, values, _takes_batch(fn))
    return BatchPatch(fn) if _takes_batch(fn) else fn


def patch(model, patches: Mapping[str, Callable[..., Any] | Any],
          values: Mapping[str, Any] | None = None) -> contextlib.AbstractContextManager:
    """Replaces the output of each point with a patch, for every call inside.

    Args:
        model: a `cs.Model`, `cs.Sequential` or `cs.enable`d model.
        patches: `{point: patch}`; a point is a layer's point, a sown value
            `<layer point>/<name>` or an output element (see `cs.points`). A patch
            is `fn(value)`, `fn(value, batch)` (`batch.start` is the row offset
            of the batch in the call's data, `batch.rows` its size), or an array
            with one row per row of the data, sliced per batch. A function with a
            `values` argument (`fn(value, values)`, `fn(value, batch, values)`)
            gets `values` as tensors.
        values: `{name: number or array}` for the patch functions that take
            `values`. They are inputs of the compiled step, not constants: a
            sweep that changes them (same shapes and dtypes) compiles once. Floats
            become `keras.config.floatx()`, 64-bit ints int32.

    Example:

    >>> import keras, numpy as np, callscope as cs
    >>> model = cs.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="hidden")],
    ...                       name="mlp")
    >>> with cs.patch(model, {"mlp/hidden": keras.ops.ones_like}):
    ...     model.predict(np.ones((1, 2)), verbose=0)
    array([[1., 1.]], dtype=float32)
    >>> clean = np.arange(8.0, dtype="float32").reshape(4, 2)  # e.g. another run's values
    >>> with cs.patch(model, {"mlp/hidden": clean}):
    ...     model.predict(np.ones((4, 2)), batch_size=3, verbose=0)
    array([[0., 1.],
           [2., 3.],
           [4., 5.],
           [6., 7.]], dtype=float32)

    A sweep: one function, defined once; what changes goes in `values` (one
    compiled function for every position):

    >>> def zero_unit(h, values):
    ...     keep = keras.ops.arange(h.shape[-1]) != values["unit"]
    ...     return h * keras.ops.cast(keep, h.dtype)
    >>> for unit in range(2):
    ...     with cs.patch(model, {"mlp/hidden": zero_unit}, values={"unit": unit}):
    ...         print(model.predict(clean[:1], verbose=0) != 0)
    [[False  True]]
    [[ True False]]
    """
    from callscope._mixin import ContextMixin

    if not isinstance(model, ContextMixin):
        raise TypeError(
            "`cs.patch` needs a callscope model: build it with `cs.Model`/`cs.Sequential`, "
            f"or call `model = cs.enable(model)` first. Received: model={type(model).__name__}"
        )
    if not isinstance(patches, Mapping) or not patches:
        raise TypeError(
            "`cs.patch` takes a non-empty dict {point: fn or array}. "
            f"Received: patches={patches!r}"
        )
    if values is not None:
        if not isinstance(values, Mapping) or not all(isinstance(n, str) for n in values):
            raise TypeError(
                "`cs.patch(..., values=)` takes a dict {name (str): number or array}. "
                f"Received: values={values!r}"
            )
        values = {name: _value_array(name, value) for name, value in values.items()}
    normalized = {point: _normalized(point, fn, values) for point, fn in patches.items()}
    if values is not None and not any(isinstance(fn, ValuesPatch) for fn in normalized.values()):
        raise TypeError(
            "`cs.patch(..., values=)` passes its values to the patch functions that take "
            "a `values` argument (`fn(value, values)` or `fn(value, batch, values)`), "
            "and none does. Add the argument, or leave `values` out. "
            f"Received: values={sorted(values)}"
        )
    # Now, not at the first call: a layer called outside any call of the model
    # (keras_hub's `generate`) is refused by its wrapper, not missed.
    _record.install_wrappers(model)
    return _scope.open_patch(model, normalized)
