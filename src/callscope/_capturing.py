"""`CaptureMixin`: the model side of captures and patches.

What a run needs when captures or patches are open: the model built, the
recording wrappers installed (once per model, `_record.install_wrappers`), layers
inside RNN loops refused by exact name, histogram ranges fixed from the batch each
kind of step sees first (`_cs_find_ranges`, called before that step is traced),
and, when the run ends, patches that it never reached reported. Also eager capture
of a direct `model(x)`, the JAX forward pass that carries sown values out of
`value_and_grad` (`AuxHook`), and the known points for error messages.
`ContextMixin` builds on it.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np

from callscope import _backend, _grads, _keras_compat, _record, _scope, _steps
from callscope._points import loop_points, nearest, single_calls_hint, tree_points
from callscope._capture import begin_calls
from callscope._run import Run

CAPTURE = "<capture>"  # key entry holding the specs of the active captures
PATCH = "<patch>"  # key entry holding the active patches, (point, fn) pairs


class CaptureMixin:
    """Capture and patch plumbing of `ContextMixin` (see the module docstring)."""

    def _cs_prepare_capture(self, captures, first_batch) -> None:
        """Builds the model, installs the wrappers and checks each capture's spec."""
        if not self.built and first_batch is not None:
            # A plain call: builds, records nothing; in the model's strategy's
            # scope, as Keras builds it (`_backend.strategy_scope`).
            with _record.collecting_for(()), _backend.strategy_scope(self):
                self(first_batch, training=False)
        _record.install_wrappers(self)
        self._cs_check_loops(captures, ())

    def _cs_find_ranges(self, specs, call_kind: str, data, state=None, call=None,
                        patches=()) -> None:
        """Fixes each spec's histogram ranges for `call_kind` from one batch, the
        one the first step is about to see: an eager, stateless pass in that
        step's mode (training for `train`), with gradients where they are
        captured. `state` is the JAX step's state (Keras holds the weights
        there while its loop runs); elsewhere the variables hold them. `call`
        makes a direct call (`model(x, ...)`) again, with all its arguments.
        `patches` are the run's: the values the step sees are patched ones."""
        specs = [s for s in specs if s.finds_ranges() and s.ranges.pending(call_kind)]
        if not specs:
            return
        x, y, sample_weight = _keras_compat.whole_batch(self, data) if call is None else (
            None, None, None)
        training = call_kind == "train"
        probe = tuple(dataclasses.replace(s, stats=("min", "max"), hist_range=(("*", 0.0, 1.0),),
                                          ranges=None) for s in specs)
        grads = any("grad" in s.kinds for s in specs) and y is not None

        def forward():
            if call is not None:
                return call()
            y_pred = self(x, training=training)
            if not grads:
                return None
            return self.compute_loss(x, y, y_pred, sample_weight, training=training)

        with keras.StatelessScope(state_mapping=_keras_compat.state_mapping(self, state)), \
                _backend.same_random_numbers(), \
                _record.collecting_for(probe, call_kind) as collector, \
                _record.patching(patches, _FIRST_BATCH if call is None else None):
            collector.manual = True
            if grads:
                _grads.impl.value_and_grads(collector, forward, ())
            else:
                forward()
            found = {name: (float(_first_float(p["min"])), float(_first_float(p["max"])))
                     for name, p in collector.finalize().items() if "|" in name}
        for index, spec in enumerate(specs):
            ranges = {}
            for name, (lo, hi) in found.items():
                i, key = name.split("|", 1)
                if int(i) == index:
                    if not (np.isfinite(lo) and np.isfinite(hi)):  # no finite value
                        lo, hi = -1.0, 1.0
                    ranges[key] = (lo, hi if hi > lo else lo + 1.0)
            spec.ranges.found.setdefault(call_kind, ranges)

    def _cs_check_loops(self, captures, patches) -> None:
        """A capture or patch that names a layer inside an RNN exactly is refused
        before the run, on every backend alike (some fuse the loop and never call
        the cell)."""
        owners = _keras_compat.layers_held(self)
        named = [(c.model, s) for c in captures if isinstance(c.spec.select, tuple)
                 for s in c.spec.select]
        named += [(owners.get(owner), point) for owner, point, _ in patches]
        found = {}
        for owner, point in named:
            if owner is None:
                continue
            if id(owner) not in found:
                found[id(owner)] = loop_points(owner)
            if point in found[id(owner)]:
                wanted = [point] if any(c.spec.names(point) for c in captures) else ()
                raise _record.LoopPointError(
                    _record.loop_message(point, found[id(owner)][point], wanted))

    def _cs_known_points(self) -> list[str]:
        loops = loop_points(self)
        return [p for p in dict.fromkeys([*self._cs.seen, *tree_points(self)])
                if p not in loops and p not in self._cs.loops]

    def _cs_loss_hook(self, loss):
        return _steps.loss_hook(loss)  # see _keras_compat.LossHook

    def _cs_loss_and_updates(self, call, *args, **kwargs):
        # JAX only (see _keras_compat.AuxHook): the forward pass that value_and_grad
        # differentiates; values sown inside it leave through its aux output.
        if _record.active_collector() is None:
            return (*call(*args, **kwargs), None)
        with _record.collecting() as sown:
            loss, aux = call(*args, **kwargs)
        return loss, aux, sown.values

    def _cs_call_capturing(self, captures, patches, args, kwargs, invoke=None, state=None):
        """A direct, eager `model(x)` inside a capture or patch scope: one run.
        `invoke` makes the call another way (`stateless_call`, with the weights
        `state`: its trainable and non-trainable values)."""
        _steps.check_not_rematerialized(self)
        outer, runs = _scope.run_of(self), _scope.runs_here()
        specs = _steps.call_specs(captures, "__call__", runs)
        if captures:
            _steps.check_capture_supported(self, "__call__", specs)
        first = args[0] if args else kwargs.get("inputs")
        if captures:
            self._cs_prepare_capture(captures, first)
        invoke = invoke if invoke is not None else lambda: self(*args, **kwargs)
        self._cs_find_ranges(specs, "call", (first,), state, call=invoke, patches=patches)
        if patches:
            _record.install_wrappers(self)
            self._cs_check_loops(captures, patches)
        nested = outer is not None
        calls, landing = begin_calls(captures, "__call__", runs)
        try:  # the run ends whatever happens: a capture's exit waits for its calls
            run = Run(self, "__call__", self._cs_table().default, (), calls, patches, nested,
                      host=landing)
            with _scope.running(run):
                with _record.collecting_for(specs) as collector, \
                        _record.patching(patches) as active:
                    outputs = invoke()
                    sown = collector.finalize()
                self._cs_note_points(collector, active, _scope.Later(hits := set()))
            self._cs_check_reached(run.patches, run.method, hits)
            run.sink("call", sown)
        except BaseException as error:
            if landing is not None:
                landing.end(error)
            raise
        run.end()
        return outputs

    def _cs_note_points(self, collector, active, hits: _scope.Later,
                        resolved=None) -> None:
        """What a trace learned: its points (for error messages), the points it
        found inside loops, and the patched points it reached. The points are
        noted once per key (`resolved`): torch runs the step's Python every step
        (but a trace runs once, and a compiled step must not guard on the flag)."""
        _scope.join_after(hits, active.hits if active else ())
        if resolved is not None and not _backend.is_tracing_now():
            if resolved.noted:
                return
            resolved.noted = True
        state = self._cs
        # (By point, not by value: a compiled step after a graph break would
        # inspect the recorded tensors.)
        loops = collector.loops
        _scope.join_after(_scope.Later(state.seen), _sorts(collector.tree, loops))
        _scope.join_after(_scope.Later(state.loops), collector.loops)

    def _cs_check_reached(self, patches, method: str, hits: set) -> None:
        """A patch that this run's traces never reached is an error, at its end."""
        check_reached(patches, method, hits, self._cs_points_of, self._cs.loops)

    def _cs_points_of(self, owner: int) -> list[str]:
        """The points of the model `owner` (an id: this one, or one it holds) as a
        patch of it names them (`enc/d`, not the caller's `ae/enc/d`)."""
        held = _keras_compat.layers_held(self).get(owner, self)
        return (held if hasattr(held, "_cs_known_points") else self)._cs_known_points()


