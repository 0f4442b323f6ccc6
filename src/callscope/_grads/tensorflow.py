"""TensorFlow: d loss / d source from the step's own backward pass where it reaches
the source, from one `tape.gradient` on an outer persistent tape elsewhere.

Each source is an identity of the value, watched on the outer tape: a layer that
returns its input unchanged (`Identity`) is then a source of its own, whose
gradient counts only the paths through its output, as on JAX and torch.

In Keras's own `train_step` (an optimizer that does not scale the loss, and
trainable weights), the identity has a custom gradient that keeps what arrives at
it while the step's `tape.gradient(loss, trainable_weights)` runs: d loss / d
source, summed over every consumer, as the outer tape would give it, without a
second backward pass. Compiled, TF's graph optimizer had already shared the two
passes' work (no measurable difference in the bench's fit); run eagerly, the
second pass cost 18% (`run_eagerly=True` fit: 2.51x -> 2.09x plain fit). It
keeps only what arrives after the loss is computed (`at_loss`), so a gradient a
layer takes inside its own forward pass is never mistaken for it.

A source the step's backward does not pass through (no trainable weight before
it: a weightless or frozen prefix, or a layer that returns the model's inputs
unchanged; or a loss that does not depend on it), or one it reached more than
once, is differentiated on the outer tape, as every source is in a test step, a
custom `train_step` (whose backward may be of another loss, or taken twice) and
under a scaled loss (a `LossScaleOptimizer`, an optimizer's `loss_scale_factor`),
where a float16 source takes the gradient of the scaled loss, as the step's own
backward does, unscaled into float32 (`_file`). In a compiled step which sources the backward
reached is known while tracing, so the outer tape costs nothing at run time
unless a source needs it.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from callscope import _grads, _keras_compat
from callscope._record import split_record


class _Backward:
    """What the step's own backward pass gives each source, once the loss exists."""

    def __init__(self):
        self.armed = False  # true from the loss until `_file`, after the step
        self.arrived: dict[int, list] = {}  # id(source) -> gradients that arrived

    def source(self, value):
        arrived = self.arrived

        @tf.custom_gradient
        def identity(x):
            def grad(upstream):
                if self.armed:
                    arrived[id(out)].append(upstream)
                return upstream

            return tf.identity(x), grad

        out = identity(value)
        arrived[id(out)] = []
        return out

    def taken(self, source):
        """d loss / d `source` from the step's backward, or None where it has none."""
        arrived = self.arrived.get(id(source), ())
        return tf.convert_to_tensor(arrived[0]) if len(arrived) == 1 else None


def _stock_backward(model, kind) -> bool:
    """Does this step differentiate exactly its loss, unscaled, in one backward?"""
    return (kind == "train" and _keras_compat.is_stock_step(model, kind)
            and model.optimizer is not None
            and not _keras_compat.scales_loss(model.optimizer)
            and bool(model.trainable_weights))


@contextlib.contextmanager
def _recording(collector, backward=None):
    collector.bypassed = _Bypassed(backward)  # the sources the loss went around

    def source(value):
        logits = _keras_compat.keras_logits(value)
        if backward is not None and isinstance(value, tf.Tensor) and value.dtype.is_floating:
            value = backward.source(value)
        else:
            value = tf.identity(value)
        tape.watch(value)
        if logits is not None:
            _keras_compat.set_keras_logits(value, _tied(logits, value, collector.bypassed))
        return value

    with tf.GradientTape(persistent=True) as tape:
        collector.on_grad_source = source
        yield tape


class _Bypassed:
    """The ids of the sources whose logits a gradient of the loss went through:
    noted only while the loss's own gradient is taken (the stock backward, once
    armed, or `_file`'s), not a gradient a custom step takes of something else."""

    def __init__(self, backward):
        self.backward, self.taking, self.ids = backward, False, set()

    def note(self, source) -> None:
        if self.taking or (self.backward is not None and self.backward.armed):
            self.ids.add(id(source))


