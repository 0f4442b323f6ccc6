"""Intermediates out: `sow`, `capture`, and the collector that runs inside a step.

A *point* is a layer (its Keras `layer.path`) or a value sown in a layer's `call`
(`layer.path + "/" + name`). A key is `point:kind`, kind being `output` or `input`.

While a `cs.capture(...)` scope is open on a model, its specs become part of the
model's compiled-function key. The per-key step closure opens a `Collector` inside
the traced step; `sow` and the wrapped `call` of each selected layer record into it,
and the step returns the records as extra outputs. A wrapper around the made
`*_function` pops them before Keras's loop sees them, so outputs, logs, callbacks
and the progress bar are unchanged. Outside a capture `sow` is one thread-local
lookup, and the compiled graph has no extra outputs.
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
from keras import ops

from callscope import _keras_compat, _reduce

SOWN = "__callscope_sown__"
OUTPUTS = "__callscope_outputs__"
KINDS = ("output", "input", "grad")
_local = threading.local()
_TORCH = keras.backend.backend() == "torch"


# --------------------------------------------------------------------------
# Specs and the in-step collector
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """What one capture selects: hashable, so it can be part of a compiled key."""

    select: tuple[str, ...] | Callable | None
    kinds: tuple[str, ...]
    stats: tuple[str, ...] | None
    bins: int
    hist_range: tuple[float, float] | None
    ranges: tuple = ()  # ((key, lo, hi), ...) taken from the first batch

    def selects(self, point: str, layer: Any, sown: bool) -> bool:
        if self.select is None:
            return sown
        if callable(self.select):
            return bool(self.select(point, layer))
        return any(fnmatch.fnmatchcase(point, pattern) for pattern in self.select)

    def wants_layers(self) -> bool:
        return self.select is not None

    def range_for(self, key: str) -> tuple[float, float]:
        if self.hist_range is not None:
            return self.hist_range
        for name, lo, hi in self.ranges:
            if name == key:
                return lo, hi
        if self.ranges:  # a point first seen after the first batch
            return min(r[1] for r in self.ranges), max(r[2] for r in self.ranges)
        return -1.0, 1.0


class Collector:
    """Records what the active specs select, during one step or one eager call."""

    def __init__(self, specs: tuple[Spec, ...]):
        self.specs = specs
        self.records: dict[str, list] = {}
        self.stack: list[str] = []
        self.tree: list[tuple] = []  # (depth, point, layer, value, sown) for summary
        self.wants_inputs = any("input" in spec.kinds for spec in specs)
        self.wants_grads = any("grad" in spec.kinds for spec in specs)
        self.grad_sources: dict[str, list] = {}
        self.perturbations: dict | None = None
        self.loss = None  # set by the loss hook, for TensorFlow's outer tape
        self.manual = False  # cs.intermediate_grads takes the gradients itself
        # Makes a gradient source differentiable (TF: tape.watch; torch: a leaf
        # that requires grad) and returns the value the forward pass goes on with.
        self.on_grad_source = _differentiable_source()

    def record(self, point: str, layer: Any, kind: str, value: Any, sown: bool) -> Any:
        """Records `value` for every spec that selects it; returns the value to use.

        For a `grad` spec the value is also a gradient source: with a perturbation
        active (JAX), the returned value is `value + perturbation`, so that the
        gradient with respect to the perturbation is d loss / d value.
        """
        if kind == "output":
            self.tree.append((len(self.stack), point, layer, value, sown))
        for index, spec in enumerate(self.specs):
            if not spec.selects(point, layer, sown):
                continue
            if kind in spec.kinds:
                self.records.setdefault(f"{index}|{point}|{kind}", []).append(value)
            if kind == "output" and "grad" in spec.kinds:
                sources = self.grad_sources.setdefault(f"{index}|{point}|grad", [])
                name = f"{index}|{point}|{len(sources)}"
                if self.perturbations is not None and name in self.perturbations:
                    value = value + self.perturbations[name]
                if self.on_grad_source is not None:
                    value = self.on_grad_source(value)
                sources.append(value)
        return value

    def grad_source_list(self) -> list[tuple[str, Any]]:
        """(`index|point|n`, tensor) for every gradient source, in call order."""
        return [(f"{name.rsplit('|', 1)[0]}|{n}", v)
                for name, values in self.grad_sources.items() for n, v in enumerate(values)]

    def add_grads(self, grads: Mapping[str, Any]) -> None:
        """Files gradients (keyed `index|point|n`) as `grad` records."""
        for name, grad in grads.items():
            index, point, _ = name.split("|")
            self.records.setdefault(f"{index}|{point}|grad", []).append(grad)

    def merge(self, records: Mapping[str, list]) -> None:
        for name, values in records.items():
            self.records.setdefault(name, []).extend(values)

    def finalize(self) -> dict[str, Any]:
        """The step's extra outputs: `"index|key"` to a tensor or to partials."""
        out = {}
        for name, values in self.records.items():
            index, point, kind = name.split("|")
            spec = self.specs[int(index)]
            for i, value in enumerate(values):
                key = f"{point}@{i}:{kind}" if len(values) > 1 else f"{point}:{kind}"
                if spec.stats:
                    out[f"{index}|{key}"] = _reduce.partials(
                        value, spec.stats, spec.bins, spec.range_for(key)
                    )
                else:
                    out[f"{index}|{key}"] = value if len(value.shape) else ops.expand_dims(value, 0)
        return out


