"""How captured values leave a compiled step, per backend.

A step's result is, per backend and kind:

| backend       | train / test      | predict               |
|---------------|-------------------|-----------------------|
| tensorflow    | `logs`            | `outputs`             |
| torch         | `logs`            | `outputs`             |
| jax           | `(logs, state)`   | `(outputs, ntv)`      |

`attach` adds the captured values to it (`logs[SOWN]`, or `{OUTPUTS: outputs,
SOWN: ...}` for predict), and `popper` wraps the made `*_function` so that Keras's
loop gets back exactly what the step would have returned without capture.

On JAX the default `train_step` differentiates `compute_loss_and_updates`, whose
aux output is a fixed 4-tuple; values sown inside it are tracers of the
differentiated trace. `smuggle` carries them out as one extra entry at the end of
the non-trainable-variables list, and `unsmuggle` takes it off again before the
state reaches Keras.
"""

from __future__ import annotations

import keras

from callscope import _collector, _keras_compat
from callscope._collector import OUTPUTS, SOWN

BACKEND = keras.backend.backend()
_JAX = BACKEND == "jax"
_SMUGGLED = "__callscope_smuggled__"


def smuggle(aux, values):
    unscaled_loss, y_pred, non_trainable, metrics = aux
    return unscaled_loss, y_pred, [*non_trainable, {_SMUGGLED: values}], metrics


def unsmuggle(result, collector):
    """Takes smuggled records off a JAX step's state and gives them to `collector`."""
    if not _JAX or not isinstance(result, tuple) or len(result) != 2:
        return result
    main, state = result
    if not isinstance(state, tuple) or len(state) < 2 or not isinstance(state[1], list):
        return result
    non_trainable = state[1]
    if non_trainable and isinstance(non_trainable[-1], dict) and _SMUGGLED in non_trainable[-1]:
        collector.merge(non_trainable[-1][_SMUGGLED])
        state = (state[0], non_trainable[:-1], *state[2:])
    return main, state


def attach(kind, result, sown):
    main, rest = (result[0], result[1:]) if _JAX else (result, ())
    if kind == "predict":
        main = {OUTPUTS: main, SOWN: sown}
    else:
        main = {**main, SOWN: sown}
    return (main, *rest) if _JAX else main


def pop_sown(kind, result, run):
    """Takes the captured values off a made function's result; hands them to `run`.

    Keras's loop gets back exactly what the step would have returned without
    capture. `run` is the call in effect in the caller's thread.
    """
    main, rest = (result[0], result[1:]) if _JAX else (result, ())
    if not isinstance(main, dict) or SOWN not in main:
        return result
    sown = main[SOWN]
    if kind == "predict":
        main = main[OUTPUTS]
    else:
        main = {k: v for k, v in main.items() if k != SOWN}
    if run is not None:
        run.sink(kind, sown)
    return (main, *rest) if _JAX else main


def check_capture_supported(model, method, specs=()):
    """Raises where a capture would silently lose or average rows, or has no loss."""
    if any("grad" in spec.kinds for spec in specs):
        if method not in ("fit", "evaluate", "train_on_batch", "test_on_batch"):
            raise ValueError(
                "cs.capture(kinds=('grad',)) needs a loss: gradients come from `fit`, "
                "`evaluate`, `train_on_batch` and `test_on_batch` under the compiled "
                f"loss. `{method}` has none. Capture `output` there instead. "
                f"Received: kinds={specs[0].kinds!r} in {method}"
            )
        if not getattr(model, "compiled", False):
            raise ValueError(
                "cs.capture(kinds=('grad',)) needs a compiled model: call "
                "`model.compile(optimizer=..., loss=...)` first. Received: an "
                "uncompiled model"
            )
    if method not in ("fit", "evaluate", "train_on_batch", "test_on_batch"):
        return
    steps = getattr(model, "steps_per_execution", 1) or 1
    if method in ("fit", "evaluate") and steps > 1:
        raise ValueError(
            f"cs.capture cannot run inside `{method}` with steps_per_execution={steps}: "
            "Keras keeps only the last step's outputs of each execution in train and "
            "test, so the other steps' captures would be lost. Compile with "
            "steps_per_execution=1 while capturing (predict concatenates every step and "
            f"works with any value). Received: steps_per_execution={steps}"
        )
    replicas = _keras_compat.replicas(model)
    if replicas > 1:
        raise ValueError(
            f"cs.capture cannot run inside `{method}` under a tf.distribute strategy with "
            f"{replicas} replicas: Keras averages the replicas' step outputs in train and "
            "test, which would silently mix their rows. Capture with `predict` (it "
            "concatenates replicas), or outside the strategy. "
            f"Received: num_replicas_in_sync={replicas}"
        )


