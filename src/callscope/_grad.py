"""Gradients with respect to intermediates, for users who write their own steps.

Inside `fit`/`evaluate`, `cs.capture(model, kinds=("grad",))` does this for you
(see `_steps.py`). In a custom `train_step` or a custom training loop, call
`cs.intermediate_grads(model, loss_fn, *args, select=...)`: it runs `loss_fn` once,
records the selected points, and returns d loss / d point for each.

- JAX: `loss_fn` must be a pure function of its arguments (the stateless style).
- torch: the caller can still call `loss.backward()` afterwards.

How each backend differentiates is in `_grads`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import keras

from callscope import _grads, _record
from callscope._points import Spec, key_name, normalize_select

_BACKEND = keras.backend.backend()


class IntermediateGrads(NamedTuple):
    """What `cs.intermediate_grads` returns."""

    loss: Any
    aux: Any  # the second element when `loss_fn` returns (loss, aux), else None
    grads: dict  # "point:grad" -> d loss / d point
    outputs: dict  # "point:output" -> the point's value


def intermediate_grads(
    model, loss_fn: Callable, *args: Any, select: str | list[str] | Callable | None = None
) -> IntermediateGrads:
    """Runs `loss_fn(*args)` once; returns the loss and d loss / d each selected point.

    Args:
        model: the model whose layers `select` picks from (any Keras model).
        loss_fn: returns a scalar loss, or `(loss, aux)`. It runs the model.
        *args: passed to `loss_fn` (on JAX, everything it differentiates through).
        select: as in `cs.capture`: globs or `(point, layer) -> bool`; by default
            every sown point.

    Example:

    >>> import keras, numpy as np, callscope as cs
    >>> class Block(keras.layers.Layer):
    ...     def call(self, x):
    ...         return cs.sow(self, "h", x * 3.0)
    >>> model = cs.Sequential([keras.Input((2,)), Block(name="block")], name="m")
    >>> x = keras.ops.convert_to_tensor(np.ones((1, 2), "float32"))
    >>> if keras.backend.backend() == "jax":
    ...     tv = [v.value for v in model.trainable_variables]
    ...     ntv = [v.value for v in model.non_trainable_variables]
    ...     fn = lambda x: keras.ops.sum(model.stateless_call(tv, ntv, x)[0] ** 2)
    ... else:
    ...     fn = lambda x: keras.ops.sum(model(x) ** 2)
    >>> result = cs.intermediate_grads(model, fn, x)
    >>> keras.ops.convert_to_numpy(result.grads["m/block/h:grad"])  # d sum(h^2)/dh = 2h
    array([[6., 6.]], dtype=float32)
    """
    spec = Spec(normalize_select(select), ("output", "grad"), None, 1, None)
    _record.install_wrappers(model)
    with _record.collecting_for((spec,)) as collector:
        collector.manual = True
        result = _grads.impl.value_and_grads(collector, loss_fn, args)
    loss, aux = (result[0], result[1]) if isinstance(result, tuple) else (result, None)
    return IntermediateGrads(loss, aux, _named(collector.records, "grad"),
                             _named(collector.records, "output"))


def _named(records, kind):
    out = {}
    for name, values in records.items():
        _, point, recorded = name.split("|")
        if recorded == kind:
            for i, value in enumerate(values):
                out[key_name(point, kind, i, len(values))] = value
    return out
