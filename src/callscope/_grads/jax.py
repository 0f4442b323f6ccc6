"""JAX: zero perturbations added to each source, differentiated in one
`value_and_grad` (with the weights, in a train step): one forward pass.

The sources' shapes come from `jax.eval_shape` of the same forward pass. Values
sown inside the differentiated function leave it through its aux output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from callscope import _keras_compat, _record


def at_loss(collector, loss) -> None:
    del collector, loss  # the gradient comes from value_and_grad, not the loss hook


def _zeros(collector, forward, *args) -> dict:
    """A zero perturbation per gradient source `forward(*args)` would record."""

    def probe(*args):
        with _record.collecting_for(collector.specs) as inner:
            inner.manual = collector.manual
            forward(*args)
            return dict(inner.grad_source_list())

    shapes = jax.eval_shape(probe, *args)
    return {name: jnp.zeros(s.shape, s.dtype) for name, s in shapes.items()}


def _perturbed(collector, forward):
    """`forward` with each source replaced by source + perturbation."""

    def run(perturbations, *args):
        previous = collector.perturbations
        collector.perturbations = perturbations
        collector.grad_sources = {}
        try:
            return forward(*args)
        finally:
            collector.perturbations = previous

    return run


def step_with_grads(model, kind, step, args, kwargs, collector):
    if not _keras_compat.is_stock_jax_step(model, kind):
        raise ValueError(
            f"cs.capture(kinds=('grad',)) on JAX differentiates through callscope's own "
            f"copy of Keras's {kind}_step, and `{type(model).__name__}` overrides "
            f"`{kind}_step`. Inside your own stateless step, use "
            "`cs.intermediate_grads(model, loss_fn, ...)`. Received: a custom "
            f"{kind}_step"
        )

    def differentiate(forward, trainable, training):
        zeros = _zeros(collector, forward, trainable)
        perturbed = _perturbed(collector, forward)
        if training:
            grad_fn = jax.value_and_grad(lambda t, p: perturbed(p, t), argnums=(0, 1),
                                         has_aux=True)
            (loss, aux), (grads, source_grads) = grad_fn(trainable, zeros)
        else:
            grad_fn = jax.value_and_grad(lambda p: perturbed(p, trainable), has_aux=True)
            (loss, aux), source_grads = grad_fn(zeros)
            grads = None
        collector.grad_sources = {}
        collector.add_grads(source_grads)
        return (loss, aux), grads

    return _keras_compat.jax_stock_step(model, kind, args[0], args[1], differentiate)


def value_and_grads(collector, loss_fn, args):
    collector.manual = True
    zeros = _zeros(collector, loss_fn, *args)

    def forward(perturbations):
        result = _perturbed(collector, loss_fn)(perturbations, *args)
        loss, aux = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
        return loss, (aux, collector.records)

    (loss, (aux, records)), grads = jax.value_and_grad(forward, has_aux=True)(zeros)
    collector.records = {}
    collector.merge(records)  # the outputs, as values (not tracers of the grad trace)
    collector.grad_sources = {}
    collector.add_grads(grads)
    return (loss, *aux) if aux else loss
