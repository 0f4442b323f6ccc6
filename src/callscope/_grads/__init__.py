"""d loss / d point, one module per backend; the chosen backend's is `impl`.

Every backend module gives the same three functions, used by the in-step capture
(`kinds=("grad",)` in fit/evaluate) and by `cs.intermediate_grads`:

- `at_loss(collector, loss)`: called with every loss a step computes.
- `step_with_grads(model, kind, step, args, kwargs, collector)`: one train/test
  step that also files d loss / d source for every source.
- `value_and_grads(collector, loss_fn, args)`: runs `loss_fn(*args)` once and files
  the gradients; returns its result.

TensorFlow records the step on an outer persistent tape; torch calls
`torch.autograd.grad(..., retain_graph=True)` before the step's own `backward()`;
JAX differentiates zero perturbations added to each source (shapes from
`jax.eval_shape`) in the same `value_and_grad` as the weights: one forward pass.
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


def require_loss(collector, kind: str) -> None:
    if collector.loss is None:
        raise ValueError(
            f"cs.capture(kinds=('grad',)) found no loss in this {kind}_step: it takes "
            "d loss / d point from the loss that `compute_loss` returns. A custom step "
            "must compute its loss with `self.compute_loss(...)`. Received: no "
            "compute_loss call"
        )


__all__ = ["impl", "require_loss"]
