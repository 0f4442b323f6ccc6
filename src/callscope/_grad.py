"""Gradients with respect to intermediates, for users who write their own steps.

Inside `fit`/`evaluate`, `cs.capture(model, kinds=("grad",))` does this for you
(see `_steps.py`). In a custom `train_step` or a custom training loop, call
`cs.intermediate_grads(model, loss_fn, *args, select=...)`: it runs `loss_fn` once,
records the selected points, and returns d loss / d point for each.

- JAX: `loss_fn` must be a pure function of its arguments (the stateless style).
  The points' shapes come from `jax.eval_shape`; zero perturbations are added to
  them and differentiated in one `value_and_grad`.
- TensorFlow: one `GradientTape` around `loss_fn`.
- torch: `torch.autograd.grad(loss, points, retain_graph=True)`, so the caller can
  still call `loss.backward()` afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import keras

from callscope import _collector

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
    if isinstance(select, str):
        select = (select,)
    elif isinstance(select, list):
        select = tuple(select)
    spec = _collector.Spec(select, ("output", "grad"), None, 1, None)

    def split(result):
        return (result[0], result[1]) if isinstance(result, tuple) else (result, None)

    def named(collector, records, kind):
        out = {}
        for name, values in records.items():
            _, point, recorded = name.split("|")
            if recorded != kind:
                continue
            for i, value in enumerate(values):
                out[f"{point}@{i}:{kind}" if len(values) > 1 else f"{point}:{kind}"] = value
        return out

    _collector.install_wrappers(model)
    return _intermediate_grads(spec, loss_fn, args, split, named)


def _intermediate_grads(spec, loss_fn, args, split, named):
    if _BACKEND == "jax":
        import jax
        import jax.numpy as jnp

        def sources(*a):
            with _collector.collecting_for((spec,)) as c:
                c.manual = True
                loss_fn(*a)
                return dict(c.grad_source_list())

        shapes = jax.eval_shape(sources, *args)
        zeros = {name: jnp.zeros(s.shape, s.dtype) for name, s in shapes.items()}

        def forward(perturbations):
            with _collector.collecting_for((spec,)) as c:
                c.manual = True
                c.perturbations = perturbations
                loss, aux = split(loss_fn(*args))
                return loss, (aux, c.records)

        (loss, (aux, records)), grads = jax.value_and_grad(forward, has_aux=True)(zeros)
        collector = _collector.Collector((spec,))
        collector.add_grads(grads)
        return IntermediateGrads(loss, aux, named(collector, collector.records, "grad"),
                                 named(collector, records, "output"))

    with _collector.collecting_for((spec,)) as collector:
        collector.manual = True
        if _BACKEND == "tensorflow":
            import tensorflow as tf

            with tf.GradientTape(persistent=True) as tape:
                collector.on_grad_source = lambda v: (tape.watch(v), v)[1]
                loss, aux = split(loss_fn(*args))
            sources = collector.grad_source_list()
            values = tape.gradient(loss, [t for _, t in sources],
                                   unconnected_gradients=tf.UnconnectedGradients.ZERO)
        else:
            import torch

            loss, aux = split(loss_fn(*args))
            sources = collector.grad_source_list()
            values = torch.autograd.grad(loss, [t for _, t in sources], retain_graph=True,
                                         allow_unused=True)
            values = [torch.zeros_like(t) if g is None else g for (_, t), g in zip(sources, values)]
        collector.add_grads({name: g for (name, _), g in zip(sources, values)})
    return IntermediateGrads(loss, aux, named(collector, collector.records, "grad"),
                             named(collector, collector.records, "output"))