# --------------------------------------------------------------------------
# Gradients with respect to intermediates
# --------------------------------------------------------------------------
# TensorFlow: an outer persistent tape around the whole step records the forward
#   pass; the loss hook keeps the loss; after the step, one `tape.gradient` call.
# torch: the loss hook calls `torch.autograd.grad(loss, sources, retain_graph=True)`
#   before the step's own `backward()`; evaluate re-enables grad (Keras runs test
#   steps under `no_grad`).
# JAX: a library-owned step differentiates the loss with respect to zero
#   perturbations added to each source, found by `jax.eval_shape`, in the same
#   `value_and_grad` as the weights: one forward pass.
def loss_hook(loss):
    """Called with every loss a step computes; takes intermediate gradients."""
    collector = _collector.active_collector()
    if collector is None or not collector.wants_grads or collector.manual or loss is None or _JAX:
        return loss
    collector.loss = loss
    if BACKEND == "torch":
        import torch

        sources = collector.grad_source_list()
        tensors = [t for _, t in sources]
        grads = torch.autograd.grad(loss, tensors, retain_graph=True, allow_unused=True)
        collector.add_grads({
            name: (torch.zeros_like(t) if g is None else g).detach()
            for (name, t), g in zip(sources, grads)
        })
        collector.grad_sources.clear()
    return loss


def step_with_grads(model, kind, step, args, kwargs, collector):
    """Runs one train/test step and files d loss / d source for every grad source."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape(persistent=True) as tape:
            collector.on_grad_source = lambda v: (tape.watch(v), v)[1]
            result = step(model, *args, **kwargs)
        _require_loss(collector, kind)
        sources = collector.grad_source_list()
        grads = tape.gradient(collector.loss, [t for _, t in sources],
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        collector.add_grads({name: g for (name, _), g in zip(sources, grads)})
        return result
    if BACKEND == "torch":
        import torch

        with torch.enable_grad():
            result = step(model, *args, **kwargs)
        _require_loss(collector, kind)
        return result
    if not _keras_compat.is_stock_jax_step(model, kind):
        raise ValueError(
            f"cs.capture(kinds=('grad',)) on JAX differentiates through callscope's own "
            f"copy of Keras's {kind}_step, and `{type(model).__name__}` overrides "
            f"`{kind}_step`. Inside your own stateless step, use "
            "`cs.intermediate_grads(model, loss_fn, ...)`. Received: a custom "
            f"{kind}_step"
        )
    return _jax_step_with_grads(model, kind, args[0], args[1], collector)


def _require_loss(collector, kind):
    if collector.loss is None:
        raise ValueError(
            f"cs.capture(kinds=('grad',)) found no loss in this {kind}_step: it takes "
            "d loss / d point from the loss that `compute_loss` returns. A custom step "
            "must compute its loss with `self.compute_loss(...)`. Received: no "
            "compute_loss call"
        )


def _jax_step_with_grads(model, kind, state, data, collector):
    import jax
    import jax.numpy as jnp

    training = kind == "train"
    if training:
        trainable, non_trainable, optimizer_vars, metrics_vars = state
    else:
        trainable, non_trainable, metrics_vars = state
        optimizer_vars = None
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)

    def forward(trainable, perturbations):
        previous = collector.perturbations
        collector.perturbations = perturbations
        collector.grad_sources = {}
        try:
            return model.compute_loss_and_updates(
                trainable, non_trainable, metrics_vars, x, y, sample_weight,
                training=training, optimizer_variables=optimizer_vars,
            )
        finally:
            collector.perturbations = previous

    def probe(trainable):
        with _collector.collecting_for(collector.specs) as inner:
            model.compute_loss_and_updates(
                trainable, non_trainable, metrics_vars, x, y, sample_weight,
                training=training, optimizer_variables=optimizer_vars,
            )
            return dict(inner.grad_source_list())

    shapes = jax.eval_shape(probe, trainable)
    zeros = {name: jnp.zeros(s.shape, s.dtype) for name, s in shapes.items()}
    if training:
        grad_fn = jax.value_and_grad(forward, argnums=(0, 1), has_aux=True)
        (loss, aux), (grads, source_grads) = grad_fn(trainable, zeros)
    else:
        grad_fn = jax.value_and_grad(lambda p: forward(trainable, p), has_aux=True)
        (loss, aux), source_grads = grad_fn(zeros)
    collector.grad_sources = {}
    collector.add_grads(source_grads)
    unscaled_loss, y_pred, non_trainable, metrics_vars = aux
    if training:
        trainable, optimizer_vars = model.optimizer.stateless_apply(
            optimizer_vars, grads, trainable
        )
    logs, metrics_vars = _keras_compat.update_jax_metrics(
        model, metrics_vars, unscaled_loss, x, y, y_pred, sample_weight
    )
    if training:
        return logs, (trainable, non_trainable, optimizer_vars, metrics_vars)
    return logs, (trainable, non_trainable, metrics_vars)
