"""The few backend facts the engine needs that `keras.ops` does not give.

Is this Python running inside a trace (a compiled function being built), and how
to put a run's values into a JAX step's state. The framework of the chosen
backend is imported here on first use, never another.
"""

from __future__ import annotations

from typing import Any

import keras

BACKEND = keras.backend.backend()


def is_tracing(leaves) -> bool:
    """True inside a compiled function's Python: a JAX trace (tracer inputs), a
    `tf.function` graph, or `torch.compile`'s dynamo."""
    if BACKEND == "jax":
        import jax

        return any(isinstance(leaf, jax.core.Tracer) for leaf in leaves)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return not tf.executing_eagerly()
    if BACKEND == "torch":
        import torch

        return bool(torch.compiler.is_compiling())
    return False


def is_symbolic(leaves) -> bool:
    """True for Keras's shape-only calls: KerasTensors, and on torch the meta
    tensors that `compute_output_spec` runs the model on (eagerly)."""
    for leaf in leaves:
        if isinstance(leaf, keras.KerasTensor):
            return True
        if BACKEND == "torch" and getattr(leaf, "is_meta", False):
            return True
    return False


def with_state_values(state: tuple, values: tuple) -> tuple:
    """A JAX step's `state` with non-trainable entries replaced: ((index, array),).

    Each array is placed like the entry it replaces (same sharding), as a fresh
    buffer, since Keras donates the state to the step.
    """
    import jax

    trainable, non_trainable, *rest = state
    non_trainable = list(non_trainable)
    for index, array in values:
        like: Any = non_trainable[index]
        sharding = getattr(like, "sharding", None)
        non_trainable[index] = (jax.device_put(array, sharding) if sharding is not None
                                else jax.numpy.asarray(array))
    return (trainable, non_trainable, *rest)
