"""Gradients with respect to intermediates, for users who write their own steps.

Inside `fit`/`evaluate`, `cs.capture(model, kinds=("grad",))` does this for you
(see `_steps.py`). In a custom `train_step` or a custom training loop, call
`cs.intermediate_grads(model, loss_fn, *args, select=...)`: it runs `loss_fn` once,
records the selected points, and returns d loss / d point for each.

- JAX: `loss_fn` must be a pure function of its arguments (the stateless style).
  It is traced once (`jax.make_jaxpr`), and the jaxpr is differentiated.
- torch: the caller can still call `loss.backward()` afterwards.

A selection that matches no point `loss_fn` runs through is an error.

How each backend differentiates is in `_grads`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import keras

from callscope import _backend, _capturing, _grads, _keras_compat, _record, _scope, _steps
from callscope._points import (Spec, escaped, key_name, nearest, normalize_select,
                               single_calls_hint, tree_points, unmatched_globs)

_BACKEND = keras.backend.backend()


class IntermediateGrads(NamedTuple):
    """What `cs.intermediate_grads` returns."""

    loss: Any
    aux: Any  # the second element when `loss_fn` returns (loss, aux), else None
    grads: dict  # "point:grad" -> d loss / d point
    outputs: dict  # "point:output" -> the point's value


def intermediate_grads(
    model, loss_fn: Callable, *args: Any, select: str | list[str] | Callable | None = None
) -> IntermediateGrads:
    """Runs `loss_fn(*args)` once; returns the loss and d loss / d each selected point.

    Args:
        model: the model whose layers `select` picks from (any Keras model).
        loss_fn: returns a scalar loss, or `(loss, aux)`. It runs the model.
        *args: passed to `loss_fn` (on JAX, everything it differentiates through).
        select: as in `cs.capture`: globs or `(point, layer) -> bool`; by default
            every sown point.

    Returns:
        `IntermediateGrads(loss, aux, grads, outputs)`: the loss as `loss_fn`
        returned it (on torch it keeps its graph, so `result.loss.backward()` still
        trains the weights; `.detach()` it to read it), `grads` keyed `point:grad`,
        without a graph, and `outputs` keyed `point:output`: the forward pass's own
        values, so a loss of yours built from them (inside your tape, or torch's
        autograd) trains through them; on torch, `.detach()` one to read it.

    Raises:
        ValueError: `select` matched no point that `loss_fn` ran through.

    Example:

    >>> import keras, numpy as np, callscope as cs
    >>> class Block(keras.layers.Layer):
    ...     def call(self, x):
    ...         return cs.sow(self, "h", x * 3.0)
    >>> model = cs.Sequential([keras.Input((2,)), Block(name="block")], name="m")
    >>> x = keras.ops.convert_to_tensor(np.ones((1, 2), "float32"))
    >>> if keras.backend.backend() == "jax":
    ...     tv = [v.value for v in model.trainable_variables]
    ...     ntv = [v.value for v in model.non_trainable_variables]
    ...     fn = lambda x: keras.ops.sum(model.stateless_call(tv, ntv, x)[0] ** 2)
    ... else:
    ...     fn = lambda x: keras.ops.sum(model(x) ** 2)
    >>> result = cs.intermediate_grads(model, fn, x)
    >>> keras.ops.convert_to_numpy(result.grads["m/block/h:grad"])  # d sum(h^2)/dh = 2h
    array([[6., 6.]], dtype=float32)
    """
    _steps.check_not_rematerialized(model)
    spec = Spec(normalize_select(select), ("output", "grad"), None, 1, None, owner=id(model))
    _record.install_wrappers(model)
    # Outside a step (a step applies its own scopes), the caller's open cs.patch
    # scopes of `model` apply here as in a direct `model(x)`: the model's calls in
    # `loss_fn` see an active collector, and skip their scopes
    # (`check_scopes_applied`).
    direct = _record.active_collector() is None and _record.active_patches() is None
    patches = _open_patches(model) if direct else ()
    # (Whatever `args` hold: a `loss_fn` may close over the traced values.)
    if patches and _backend.is_tracing_now():
        raise RuntimeError(
            "cs.patch cannot change a function it did not compile: cs.intermediate_grads "
            "ran inside your own `jax.jit`/`tf.function`/`torch.compile` while a "
            f"cs.patch scope of `{model.name}` was open, and a cached run of that "
            "function would go on patching after the scope closed. Call it outside "
            "that function under the scope, or make the change inside `loss_fn`. "
            f"Received: a traced cs.intermediate_grads under patches of "
            f"{[point for _, point, _ in patches]}")
    if patches and hasattr(model, "_cs_check_loops"):
        model._cs_check_loops((), patches)
    # Inside a step that records (a capture), the step's points in `loss_fn` are
    # recorded here too, and handed to the step's collector: shadowed by this one,
    # the capture missed them.
    outer = _record.active_collector()
    specs = (spec,) if outer is None else (*outer.specs, spec)
    ours = str(len(specs) - 1)
    # (Its selection resolved apart: `outer.resolved` caches which spec, by index,
    # takes each point, and these specs are not the step's.)
    with _record.collecting_for(specs, "call" if outer is None else outer.kind) as collector, \
            (_record.patching(patches) if direct else contextlib.nullcontext()) as active:
        collector.manual = True
        if direct:
            collector.scopes_applied = (model.name, frozenset((o, p) for o, p, _ in patches))
        if outer is not None:  # one naming for the whole step, as `cs.collecting`'s
            collector.stack, collector.owners = list(outer.stack), outer.owners
            collector.loops, collector.tree = outer.loops, outer.tree
            collector.batch_axes = outer.batch_axes
        result = _grads.impl.value_and_grads(collector, _checked(loss_fn), args)
    if patches:
        _check_reached(model, patches, active.hits)
    records = {}
    for name, values in collector.records.items():
        index, _, kind = _record.split_record(name)
        if index == ours:
            records[name] = values
        elif kind != "grad":  # (the step takes its gradients of its own loss)
            outer.records.setdefault(name, []).extend(values)
    if outer is not None:
        outer.took_grads_inside = True
        if collector.rows is not None:
            outer.rows = collector.rows
    grads = _named(records, "grad")
    if not grads:
        raise ValueError(_nothing_selected(model, spec, collector))
    message = unmatched_globs(spec.select, _points_of(model, collector.tree),
                              "cs.intermediate_grads", "that `loss_fn` ran through",
                              "the other globs' gradients were taken")
    if message:
        raise ValueError(message)
    loss, aux = (result[0], result[1]) if isinstance(result, tuple) else (result, None)
    return IntermediateGrads(loss, aux, grads, _named(records, "output"))


def _points_of(model, tree) -> list[str]:
    """The points of `tree` (named from the top of the call) inside `model`, as a
    selection of `model` names them (from `model` down: `loss_fn` may call a
    model that holds it). Where `model` itself made no entry (not a callscope
    model, or not called), every point, as named."""
    roots = {entry[1] for entry in tree if entry[2] is model}
    if not roots:
        return list(dict.fromkeys(entry[1] for entry in tree))
    name = escaped(model.name)
    return list(dict.fromkeys(
        name + point[len(root):] for _, point, *_ in tree for root in roots
        if point.startswith(root) and point[len(root):][:1] in ("", "/")))


def _open_patches(model) -> tuple:
    """The caller's open patches of `model` and of the models inside it."""
    inside = _keras_compat.layers_held(model)
    return _scope.patches_where(lambda owner: id(owner) in inside)


