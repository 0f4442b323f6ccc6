"""torch: d loss / d source from the backward pass of the step, or from one of its own.

In Keras's own `train_step`, hooks on the loss and on every source take their
gradients during the step's `loss.backward()`: no second backward pass (it cost
about a third of a step). The loss's hook gives what backward started from (1,
or the optimizer's loss scale), by which the sources' gradients are divided:
each is then d loss / d source, as Keras's unscaled loss defines it. Elsewhere
(a test step, a custom `train_step` whose backward may not be of this loss, a
model without trainable weights that never calls backward, or inside
`torch.compile`), `torch.autograd.grad(loss, sources, retain_graph=True)` runs
before the step's own backward, so the weights' gradients are untouched. Keras
runs test steps under `no_grad`; gradients of an evaluate re-enable it.

Each source is a node of its own (a view of the value, or a leaf that requires
grad): a layer that returns its input unchanged (`Identity`) then gets the
gradient of the paths through its output only, as on JAX and TensorFlow.
"""

from __future__ import annotations

import keras
import torch

from callscope import _grads, _keras_compat


def _source(value):
    return value.view_as(value) if value.requires_grad else value.detach().requires_grad_()


def _file(collector, loss) -> None:
    sources = collector.grad_source_list()
    tensors = [t for _, t in sources]
    # A loss that no weight and no source is on the path to (a frozen model, the
    # loss of another output) has no graph: each gradient is then 0, as on JAX/TF.
    try:
        grads = (torch.autograd.grad(loss, tensors, retain_graph=True, allow_unused=True)
                 if tensors and loss.requires_grad else [None] * len(tensors))
    except RuntimeError as error:
        if "modified by an inplace operation" not in str(error):
            raise
        points = sorted({name.split("|", 1)[1].rsplit("|", 1)[0] for name, _ in sources})
        raise RuntimeError(IN_PLACE.format(points=points)) from error
    collector.add_grads({name: (torch.zeros_like(t) if g is None else g).detach()
                         for (name, t), g in zip(sources, grads)})
    collector.grad_sources.clear()


IN_PLACE = (
    "callscope could not take the gradients of {points}: the backward pass needs a "
    "value that a layer changed in place after the forward pass read it (a stateful "
    "RNN's state, which Keras assigns in place on torch, as stock Keras's torch `fit` "
    "fails there alike; or a layer's own in-place operation, `x += 1`). The call "
    "stopped at this step, whose forward pass ran (a stateful layer's state moved). "
    "Capture these gradients on JAX or TensorFlow, with `stateful=False` layers, or "
    "without in-place operations; or capture outputs only (kinds=('output',)). "
    "Received: points {points}")


class _Hooks:
    """The gradients one backward pass gives the loss and each source."""

    def __init__(self, scaled: bool):
        self.scaled = scaled  # divide by what backward started from (the loss scale)
        self.loss = None  # what backward started from: 1, or the loss scale
        self.sources: dict[str, torch.Tensor] = {}
        self.tensors: list[tuple[str, torch.Tensor]] = []

    def watch(self, collector, loss) -> None:
        self.tensors = collector.grad_source_list()
        collector.grad_sources.clear()
        loss.register_hook(self._at_loss)
        for name, tensor in self.tensors:
            tensor.register_hook(lambda grad, name=name: self.sources.__setitem__(name, grad))

    def _at_loss(self, grad) -> None:
        self.loss = grad

    def file(self, collector) -> None:
        if self.loss is None:  # Keras's train_step always calls backward (3.15.1)
            raise RuntimeError(
                "callscope found no backward pass through the loss in Keras's own "
                "train_step, so the gradients of the captured points are unknown. "
                "Please report this with your Keras version. Received: keras "
                f"{keras.__version__}")

        def unscaled(grad):
            return _grads.unscaled(grad, self.loss) if self.scaled else grad

        collector.add_grads({
            name: unscaled(self.sources[name]).detach()
            if name in self.sources else unscaled(torch.zeros_like(tensor)).detach()
            for name, tensor in self.tensors})
        self.release()

    def release(self) -> None:
        """Lets go of the step's tensors. The hooks stay on them (torch keeps a
        hook in C++, where Python's collector cannot see it), and refer to this
        object: had it kept the tensors, each step's graph and activations would
        have stayed alive in an uncollectable cycle (16 MiB a step, measured)."""
        self.loss, self.sources, self.tensors = None, {}, []


def at_loss(collector, loss) -> None:
    _grads.note_loss(collector, loss)
    if collector.grad_hooks is not None:
        collector.grad_hooks.watch(collector, loss)
    else:
        _file(collector, loss)


def step_with_grads(model, kind, step, args, kwargs, collector):
    collector.on_grad_source = _source
    if (kind == "train" and _keras_compat.is_stock_step(model, kind)
            and model.optimizer is not None and model.trainable_weights
            and not torch.compiler.is_compiling()):
        collector.grad_hooks = _Hooks(_keras_compat.scales_loss(model.optimizer))
    try:
        with torch.enable_grad():
            result = step(model, *args, **kwargs)
        _grads.require_loss(collector, kind)
        if collector.grad_hooks is not None:
            collector.grad_hooks.file(collector)
        # Sources the step made after its loss (a custom train_step that calls the
        # model again, for a metric) are not on the loss's path: 0, as on TF.
        collector.add_grads({name: torch.zeros_like(t).detach()
                             for name, t in collector.grad_source_list()})
        collector.grad_sources.clear()
    finally:
        if collector.grad_hooks is not None:
            collector.grad_hooks.release()  # a failed step too
            collector.grad_hooks = None
    return result


def value_and_grads(collector, loss_fn, args):
    if torch.is_inference_mode_enabled():  # enable_grad cannot undo it: 0 everywhere
        raise RuntimeError(
            "cs.intermediate_grads cannot differentiate inside torch.inference_mode(), "
            "where torch records no graph (every gradient would read 0). Call it "
            "outside, or inside torch.no_grad(), where it re-enables gradients. "
            "Received: torch.is_inference_mode_enabled()=True")
    collector.on_grad_source = _source
    with torch.enable_grad():  # also inside the caller's `torch.no_grad()`
        result = loss_fn(*args)
        _file(collector, result[0] if isinstance(result, tuple) else result)
    return result