def _differentiable_source():
    if _TORCH:
        return lambda v: v if v.requires_grad else v.detach().requires_grad_()
    return None


def active_collector() -> Collector | None:
    return getattr(_local, "collector", None)


@contextlib.contextmanager
def collecting_for(specs: tuple[Spec, ...]) -> Iterator[Collector]:
    """Opens a collector for `specs` on this thread (inside a step, or eagerly)."""
    previous = active_collector()
    collector = _local.collector = Collector(specs)
    try:
        yield collector
    finally:
        _local.collector = previous


class Collected:
    """What `collecting()` recorded: pass `.values` out of a differentiated function."""

    def __init__(self):
        self.values: dict[str, list] = {}


@contextlib.contextmanager
def collecting() -> Iterator[Collected]:
    """Records sown values into a dict of its own, for a user's stateless JAX step.

    Values sown inside `jax.value_and_grad` belong to the differentiated trace and
    cannot leave it except through the function's outputs. Wrap the forward pass,
    return `sown.values` in the aux output, and hand them to `cs.emit` outside:

        def compute_loss_and_updates(self, tv, ntv, x, y, training=False):
            with cs.collecting() as sown:
                y_pred, ntv = self.stateless_call(tv, ntv, x, training=training)
            return self.compute_loss(x, y, y_pred), (ntv, sown.values)

        # in train_step, after grad_fn(...):  cs.emit(sown_values)

    Outside a capture it collects nothing and `sown.values` is `{}`.

    Example:

    >>> import callscope as cs
    >>> with cs.collecting() as sown:
    ...     pass
    >>> sown.values
    {}
    """
    outer = active_collector()
    result = Collected()
    if outer is None:
        yield result
        return
    with collecting_for(outer.specs) as inner:
        inner.stack = list(outer.stack)
        inner.perturbations = outer.perturbations
        yield result
    result.values = inner.records
    for name, sources in inner.grad_sources.items():  # shapes for JAX's eval_shape probe
        outer.grad_sources.setdefault(name, []).extend(sources)


def emit(values: Mapping[str, list]) -> None:
    """Hands values recorded by `collecting()` to the capture of the running step.

    Example:

    >>> import callscope as cs
    >>> cs.emit({})  # outside a capture: nothing to do
    """
    collector = active_collector()
    if collector is not None and values:
        collector.merge(values)


def sow(layer: keras.layers.Layer, name: str, value: Any) -> Any:
    """Records `value` as the point `layer.path + "/" + name`, and returns it.

    It records only while a `cs.capture` that selects the point is running;
    otherwise it costs one thread-local lookup and adds nothing to the compiled
    graph. Call it inside a layer's `call`.

    Example:

    >>> import keras, numpy as np, callscope as cs
    >>> class Block(keras.layers.Layer):
    ...     def call(self, x):
    ...         h = cs.sow(self, "pre_act", x * 2.0)
    ...         return keras.ops.relu(h)
    >>> model = cs.Sequential([keras.Input((2,)), Block(name="block")], name="mlp")
    >>> with cs.capture(model) as cap:
    ...     _ = model.predict(np.array([[1.0, -1.0]]), verbose=0)
    >>> cap["mlp/block/pre_act:output"]
    array([[ 2., -2.]], dtype=float32)
    """
    collector = active_collector()
    patches = active_patches()
    if (collector is None and patches is None) or isinstance(value, keras.KerasTensor):
        return value
    base = getattr(layer, "path", None) or getattr(layer, "name", str(layer))
    point = f"{base}/{name}"
    if patches is not None:
        value = patches.apply(point, value)
    if collector is not None:
        value = collector.record(point, layer, "output", value, sown=True)
    return value


