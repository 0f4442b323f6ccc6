"""`CaptureMixin`: the model side of captures and patches.

What a run needs before its first step when captures or patches are open: the
model built (layer paths are set on build), the recording wrappers installed (once
per model, `_record.install_wrappers`), and histogram ranges fixed from the
first batch. Also eager capture of a direct `model(x)`, the JAX
forward pass that carries sown values out of `value_and_grad` (`AuxHook`),
and the list of known points for error messages. `ContextMixin` builds on it.
"""

from __future__ import annotations

import dataclasses
import difflib

import keras
import numpy as np

from callscope import _record, _keras_compat, _scope, _steps
from callscope._points import loop_points, tree_points
from callscope._run import Run

CAPTURE = "<capture>"  # key entry holding the specs of the active captures
PATCH = "<patch>"  # key entry holding the active patches, (point, fn) pairs


class CaptureMixin:
    """Capture and patch plumbing of `ContextMixin` (see the module docstring)."""

    def _cs_prepare_capture(self, captures, first_batch) -> tuple:
        """Builds the model, installs the wrappers and settles each capture's spec."""
        if not self.built and first_batch is not None:
            with _record.collecting_for(()):  # a plain call: builds, records nothing
                self(first_batch, training=False)
        _record.install_wrappers(self)
        self._cs_check_loops(captures, ())
        if any(c.spec.stats and "hist" in c.spec.stats and not c.spec.hist_range
               and not c.spec.ranges for c in captures):
            self._cs_hist_ranges(captures, first_batch)
        return tuple(c.spec for c in captures)

    def _cs_hist_ranges(self, captures, first_batch):
        """Fixes histogram ranges from an eager pass over the first batch."""
        if first_batch is None:
            raise ValueError(
                "cs.capture(reduce=('hist', ...)) takes its histogram range from the "
                "first batch only for array inputs. For a dataset or generator, pass "
                "`hist_range=(lo, hi)`. Received: hist_range=None"
            )
        probe = tuple(dataclasses.replace(c.spec, stats=("min", "max"), hist_range=(0.0, 1.0))
                      for c in captures)
        with _record.collecting_for(probe) as collector:
            self(first_batch, training=False)
            found = collector.finalize()
        for index, capture in enumerate(captures):
            ranges = []
            for name, part in found.items():
                i, key = name.split("|", 1)
                if int(i) == index:
                    lo = float(_first_float(part["min"]))
                    hi = float(_first_float(part["max"]))
                    ranges.append((key, lo, hi if hi > lo else lo + 1.0))
            capture.spec = dataclasses.replace(capture.spec, ranges=tuple(sorted(ranges)))

    def _cs_check_loops(self, captures, patches) -> None:
        """A capture or patch that names a layer inside an RNN exactly is refused
        before the run, on every backend alike (some fuse the loop and never call
        the cell)."""
        owners = {id(layer): layer for layer in _keras_compat.flatten_layers(self)}
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
                wanted = [point] if any(p == point for c in captures
                                        if isinstance(c.spec.select, tuple)
                                        for p in c.spec.select) else ()
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

    def _cs_call_capturing(self, captures, patches, args, kwargs):
        """A direct, eager `model(x)` inside a capture or patch scope: one run."""
        if captures:
            _steps.check_capture_supported(self, "__call__", tuple(c.spec for c in captures))
        first = args[0] if args else None
        specs = self._cs_prepare_capture(captures, first) if captures else ()
        if patches:
            _record.install_wrappers(self)
            self._cs_check_loops(captures, patches)
        nested = _scope.run_of(self) is not None
        calls = tuple(c._begin("__call__", nested) for c in captures)
        run = Run(self, "__call__", self._cs_table().default, (), calls, patches, nested)
        with _scope.running(run):
            with _record.collecting_for(specs) as collector, \
                    _record.patching(patches) as active:
                outputs = self(*args, **kwargs)
                sown = collector.finalize()
            self._cs_note_points(collector, active, hits := set())
        self._cs_check_reached(run, hits)
        run.sink("call", sown)
        return outputs

    def _cs_note_points(self, collector, active, hits: set) -> None:
        """What a trace learned: its points (for error messages), the points it
        found inside loops, and the patched points it reached."""
        state = self._cs
        state.seen.update(dict.fromkeys(p for _, p, _, v, _ in collector.tree
                                        if v is not _record.LOOP))
        state.loops.update(collector.loops)
        hits.update(active.hits if active else ())

    def _cs_check_reached(self, run, hits: set) -> None:
        """A patch that this run's traces never reached is an error, at its end."""
        missed = [(owner, point) for owner, point, _ in run.patches
                  if (owner, point) not in hits]
        if not missed:
            return
        known = self._cs_known_points()
        points = [p for _, p in missed]
        inside = {p: self._cs.loops[p] for p in points if p in self._cs.loops}
        if inside:
            raise _record.LoopPointError(_record.loop_message(*next(iter(inside.items()))))
        near = sorted({n for p in points for n in difflib.get_close_matches(p, known, n=4,
                                                                           cutoff=0.3)})
        raise ValueError(
            f"cs.patch never reached {points} in this `{run.method}`: no layer or sown "
            f"value that the call ran has that point. Nearest points: {near or known[:8]}. "
            "Use `cs.points(model, x)` to list them. "
            f"Received: patches={[p for _, p, _ in run.patches]}"
        )


def first_batch_of(args, kwargs):
    """The first batch of array inputs (for histogram ranges), else None."""
    x = args[0] if args else kwargs.get("x")
    if x is None:
        return None
    leaves = keras.tree.flatten(x)
    if not leaves or not all(isinstance(v, np.ndarray) or keras.ops.is_tensor(v) for v in leaves):
        return None
    size = kwargs.get("batch_size") or 32
    return keras.tree.map_structure(lambda v: v[:size], x)


def _first_float(x):
    return np.asarray(keras.ops.convert_to_numpy(x)).reshape(-1)[0]