def check_reached(patches, method: str, hits: set, points_of=lambda owner: [],
                  loops=None) -> None:
    """A patch of `patches` (`(owner, point, fn)`) that `method` never reached is
    an error. `points_of(owner)` lists the points of the patched model `owner`
    for the hint, and `loops` the points inside loops (a patch there cannot be
    applied)."""
    missed = [(owner, point) for owner, point, _ in patches if (owner, point) not in hits]
    if not missed:
        return
    loops, points = loops or {}, [p for _, p in missed]
    of_owner = {owner: points_of(owner) for owner in dict.fromkeys(o for o, _ in missed)}
    known = list(dict.fromkeys(p for owned in of_owner.values() for p in owned))
    inside = {p: loops[p] for p in points if p in loops}
    if inside:
        raise _record.LoopPointError(_record.loop_message(*next(iter(inside.items()))))
    # `cs.points` lists each call of a shared layer as `point@i`, as captures
    # key it; a patch names the point, and applies to every call of it.
    hint = single_calls_hint(points, known, patching=True)
    if named := [p for o, p in missed if p in of_owner[o]]:  # points it has: skipped
        hint += (f" {named} {'is a point' if len(named) == 1 else 'are points'} of the "
                 "model that no step of this call ran (a branch not taken, for these "
                 "batches' shapes or values).")
    near = f" Nearest points: {nearest(points, known)}." if known else ""
    raise ValueError(
        f"cs.patch never reached {points} in this `{method}`: no layer or sown "
        f"value that the call ran has that point.{hint}{near} Use "
        f"`cs.points(model, x)` to list them. "
        f"Received: patches={[p for _, p, _ in patches]}"
    )


