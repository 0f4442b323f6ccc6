"""`CaptureMixin`: how a model's calls run with captures and patches open.

The part of the model that `cs.capture` and `cs.patch` need: which layers to wrap
for a run, the histogram ranges from the first batch, where captured values go on
the host (`_cs_sink`), the popper around each made `*_function`, the JAX
`compute_loss_and_updates` hook that carries sown values out of `value_and_grad`,
and eager capture of a direct `model(x)`. `ContextMixin` builds on it; its per-model
state (`self._cs`) and key table live in `_mixin.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

from callscope import _collector, _keras_compat, _steps

CAPTURE = "<capture>"  # key entry holding the specs of the active captures
PATCH = "<patch>"  # key entry holding the active patches, (point, fn) pairs


def marked(key: tuple, mark: str) -> tuple:
    return next((item[1] for item in key if item[0] == mark), ())


def specs_of(key: tuple) -> tuple:
    return marked(key, CAPTURE)


def patches_of(key: tuple) -> tuple:
    return marked(key, PATCH)



class CaptureMixin:
    """Capture and patch plumbing of `ContextMixin` (see the module docstring)."""

    @contextlib.contextmanager
    def _cs_capturing(self, captures, patches=(), first_batch=None):
        """Wraps the layers and settles each capture's spec for the run."""
        if not captures and not patches:
            yield ()
            return
        if not self.built and first_batch is not None:
            self(first_batch, training=False)  # build: layer paths are set on build
        specs = tuple(c.spec for c in captures)
        with _collector.wrapped_layers(self, specs, everything=bool(patches)):
            if any(s.stats and "hist" in s.stats and not s.hist_range and not s.ranges
                   for s in specs):
                self._cs_hist_ranges(captures, first_batch)
                specs = tuple(c.spec for c in captures)
            yield specs

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
        with _collector.collecting_for(probe) as collector:
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


    def _cs_patch_items(self) -> tuple:
        merged = {}
        for patch in self._cs.patches:
            merged.update(patch)  # the inner scope wins
        return tuple(merged.items())

    def _cs_push_capture(self, capture) -> None:
        with self._cs.lock:
            self._cs.captures.append(capture)

    def _cs_pop_capture(self, capture) -> None:
        with self._cs.lock:
            self._cs.captures.remove(capture)

    def _cs_known_points(self) -> list[str]:
        layers = [_collector.point_of(layer) for layer in _keras_compat.flatten_layers(self)
                  if not isinstance(layer, keras.layers.InputLayer)]
        return list(dict.fromkeys([*layers, *self._cs.seen]))

    def _cs_sink(self, kind: str, sown: Mapping[str, Any]) -> None:
        state = self._cs
        if kind == "test" and "fit" in state.running:
            return  # validation inside fit: fit captures its training steps only
        for name, value in sown.items():
            index, key = name.split("|", 1)
            state.sinks[int(index)]._add(kind, key, value)

    def _cs_wrap_function(self, kind: str):
        function = getattr(self, f"{kind}_function", None)
        if function is None or getattr(function, "_callscope_popper", False):
            return function
        if not specs_of(self._cs.installed):
            return function
        wrapped = _steps.popper(self, kind, function)
        self.__dict__[f"{kind}_function"] = wrapped  # no Keras attribute tracking
        return wrapped

    def make_train_function(self, force=False):
        super().make_train_function(force=force)
        return self._cs_wrap_function("train")

    def make_test_function(self, force=False):
        super().make_test_function(force=force)
        return self._cs_wrap_function("test")

    def make_predict_function(self, force=False):
        super().make_predict_function(force=force)
        return self._cs_wrap_function("predict")

    def _cs_loss_hook(self, loss):
        return _steps.loss_hook(loss)  # see _keras_compat.LossHook

    def compute_loss_and_updates(self, *args, **kwargs):
        # JAX only (its trainer's forward for grad): carry sown values out of the
        # differentiated function through the aux output (see _steps.py).
        if _collector.active_collector() is None:
            return super().compute_loss_and_updates(*args, **kwargs)
        with _collector.collecting() as sown:
            loss, aux = super().compute_loss_and_updates(*args, **kwargs)
        return loss, _steps.smuggle(aux, sown.values)


    def _cs_call_capturing(self, *args, **kwargs):
        """A direct `model(x)` inside a capture scope: collected eagerly."""
        state = self._cs
        captures = tuple(state.captures)
        patches = self._cs_patch_items()
        if captures:
            _steps.check_capture_supported(self, "__call__", tuple(c.spec for c in captures))
        sinks, state.sinks = state.sinks, captures
        state.running.append("__call__")
        try:
            first = args[0] if args else None
            with self._cs_capturing(captures, patches, first_batch=first) as specs:
                with _collector.collecting_for(specs) as collector, \
                        _collector.patching(patches) as active:
                    outputs = self(*args, **kwargs)
                    sown = collector.finalize()
                state.patch_hits.update(active.hits if active else ())
                state.seen.update(dict.fromkeys(p for _, p, _, _, _ in collector.tree))
            state.running.pop()
            self._cs_sink("call", sown)
            for capture in captures:
                capture._calls += 1
            return outputs
        finally:
            if state.running and state.running[-1] == "__call__":
                state.running.pop()
            state.sinks = sinks



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
