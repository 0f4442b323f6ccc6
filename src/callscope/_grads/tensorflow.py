"""TensorFlow: one persistent tape around the forward pass, one `tape.gradient`."""

from __future__ import annotations

import contextlib

import tensorflow as tf

from callscope import _grads


@contextlib.contextmanager
def _recording(collector):
    with tf.GradientTape(persistent=True) as tape:
        collector.on_grad_source = lambda v: (tape.watch(v), v)[1]
        yield tape


def _file(collector, tape, loss) -> None:
    sources = collector.grad_source_list()
    grads = tape.gradient(loss, [t for _, t in sources],
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    collector.add_grads({name: g for (name, _), g in zip(sources, grads)})


def at_loss(collector, loss) -> None:
    collector.loss = loss  # differentiated after the step, on the outer tape


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
