"""Interventions: replace a point's output inside every call.

`cs.patch(model, {point: fn_or_array})` is a scope. Its patches become part of the
model's compiled-function key, so a patched run compiles its own variant and the
unpatched one is untouched; nothing stays installed after the scope. A patch is

- `fn(value)`: the same function of the value in every batch;
- `fn(value, batch)`: a function of the value and of where the batch sits in the
  call's data (`batch.start`, `batch.rows`; see `cs.Batch`), for activation
  patching across batches;
- an array with one row per row of the call's data: callscope takes this
  batch's rows (splice a clean run's activations into a corrupted run).

A new `fn` object is a new key, so reuse one function across calls where you
can. A patch whose output has another shape than the value raises; so does a
patch on a point that a call never reached, when that call ends.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
from keras import ops

from callscope import _scope


class ArrayPatch:
    """A patch by a full-data array: each batch gets its own rows (`batch.start`
    onwards). Hashed by identity: the array is a constant of the compiled step,
    so each scope compiles its own (an array changed in place is never stale)."""

    takes_batch = True

    def __init__(self, array):
        self.array = np.asarray(array)
        self.rows = len(self.array)

    def __call__(self, value, batch):
        # Clamped, so a batch past the end never fails inside the step: the run
        # raises a clear error when the step returns (`RowOffset.advance`).
        rows = ops.minimum(ops.arange(batch.rows, dtype="int32") + batch.start, self.rows - 1)
        return ops.cast(ops.take(ops.convert_to_tensor(self.array), rows, axis=0), value.dtype)


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
        return isinstance(other, BatchPatch) and other.fn is self.fn

    def __hash__(self):
        return hash(("BatchPatch", id(self.fn)))


def _takes_batch(fn) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: fn(value)
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    return len(required) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in parameters)


def _normalized(point, fn):
    if not isinstance(point, str):
        raise TypeError(f"`cs.patch` takes {{point (str): fn or array}}. Received: {point!r}")
    if isinstance(fn, np.ndarray) or (not callable(fn) and hasattr(fn, "shape")):
        array = np.asarray(ops.convert_to_numpy(fn))
        if array.ndim < 1:
            raise ValueError(
                f"An array patch of `{point}` gives one row per row of the data, so it "
                f"needs a batch axis. Received: an array of shape {array.shape}"
            )
        return ArrayPatch(array)
    if not callable(fn):
        raise TypeError(
            "`cs.patch` takes {point (str): fn(value), fn(value, batch) or an array}. "
            f"Received: {point!r}: {fn!r}"
        )
    return BatchPatch(fn) if _takes_batch(fn) else fn


@contextlib.contextmanager
def patch(model, patches: Mapping[str, Callable[..., Any] | Any]) -> Iterator[None]:
    """Replaces the output of each point with a patch, for every call inside.

    Args:
        model: a `cs.Model`, `cs.Sequential` or `cs.enable`d model.
        patches: `{point: patch}`; a point is a layer's point, a sown value
            `<layer point>/<name>` or an output element (see `cs.points`). A patch
            is `fn(value)`, `fn(value, batch)` (`batch.start` is the row offset
            of the batch in the call's data, `batch.rows` its size), or an array
            with one row per row of the data, sliced per batch.

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
    normalized = {point: _normalized(point, fn) for point, fn in patches.items()}
    with _scope.open_patch(model, normalized):
        yield
