"""torch: `torch.autograd.grad(loss, sources, retain_graph=True)` before the step's
own `backward()`, so the weights' gradients are untouched. Keras runs test steps
under `no_grad`; gradients of an evaluate re-enable it for the step.

Each source is a node of its own (a view of the value, or a leaf that requires
grad): a layer that returns its input unchanged (`Identity`) then gets the
gradient of the paths through its output only, as on JAX and TensorFlow.
"""

from __future__ import annotations

import torch

from callscope import _grads


def _source(value):
    return value.view_as(value) if value.requires_grad else value.detach().requires_grad_()


def _file(collector, loss) -> None:
    sources = collector.grad_source_list()
    tensors = [t for _, t in sources]
    grads = (torch.autograd.grad(loss, tensors, retain_graph=True, allow_unused=True)
             if tensors else ())
    collector.add_grads({name: (torch.zeros_like(t) if g is None else g).detach()
                         for (name, t), g in zip(sources, grads)})
    collector.grad_sources.clear()


def at_loss(collector, loss) -> None:
    _grads.note_loss(collector, loss)
    _file(collector, loss)


def step_with_grads(model, kind, step, args, kwargs, collector):
    collector.on_grad_source = _source
    with torch.enable_grad():
        result = step(model, *args, **kwargs)
    _grads.require_loss(collector, kind)
    return result


def value_and_grads(collector, loss_fn, args):
    collector.on_grad_source = _source
    result = loss_fn(*args)
    _file(collector, result[0] if isinstance(result, tuple) else result)
    return result