def _check_reached(model, patches, hits) -> None:
    """A patch that `loss_fn` never reached is an error, as in a call's run."""
    if hasattr(model, "_cs_check_reached"):
        model._cs_check_reached(patches, "loss_fn", hits)
    else:  # (a plain model around callscope models: no points of its own to list)
        _capturing.check_reached(patches, "loss_fn", hits)


def check_scopes_applied(model) -> None:
    """Called by a callscope model's call inside a step or `loss_fn`: where a
    `cs.intermediate_grads` outside any step runs, an open scope of `model` that it
    did not apply is an error, not lost: a capture (its `outputs` are what it
    records) or a patch of a model other than the one it was given."""
    applied = getattr(_record.active_collector(), "scopes_applied", None)
    if applied is None:
        return
    captures, patches = model._cs_scopes()
    given, done = applied
    if captures:
        raise ValueError(
            f"A cs.capture of `{captures[0].model.name}` is open around "
            f"cs.intermediate_grads, whose `loss_fn` called `{model.name}`: that call "
            "is not one the capture records (it would miss it). cs.intermediate_grads "
            "returns the values of the points it selects (`outputs`) with their "
            "gradients: select the points there, or call it outside the capture's "
            f"scope. Received: an open cs.capture of `{captures[0].model.name}`")
    left = [point for owner, point, _ in patches if (owner, point) not in done]
    if left:
        raise ValueError(
            f"cs.intermediate_grads applies the open cs.patch scopes of its model "
            f"(`{given}`) and of the models inside it, and its `loss_fn` called "
            f"`{model.name}`, patched at {left} by another scope, which would be "
            "lost. Pass a model that holds every patched one. Received: "
            f"model=`{given}`")