def _tied(logits, source, bypassed: _Bypassed):
    """`logits`, kept on a source made of a sigmoid's or softmax's output (an
    identity of it), so that a crossentropy goes on computing from them as the
    step does without the capture (dropped, a saturated row's loss read 16.03 for
    40, and the weights trained on it). No gradient reaches the source that way:
    where the loss takes this path, the source is noted (`bypassed`)."""

    @tf.custom_gradient
    def tie(z, _):
        def grad(upstream):
            bypassed.note(source)
            return upstream, tf.zeros_like(source)

        return tf.identity(z), grad

    return tie(logits, source)


BYPASSED = (
    "d loss / d `{point}` is not taken on TensorFlow: `{point}` is a sigmoid's or "
    "softmax's output, and Keras computes the crossentropy from the logits beneath it "
    "(exact where the probability saturates), so the loss does not pass through it. "
    "Take the gradient at the logits: give the layer no activation and follow it "
    "with `keras.layers.Activation`, whose input is then a point (a glob such as `*` "
    "leaves such points out of `grad`). Received: select={point!r} with kinds "
    "including 'grad'")


def _file(collector, tape, loss, backward=None, scale=None) -> None:
    sources = collector.grad_source_list()
    grads = {}
    if backward is not None:
        backward.armed = False  # the outer tape below runs the same custom gradients
        for name, tensor in sources:
            taken = backward.taken(tensor)
            if taken is not None:
                grads[name] = taken
    rest = [(name, t) for name, t in sources if name not in grads]
    # Under a scaled loss, a float16 (or bfloat16) source as the step's own backward
    # takes it: of the scaled loss, so that what float16 rounds away or flushes to
    # 0 is kept, unscaled into float32 (on a step whose scaled gradients overflow,
    # one Keras skips, it reads inf or NaN, as on JAX and torch).
    halves = {name for name, t in rest if t.dtype in (tf.float16, tf.bfloat16)
              } if scale is not None else set()
    half = [(name, t) for name, t in rest if name in halves]
    plain = [(name, t) for name, t in rest if name not in halves]
    for group, seed in ((plain, None), (half, scale)):
        if group:
            collector.bypassed.taking = True
            try:
                found = _gradient(tape, loss, [t for _, t in group],
                                  None if seed is None else tf.cast(seed, loss.dtype))
            finally:
                collector.bypassed.taking = False
            grads.update((name, tf.convert_to_tensor(g) if seed is None
                          else _grads.unscaled(g, seed)) for (name, _), g in zip(group, found))
    around = {name for name, t in sources if id(t) in collector.bypassed.ids}
    for name in around:
        index, point, _ = split_record(name)
        if collector.specs[int(index)].names(point):  # (a glob leaves it out)
            raise ValueError(BYPASSED.format(point=point))
    collector.add_grads({name: grads[name] for name, _ in sources if name not in around})


def _gradient(tape, loss, tensors, seed=None):
    return tape.gradient(loss, tensors, output_gradients=seed,
                         unconnected_gradients=tf.UnconnectedGradients.ZERO)


def at_loss(collector, loss) -> None:
    _grads.note_loss(collector, loss)
    if collector.grad_hooks is not None:
        collector.grad_hooks.armed = True  # what arrives from now on is d loss / d source


def step_with_grads(model, kind, step, args, kwargs, collector):
    backward = _Backward() if _stock_backward(model, kind) else None
    collector.grad_hooks = backward
    # What the step's `scale_loss` multiplies its loss by, read before the step
    # (whose `apply` may change a LossScaleOptimizer's scale).
    scale = (model.optimizer.scale_loss(tf.ones((), "float32"))
             if kind == "train" and _keras_compat.scales_loss(model.optimizer) else None)
    try:
        with _recording(collector, backward) as tape:
            result = step(model, *args, **kwargs)
        _grads.require_loss(collector, kind)
        _file(collector, tape, collector.loss, backward, scale)
    finally:
        collector.grad_hooks = None
    return result


def value_and_grads(collector, loss_fn, args):
    with _recording(collector) as tape:
        result = loss_fn(*args)
    loss = result[0] if isinstance(result, tuple) else result
    _file(collector, tape, loss)
    return result
