"""JAX: d loss / d source is the gradient of a zero perturbation added to it.

In a step, the perturbations are differentiated in one `value_and_grad` with the
weights: one forward pass. Their shapes come from `jax.eval_shape` of the same
forward pass, which runs only when the step is traced. Values sown inside the
differentiated function leave it through its aux output.

`cs.intermediate_grads` runs `loss_fn` once: `jax.make_jaxpr` traces it with a
placeholder added to each source (so the trace learns the sources' shapes), the
placeholders are made inputs of the jaxpr, and `value_and_grad` differentiates
the jaxpr with respect to them. Where that rewrite does not apply (a source the
trace did not mark), it falls back to running `loss_fn` again with perturbations
of the shapes the trace found.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax import lax

from callscope import _backend, _grads, _keras_compat, _record


def at_loss(collector, loss) -> None:
    # The gradient comes from value_and_grad; the loss is kept to refuse a second one.
    _grads.note_loss(collector, loss)


def _zeros(collector, forward, *args) -> dict:
    """A zero perturbation per gradient source `forward(*args)` would record."""

    def probe(*args):
        with _record.collecting_for(collector.specs, resolved=collector.resolved) as inner:
            inner.manual, inner.scopes_applied = collector.manual, collector.scopes_applied
            forward(*args)
            return dict(inner.grad_source_list())

    shapes = jax.eval_shape(probe, *args)
    return {name: jnp.zeros(s.shape, s.dtype) for name, s in shapes.items()}


def _perturbed(collector, forward):
    """`forward` with each source replaced by source + perturbation."""

    def run(perturbations, *args):
        previous = collector.perturbations
        collector.perturbations = perturbations
        collector.grad_sources = {}
        try:
            return forward(*args)
        finally:
            collector.perturbations = previous

    return run


def step_with_grads(model, kind, step, args, kwargs, collector):
    if not _keras_compat.is_stock_step(model, kind):
        raise ValueError(
            f"cs.capture(kinds=('grad',)) on JAX differentiates through callscope's own "
            f"copy of Keras's {kind}_step, and `{type(model).__name__}` overrides "
            f"`{kind}_step`. Capture the other kinds, and take d loss / d point inside "
            "your own stateless step with `cs.intermediate_grads(model, loss_fn, ...)` "
            "(its points go in that call's result). Received: a custom "
            f"{kind}_step"
        )

    def differentiate(forward, trainable, training, scale):
        zeros = _zeros(collector, forward, trainable)
        perturbed = _perturbed(collector, forward)
        if training:
            grad_fn = jax.value_and_grad(lambda t, p: perturbed(p, t), argnums=(0, 1),
                                         has_aux=True)
            (loss, aux), (grads, source_grads) = grad_fn(trainable, zeros)
            if scale is not None:  # it differentiated loss * scale
                source_grads = {name: _grads.unscaled(g, scale)
                                for name, g in source_grads.items()}
        else:
            grad_fn = jax.value_and_grad(lambda p: perturbed(p, trainable), has_aux=True)
            (loss, aux), source_grads = grad_fn(zeros)
            grads = None
        collector.grad_sources = {}
        collector.add_grads(source_grads)
        return (loss, aux), grads

    return _keras_compat.jax_stock_step(model, kind, args[0], args[1], differentiate)


# --------------------------------------------------------------------------
# cs.intermediate_grads: one trace of `loss_fn`
# --------------------------------------------------------------------------
@contextlib.contextmanager
def _based(collector):
    """`loss_fn` runs here: the model's call under another trace (a jax.vmap or
    jax.jit inside it) is a loop point (`Collector.in_loop`)."""
    collector.base = _backend.trace_marker()
    try:
        yield
    finally:
        collector.base = None


def _assigning(collector, fn, *args):
    """`fn(*args)` run `_based`, with what it assigns and the losses it adds
    collected, not written into the variables or an outer scope (a tracer there
    breaks the model): its result, the collecting scope, and the values it
    collected, traced (`write_back` them once computed)."""
    with _based(collector), _keras_compat.collected_updates() as scope:
        result = fn(*args)
    return result, scope, scope.assigned_values()


def _split(result):
    return (result[0], result[1:]) if isinstance(result, tuple) else (result, ())


def value_and_grads(collector, loss_fn, args):
    collector.manual = True
    placeholders = []  # one per source, in the order the trace met them
    index = {}  # id(the value the forward pass goes on with) -> (position, that value)

    def mark(value):
        # `source + placeholder`, where the placeholder is the sole output of its own
        # equation: `_as_inputs` turns that equation into an input of the jaxpr.
        placeholder = lax.optimization_barrier(jnp.zeros_like(value))
        marked = lax.add(value, placeholder)
        index[id(marked)] = (len(placeholders), marked)  # held: the id stays unique
        placeholders.append(placeholder)
        return marked

    collected = []  # the scope that collected what `loss_fn` assigns and adds

    def traced(*args):
        result, scope, values = _assigning(collector, loss_fn, *args)
        collected[:] = [scope]
        return result, collector.records, values, placeholders

    previous = collector.on_grad_source
    collector.on_grad_source = mark
    try:
        closed, shapes = jax.make_jaxpr(traced, return_shape=True)(*args)
    finally:
        collector.on_grad_source = previous
    def position(value):  # of the placeholder of a source; None: not marked here
        found = index.get(id(value))
        return found[0] if found is not None and found[1] is value else None

    sources = collector.grad_source_list()  # (name, marked tracer of the trace above)
    order = [position(value) for _, value in sources]
    out_tree = jax.tree.structure(shapes[:3])
    fn = None if None in order else _as_inputs(closed, out_tree.num_leaves)
    if fn is None:
        return _fallback(collector, loss_fn, args, sources)
    leaves = jax.tree.leaves(args)  # make_jaxpr's inputs, in order

    def forward(perturbations):
        result, records, values = jax.tree.unflatten(out_tree, fn(*leaves, *perturbations))
        loss, aux = _split(result)
        return loss, (aux, records, values)

    zeros = [jnp.zeros(s.shape, s.dtype) for s in shapes[3]]
    (loss, (aux, records, values)), grads = jax.value_and_grad(forward, has_aux=True)(zeros)
    _keras_compat.write_back(collected[0], values)  # as a direct call assigns them
    collector.records = {}
    collector.merge(records)  # the outputs, as values (not tracers of the trace)
    collector.grad_sources = {}
    collector.add_grads({name: grads[i] for (name, _), i in zip(sources, order)})
    return (loss, *aux) if aux else loss


def _as_inputs(closed, kept: int):
    """The closed jaxpr of `traced` as a function `(*arg leaves, *placeholders) ->
    its first `kept` outputs`, each placeholder an input; None if the jaxpr is not
    as expected (then the caller falls back)."""
    try:
        return _rewritten(closed, kept)
    except (AttributeError, ImportError, TypeError, ValueError):  # another jax's API
        return None


def _rewritten(closed, kept: int):
    from jax.extend.core import ClosedJaxpr, Var, jaxpr_as_fun

    jaxpr = closed.jaxpr
    placeholders = jaxpr.outvars[kept:]
    defined_by = {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
    drop = set()
    for var in placeholders:  # each the sole output of its own optimization_barrier
        i = defined_by.get(var) if isinstance(var, Var) else None
        if (i is None or i in drop or len(jaxpr.eqns[i].outvars) != 1
                or jaxpr.eqns[i].primitive.name != "optimization_barrier"):
            return None
        drop.add(i)
    rewritten = jaxpr.replace(
        invars=[*jaxpr.invars, *placeholders], outvars=jaxpr.outvars[:kept],
        eqns=[eqn for i, eqn in enumerate(jaxpr.eqns) if i not in drop],
    )
    return jaxpr_as_fun(ClosedJaxpr(rewritten, closed.consts))


def _fallback(collector, loss_fn, args, sources):
    """`loss_fn` run again under `value_and_grad`, with perturbations of the sources'
    shapes the trace found (a second Python run of it)."""
    zeros = {name: jnp.zeros(value.shape, value.dtype) for name, value in sources}
    collector.records, collector.grad_sources = {}, {}
    del collector.tree[:]
    collector.runs.clear()
    collector.calls.clear()

    collected = []

    def forward(perturbations):
        result, scope, values = _assigning(
            collector, _perturbed(collector, loss_fn), perturbations, *args)
        collected[:] = [scope]
        loss, aux = _split(result)
        return loss, (aux, collector.records, values)

    (loss, (aux, records, values)), grads = jax.value_and_grad(forward, has_aux=True)(zeros)
    _keras_compat.write_back(collected[0], values)
    reached = {name for name, _ in collector.grad_source_list()}
    if reached != set(zeros):  # the sources were not perturbed
        raise RuntimeError(
            "cs.intermediate_grads ran `loss_fn` twice on JAX (its trace could not be "
            "differentiated as it is), and the second run did not reach the points "
            "the first did: their gradients are unknown. Make `loss_fn` a pure "
            "function that calls the model directly (not through a function "
            "compiled earlier). Received: points "
            f"{sorted(set(zeros) ^ reached)}")
    collector.records = {}
    collector.merge(records)
    collector.grad_sources = {}
    collector.add_grads(grads)
    return (loss, *aux) if aux else loss