def _checked(loss_fn: Callable) -> Callable:
    """`loss_fn`, refusing what it returns unless it is a scalar loss or a
    `(loss, aux)` tuple (each backend would read anything else its own way: TF
    summed a vector, torch and TF indexed a 1-tuple's missing aux)."""

    def run(*args):
        result = loss_fn(*args)
        loss = result
        if isinstance(result, (tuple, list)):
            if not isinstance(result, tuple) or len(result) != 2:
                raise ValueError(
                    "cs.intermediate_grads: `loss_fn` returns the loss, or the tuple "
                    "`(loss, aux)`; return other values inside `aux`. Received: "
                    f"loss_fn(...) -> a {type(result).__name__} of length {len(result)}")
            loss = result[0]
        if not keras.ops.is_tensor(loss):
            raise ValueError(
                "cs.intermediate_grads differentiates the loss `loss_fn` computes from "
                "the model's outputs: a 0-d tensor (e.g. `keras.ops.mean(...)`). "
                f"Received: loss={type(loss).__name__}")
        shape = tuple(loss.shape)
        if shape != ():
            raise ValueError(
                "cs.intermediate_grads differentiates a scalar loss: `loss_fn` returns "
                "a 0-d tensor (reduce it, e.g. `keras.ops.mean(...)`), or `(loss, aux)`. "
                f"Received: a loss of shape {shape}")
        return result

    return run


def _named(records, kind):
    out = {}
    for name, values in records.items():
        _, rest = name.split("|", 1)
        point, recorded = rest.rsplit("|", 1)
        if recorded == kind:
            for i, value in enumerate(values):
                out[key_name(point, kind, i, len(values))] = value
    return out


def _nothing_selected(model, spec, collector) -> str:
    """The error for a `select` that matched no point `loss_fn` ran through."""
    ran = list(dict.fromkeys(entry[1] for entry in collector.tree
                             if entry[3] is not _record.LOOP))
    wanted = spec.select
    looped = [entry[1] for entry in collector.tree if entry[3] is _record.LOOP]
    if not ran and looped:
        hint = ("`loss_fn` ran the model's layers only inside a loop body or a "
                "transformation (on JAX, a jax.vmap, jax.jit or jax.checkpoint of the "
                "model's call in "
                "`loss_fn`), whose values cannot leave it: call the model directly")
    elif not ran:
        hint = ("`loss_fn` ran no layer of `model` (call `model`, or its "
                "`stateless_call` on JAX, inside `loss_fn`" + (
                    "; on JAX, directly: not inside a jax.vmap, a loop, or a jax.jit "
                    "function, whose trace JAX reuses without running the model's "
                    "Python again)" if _BACKEND == "jax" else ")"))
    elif callable(wanted):
        hint = "the `select` callable returned False for every point `loss_fn` ran through"
    elif wanted is None:
        hint = ("no layer called `cs.sow` while `loss_fn` ran (by default only sown "
                "values are selected; pass `select=` globs to pick layers)")
    else:
        hint = f"no point that `loss_fn` ran through matched {list(wanted)}"
    points = ran or tree_points(model)
    near = points[:8]
    if isinstance(wanted, tuple):
        near = nearest(wanted, points)
        if calls := single_calls_hint(wanted, points):
            hint += "." + calls.removesuffix(".")
    return (
        "cs.intermediate_grads differentiates the loss with respect to the selected "
        f"points, and selected none: {hint}. Nearest points: {near}. Use "
        "`cs.points(model, x)` to list every point. Received: "
        f"select={wanted!r}"
    )