def _sorts(tree, loops) -> dict[str, str]:
    """What each point of a trace's call tree is, for error messages (the kinds
    it has): `layer` (a layer's call: `output` and `input`), `element` (one
    tensor of a layer's tuple, list or dict output) or `sown` (a value only
    sown: `output`). Points inside loops are left out."""
    structured = {(id(layer), point) for _, point, layer, value, sown in tree
                  if not sown and isinstance(value, list | tuple | dict)}
    sorts: dict[str, str] = {}
    for _, point, layer, _, sown in tree:
        if point in loops or sorts.get(point, "sown") != "sown":
            continue  # (a point sown and a call's output too: the call's)
        element = (id(layer), point.rpartition("/")[0]) in structured
        sorts[point] = "sown" if sown else "element" if element else "layer"
    return sorts


class _FirstBatch:
    """The row offset of a run's first batch, for patches that take the batch."""

    value = np.int32(0)


_FIRST_BATCH = _FirstBatch()


def first_x(args, kwargs):
    """The first rows of array inputs (to build an unbuilt model), else None."""
    x = args[0] if args else kwargs.get("x")
    if x is None:
        return None
    leaves = keras.tree.flatten(x)
    if not leaves or not all(isinstance(v, np.ndarray) or keras.ops.is_tensor(v) for v in leaves):
        return None
    if any(_backend.layout(v) for v in leaves):  # (a tf.SparseTensor takes no `[:1]`)
        return None
    return keras.tree.map_structure(lambda v: v[:1], x)


def _first_float(x):
    return np.asarray(keras.ops.convert_to_numpy(x)).reshape(-1)[0]