# --------------------------------------------------------------------------
# Wrapping the `call` of selected layers for the duration of a run
# --------------------------------------------------------------------------
def point_of(layer) -> str:
    return getattr(layer, "path", None) or layer.name


def _is_input_layer(layer) -> bool:
    return isinstance(layer, keras.layers.InputLayer)


@contextlib.contextmanager
def wrapped_layers(model, specs: tuple[Spec, ...], everything: bool = False) -> Iterator[None]:
    """Puts a recording wrapper in `layer.__dict__["call"]` of each selected layer.

    `Operation.__call__` calls `self.call`, so an instance attribute shadows the
    method for this run only; the finally block removes every wrapper.
    """
    installed = []
    try:
        for layer in _keras_compat.flatten_layers(model):
            if _is_input_layer(layer):
                continue
            if not everything and not any(spec.wants_layers() for spec in specs):
                break
            # A built layer's `path` is known: skip it when no spec can select it.
            # An unbuilt one is wrapped, and the selection applies when it records.
            path = getattr(layer, "path", None)
            if not everything and path is not None and not any(
                spec.wants_layers() and spec.selects(path, layer, False) for spec in specs
            ):
                continue
            previous = layer.__dict__.get("call", None)
            layer.__dict__["call"] = _recording_call(layer, layer.call)
            installed.append((layer, previous))
        yield
    finally:
        for layer, previous in reversed(installed):
            if previous is None:
                layer.__dict__.pop("call", None)
            else:
                layer.__dict__["call"] = previous


def _recording_call(layer, original):
    def call(*args, **kwargs):
        collector = active_collector()
        patches = active_patches()
        if (collector is None and patches is None) or _symbolic(args):
            return original(*args, **kwargs)
        point = point_of(layer)  # read per call: `path` is set when the layer builds
        if collector is None:
            return patches.apply(point, original(*args, **kwargs))
        if args and collector.wants_inputs:
            _record_tree(collector, point, layer, "input", args[0])
        collector.stack.append(point)
        try:
            outputs = original(*args, **kwargs)
        finally:
            collector.stack.pop()
        if patches is not None:
            outputs = patches.apply(point, outputs)
        return _record_tree(collector, point, layer, "output", outputs)

    return call


def _symbolic(args) -> bool:
    return any(isinstance(a, keras.KerasTensor) for a in keras.tree.flatten(args))


def _record_tree(collector, point, layer, kind, value):
    """Records a layer's input or output; returns the (possibly perturbed) value."""
    if hasattr(value, "shape"):  # the common case: one tensor
        return collector.record(point, layer, kind, value, sown=False)
    leaves = [v for v in keras.tree.flatten(value) if v is not None]
    if len(leaves) == 1:
        collector.record(point, layer, kind, leaves[0], sown=False)
    else:
        for j, leaf in enumerate(leaves):
            collector.record(f"{point}/{j}", layer, kind, leaf, sown=False)
    return value


# --------------------------------------------------------------------------
# Patches (interventions): replace a point's output inside every call
# --------------------------------------------------------------------------
class Patches:
    """The active `{point: fn}` of a run; counts which points were hit."""

    def __init__(self, functions: tuple):
        self.functions = dict(functions)
        self.hits: set[str] = set()

    def apply(self, point: str, value: Any) -> Any:
        fn = self.functions.get(point)
        if fn is None:
            return value
        self.hits.add(point)
        return fn(value)


def active_patches() -> Patches | None:
    return getattr(_local, "patches", None)


@contextlib.contextmanager
def patching(functions: tuple) -> Iterator[Patches | None]:
    previous = active_patches()
    _local.patches = Patches(functions) if functions else None
    try:
        yield _local.patches
    finally:
        _local.patches = previous


