"""The few backend facts the engine needs that `keras.ops` does not give.

Is this Python running inside a trace (a compiled function being built), and how
to place a run's value in a JAX step's state. The framework of the chosen
backend is imported here on first use, never another.
"""

from __future__ import annotations

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


def is_tracing_now() -> bool:
    """`is_tracing` without inputs to look at: is a compiled function being built?"""
    if BACKEND == "jax":
        import jax

        return isinstance(jax.numpy.zeros(()), jax.core.Tracer)  # staged while tracing
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


def place_like(array, like):
    """`array` as a fresh JAX buffer placed like `like` (same sharding): Keras
    donates a step's state, so each step gets its own."""
    import jax

    sharding = getattr(like, "sharding", None)
    return jax.device_put(array, sharding) if sharding is not None else jax.numpy.asarray(array)
