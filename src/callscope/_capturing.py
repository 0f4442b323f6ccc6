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

import keras
import numpy as np

from callscope import _record, _keras_compat, _scope, _steps
from callscope._run import Run

CAPTURE = "<capture>"  # key entry holding the specs of the active captures
PATCH = "<patch>"  # key entry holding the active patches, (point, fn) pairs


class CaptureMixin:
    """Capture and patch plumbing of `ContextMixin` (see the module docstring)."""

    def _cs_prepare_capture(self, captures, first_batch) -> tuple:
        """Builds the model, installs the wrappers and settles each capture's spec."""
        if not self.built and first_batch is not None:
            with _record.collecting_for(()):  # a plain call: builds, records nothing
                self(first_batch, training=False)  # layer paths are set on build
        _record.install_wrappers(self)
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

    def _cs_known_points(self) -> list[str]:
        layers = [_record.point_of(layer) for layer in _keras_compat.flatten_layers(self)
                  if not isinstance(layer, keras.layers.InputLayer)]
        return list(dict.fromkeys([*layers, *self._cs.seen]))

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
        nested = _scope.run_of(self) is not None
        calls = tuple(c._begin("__call__", nested) for c in captures)
        run = Run(self, "__call__", self._cs_table().default, (), calls, patches, nested)
        with _scope.running(run):
            with _record.collecting_for(specs) as collector, \
                    _record.patching(patches) as active:
                outputs = self(*args, **kwargs)
                sown = collector.finalize()
        self._cs.patch_hits.update(active.hits if active else ())
        self._cs.seen.update(dict.fromkeys(p for _, p, _, _, _ in collector.tree))
        run.sink("call", sown)
        return outputs


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