# --------------------------------------------------------------------------
# The public scope and mapping
# --------------------------------------------------------------------------
class Capture(Mapping):
    """What `cs.capture` yields: a read-only `Mapping[str, numpy.ndarray]`.

    It fills in as calls finish and is complete when the scope exits. Keys are
    `point:kind`, or `point:kind/stat` with `reduce=`.
    """

    def __init__(self, model, spec: Spec, to: str | os.PathLike | None, log: bool = False):
        self._model = model
        self.spec = spec
        self.log = log
        self._full: dict[str, list[np.ndarray]] = {}
        self._rows: dict[str, list[dict]] = {}
        self._per_step = False
        self._calls = 0
        self._dir = os.fspath(to) if to is not None else None
        self._files: dict[str, dict] = {}
        self._cache: dict[str, np.ndarray] = {}

    # -- filling (called by the model, on the host) --------------------------
    def _add(self, kind: str, key: str, value: Any) -> None:
        # Kept as device arrays until read: converting each batch on arrival would
        # synchronise every step and stall JAX's asynchronous dispatch. Only
        # streaming converts at once, to keep host memory bounded.
        self._cache.clear()
        if kind == "train" and _TORCH:  # torch keeps the autograd graph alive
            value = keras.tree.map_structure(ops.stop_gradient, value)
        if self.spec.stats:
            self._per_step |= kind == "train"
            self._rows.setdefault(key, []).append(value)
        elif self._dir is None:
            self._full.setdefault(key, []).append(value)
        else:
            self._stream(key, _reduce.to_numpy(value))

    def _stream(self, key: str, array: np.ndarray) -> None:
        entry = self._files.get(key)
        if entry is None:
            name = f"{len(self._files):04d}.bin"
            entry = self._files[key] = {
                "file": name, "dtype": array.dtype.str, "row": list(array.shape[1:]), "rows": 0,
            }
            open(os.path.join(self._dir, name), "wb").close()
        if list(array.shape[1:]) != entry["row"]:
            raise ValueError(
                f"Captured `{key}` changed shape from (N, {entry['row']}) to {array.shape}; "
                "streaming to disk needs a fixed shape per row. Capture it without `to=`."
            )
        with open(os.path.join(self._dir, entry["file"]), "ab") as f:
            f.write(np.ascontiguousarray(array, dtype=entry["dtype"]).tobytes())
        entry["rows"] += array.shape[0]

    def _write_index(self) -> None:
        if self._dir is not None:
            with open(os.path.join(self._dir, "index.json"), "w") as f:
                json.dump(self._files, f, indent=1)

    # -- reading -------------------------------------------------------------
    def _names(self) -> list[str]:
        if self.spec.stats:
            return [f"{k}/{s}" for k in self._rows for s in self.spec.stats]
        return list(self._files) if self._dir is not None else list(self._full)

    def __iter__(self):
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def __getitem__(self, key: str) -> np.ndarray:
        if key in self._cache:
            return self._cache[key]
        if self.spec.stats:
            base, _, stat = key.rpartition("/")
            if base not in self._rows or stat not in self.spec.stats:
                raise KeyError(self._missing(key))
            rows = self._rows[base] = [
                {k: _reduce.to_numpy(v) for k, v in r.items()} for r in self._rows[base]
            ]
            stacked = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
            value = (_reduce.per_step(stacked, stat) if self._per_step
                     else _reduce.finalize(_reduce.merge(stacked), stat))
        elif self._dir is not None:
            if key not in self._files:
                raise KeyError(self._missing(key))
            entry = self._files[key]
            shape = (entry["rows"], *entry["row"])
            value = np.memmap(os.path.join(self._dir, entry["file"]), dtype=entry["dtype"],
                              mode="r", shape=shape)
        else:
            if key not in self._full:
                raise KeyError(self._missing(key))
            parts = [_reduce.to_numpy(p) for p in self._full[key]]
            value = parts[0] if len(parts) == 1 else np.concatenate(parts)
            self._full[key] = [value]
        self._cache[key] = value
        return value

    def hist_edges(self, key: str) -> np.ndarray:
        """The bin edges of a `.../hist` key."""
        base = key.rpartition("/")[0] if key.endswith("/hist") else key
        return _reduce.hist_edges(self.spec.bins, self.spec.range_for(base))

    def _missing(self, key: str) -> str:
        close = difflib.get_close_matches(key, self._names(), n=3, cutoff=0.3)
        return f"{key!r} was not captured. Nearest keys: {close or self._names()[:5]}"

    def __repr__(self) -> str:
        return f"Capture({len(self)} keys: {self._names()[:4]}{'...' if len(self) > 4 else ''})"

    # -- the scope -----------------------------------------------------------
    def __enter__(self) -> Capture:
        if self._dir is not None:
            os.makedirs(self._dir, exist_ok=True)
            if os.path.exists(os.path.join(self._dir, "index.json")):
                raise FileExistsError(
                    f"`{self._dir}` already holds a capture (index.json). Choose another "
                    f"directory or remove it first. Received: to={self._dir!r}"
                )
        self._model._cs_push_capture(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._model._cs_pop_capture(self)
        self._write_index()
        if exc_type is None and self._calls and not len(self):
            raise ValueError(self._nothing_matched())

    def _nothing_matched(self) -> str:
        points = self._model._cs_known_points()
        wanted = self.spec.select
        if callable(wanted):
            hint = "the `select` callable returned False for every point"
            near = points[:8]
        elif wanted is None:
            hint = "no layer called `cs.sow` during the run"
            near = points[:8]
        else:
            hint = f"no point matched {list(wanted)}"
            near = sorted({p for w in wanted
                           for p in difflib.get_close_matches(w, points, n=5, cutoff=0.2)})
            near = near or points[:8]
        return (
            f"cs.capture selected nothing: {hint}. Nearest points: {near}. Use "
            "`cs.points(model, x)` to list every point. Received: "
            f"select={wanted!r}"
        )


def capture(
    model,
    select: str | list[str] | tuple[str, ...] | Callable | None = None,
    *,
    kinds: str | tuple[str, ...] = ("output",),
    reduce: str | tuple[str, ...] | None = None,
    bins: int = 32,
    hist_range: tuple[float, float] | None = None,
    to: str | os.PathLike | None = None,
    log: bool = False,
) -> Capture:
    """A scope that captures intermediates of every call of `model` inside it.

    Args:
        model: a `cs.Model`, `cs.Sequential` or `cs.enable`d model.
        select: a glob, a list of globs, or a callable `(point, layer) -> bool`.
            By default every sown point.
        kinds: `"output"` and/or `"input"` (layers only).
        reduce: a statistic or a tuple of them (`mean`, `std`, `min`, `max`,
            `absmax`, `rms`, `frac_zero`, `hist`), computed on the device.
            predict and evaluate give one exact aggregate; fit gives one row per step.
        bins: histogram bins for `hist`.
        hist_range: `(lo, hi)` for `hist`; by default taken from the first batch
            (array inputs).
        to: a directory: full tensors stream there in shards, and are read back
            memory-mapped.
        log: with `reduce=`, each `fit` in the scope adds one exact per-epoch
            aggregate of every statistic to the epoch logs (History, CSVLogger,
            TensorBoard record them; the progress bar does not show them).

    Example:

    >>> import keras, numpy as np, callscope as cs
    >>> model = cs.Sequential([keras.Input((2,)), keras.layers.Dense(3, name="hidden")],
    ...                       name="mlp")
    >>> with cs.capture(model, "*/hidden", reduce=("mean", "max")) as cap:
    ...     _ = model.predict(np.ones((4, 2)), verbose=0)
    >>> sorted(cap)
    ['mlp/hidden:output/max', 'mlp/hidden:output/mean']
    """
    from callscope._mixin import ContextMixin

    if not isinstance(model, ContextMixin):
        raise TypeError(
            "`cs.capture` needs a callscope model: build it with `cs.Model`/"
            "`cs.Sequential`, or call `model = cs.enable(model)` first. "
            f"Received: model={type(model).__name__}"
        )
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ValueError(
            f"`kinds` takes one or more of {', '.join(KINDS)}. Received: kinds={kinds!r}"
        )
    if isinstance(select, str):
        select = (select,)
    elif isinstance(select, list):
        select = tuple(select)
    if select is not None and not callable(select):
        if not all(isinstance(s, str) for s in select):
            raise TypeError(
                "`select` takes a glob, a list of globs or a callable (point, layer) -> "
                f"bool. Received: select={select!r}"
            )
    stats = _reduce.check_stats(reduce)
    if hist_range is not None:
        lo, hi = (float(v) for v in hist_range)
        if not hi > lo:
            raise ValueError(
                f"`hist_range` must be (lo, hi) with hi > lo. Received: {hist_range!r}"
            )
        hist_range = (lo, hi)
    if stats and to is not None:
        raise ValueError("`to=` streams full tensors; it cannot be combined with `reduce=`.")
    if log and not stats:
        raise ValueError("`log=True` puts statistics into the epoch logs: give `reduce=` too. "
                         f"Received: log={log}, reduce={reduce!r}")
    spec = Spec(select, kinds, stats, int(bins), hist_range)
    return Capture(model, spec, to, log=log)
