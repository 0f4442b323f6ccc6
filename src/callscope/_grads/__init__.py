"""d loss / d point, one module per backend; the chosen backend's is `impl`.

Every backend module gives the same three functions, used by the in-step capture
(`kinds=("grad",)` in fit/evaluate) and by `cs.intermediate_grads`:

- `at_loss(collector, loss)`: called with every loss a step computes; the first
  goes through `note_loss`, which refuses a second one.
- `step_with_grads(model, kind, step, args, kwargs, collector)`: one train/test
  step that also files d loss / d source for every source.
- `value_and_grads(collector, loss_fn, args)`: runs `loss_fn(*args)` once and files
  the gradients; returns its result.

TensorFlow records the step on an outer persistent tape; torch calls
`torch.autograd.grad(..., retain_graph=True)` before the step's own `backward()`;
JAX differentiates zero perturbations added to each source. In a step, JAX learns
their shapes from `jax.eval_shape` (at trace time) and differentiates them in the
same `value_and_grad` as the weights; `cs.intermediate_grads` traces `loss_fn` once
to a jaxpr and differentiates that (see `_grads/jax.py`).

One loss per step: a step that calls `compute_loss` twice (an auxiliary loss, the
loss computed twice) raises on every backend, as Keras cannot tell which of its
losses the step trains on; the default steps call it once.
"""

from __future__ import annotations

import keras

BACKEND = keras.backend.backend()

if BACKEND == "jax":
    from callscope._grads import jax as impl
elif BACKEND == "tensorflow":
    from callscope._grads import tensorflow as impl
elif BACKEND == "torch":
    from callscope._grads import torch as impl
else:  # pragma: no cover - keras has no other backend callscope supports
    raise ImportError(f"callscope supports jax, tensorflow and torch. Received: {BACKEND}")


def unscaled(grad, scale):
    """d loss / d point from `grad`, that of the loss times `scale` (a loss scale),
    divided in float32 where the point is float16 or bfloat16, and kept in float32:
    cast back, what loss scaling kept would be lost again (float16 rounds values
    under 6e-5 and flushes those under 6e-8 to 0), and float16 cannot hold a scale
    above 65504. A wider gradient is divided as it is."""
    dtype = grad.dtype if keras.backend.standardize_dtype(grad.dtype) not in _HALF else "float32"
    return keras.ops.divide(keras.ops.cast(grad, dtype), keras.ops.cast(scale, dtype))


_HALF = ("float16", "bfloat16")


def require_loss(collector, kind: str) -> None:
    if collector.loss is None and collector.took_grads_inside:
        raise ValueError(
            f"cs.capture(kinds=('grad',)) found no loss in this {kind}_step: its "
            "`compute_loss` ran inside cs.intermediate_grads, which takes its own "
            "gradients of it. Take d loss / d point from that call's result (select "
            "the points there), and capture the other kinds. Received: "
            "cs.intermediate_grads in a step under a gradient capture"
        )
    if collector.loss is None:
        raise ValueError(
            f"cs.capture(kinds=('grad',)) found no loss in this {kind}_step: it takes "
            "d loss / d point from the loss that `compute_loss` returns. A custom step "
            "must compute its loss with `self.compute_loss(...)`. Received: no "
            "compute_loss call"
        )


def note_loss(collector, loss) -> None:
    """Keeps the step's loss; a second `compute_loss` in one step is an error."""
    if collector.loss is not None:
        raise ValueError(
            "cs.capture(kinds=('grad',)) takes d loss / d point from the one loss a "
            "train/test step computes with `compute_loss`, and this step called "
            "`compute_loss` more than once (an auxiliary loss, or the loss computed "
            "twice), so the gradients would not be those of the loss the step trains "
            "on. Compute the total loss with a single `self.compute_loss(...)` call "
            "(auxiliary terms can be added with `self.add_loss(...)` in a layer), or "
            "take the gradients yourself inside the step with "
            "`cs.intermediate_grads(model, loss_fn, ...)`. Received: a second "
            "compute_loss call in one step"
        )
    collector.loss = loss


__all__ = ["impl", "note_loss", "require_loss"]
