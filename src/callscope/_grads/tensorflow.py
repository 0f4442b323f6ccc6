"""TensorFlow: one persistent tape around the forward pass, one `tape.gradient`.

Each source is a `tf.identity` of the value, watched: a layer that returns its
input unchanged (`Identity`) is then a source of its own, whose gradient counts
only the paths through its output, as on JAX and torch.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from callscope import _grads


@contextlib.contextmanager
def _recording(collector):
    def source(value):
        value = tf.identity(value)
        tape.watch(value)
        return value

    with tf.GradientTape(persistent=True) as tape:
        collector.on_grad_source = source
        yield tape


def _file(collector, tape, loss) -> None:
    sources = collector.grad_source_list()
    grads = tape.gradient(loss, [t for _, t in sources],
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    collector.add_grads({name: g for (name, _), g in zip(sources, grads)})


def at_loss(collector, loss) -> None:
    _grads.note_loss(collector, loss)  # differentiated after the step, on the outer tape


def step_with_grads(model, kind, step, args, kwargs, collector):
    with _recording(collector) as tape:
        result = step(model, *args, **kwargs)
    _grads.require_loss(collector, kind)
    _file(collector, tape, collector.loss)
    return result


def value_and_grads(collector, loss_fn, args):
    with _recording(collector) as tape:
        result = loss_fn(*args)
    loss = result[0] if isinstance(result, tuple) else result
    _file(collector, tape, loss)
    return result
