"""The collector that runs inside a step: `sow`, layer wrappers, patches.

A *point* is a layer (its Keras `layer.path`) or a value sown in a layer's `call`
(`layer.path + "/" + name`). While a capture runs, the per-key step closure opens
a `Collector` on the thread *inside* the traced step; `sow` and the `call`
wrappers of the layers record into it (and, for `grad`, mark gradient sources),
and `finalize` turns the records into the step's extra outputs. Patches replace
a point's value on the way. Outside a capture or patch, `sow` is one thread-local
lookup and the compiled graph has no extra outputs.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import keras
from keras import ops

from callscope import _keras_compat, _reduce
from callscope._points import Spec, key_name, point_of

SOWN = "__callscope_sown__"
OUTPUTS = "__callscope_outputs__"
_COLLECTOR: contextvars.ContextVar = contextvars.ContextVar("callscope_collector", default=None)
_ACTIVE_PATCHES: contextvars.ContextVar = contextvars.ContextVar("callscope_patching",
                                                                 default=None)
_TORCH = keras.backend.backend() == "torch"

# --------------------------------------------------------------------------
# The in-step collector
# --------------------------------------------------------------------------
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
                key = key_name(point, kind, i, len(values))
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
    return _COLLECTOR.get()


@contextlib.contextmanager
def collecting_for(specs: tuple[Spec, ...]) -> Iterator[Collector]:
    """Opens a collector for `specs` in this context (inside a step, or eagerly)."""
    collector = Collector(specs)
    token = _COLLECTOR.set(collector)
    try:
        yield collector
    finally:
        _COLLECTOR.reset(token)


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
def _is_input_layer(layer) -> bool:
    return isinstance(layer, keras.layers.InputLayer)


def install_wrappers(model) -> None:
    """Puts a recording wrapper in the instance attribute `call` of every layer, once.

    `Operation.__call__` calls `self.call`, so an instance attribute shadows the
    method. The wrapper stays: it consults the collector and patches of the run in
    effect, and costs one context lookup when there are none. Installing again is
    a no-op for wrapped layers, so a nested call never wraps twice. The wrapper
    holds the layer's bound `call` (deep copies rebind it) and exposes its
    signature, so Keras code that inspects `layer.call` sees the real one.
    """
    for layer in _keras_compat.flatten_layers(model):
        wrapper = _keras_compat.get_instance_attribute(layer, "call")
        if _is_input_layer(layer) or isinstance(wrapper, RecordingCall):
            continue
        _keras_compat.set_instance_call(layer, RecordingCall(layer, layer.call))


class RecordingCall:
    """The recording wrapper of one layer's `call` (see `install_wrappers`)."""

    def __init__(self, layer, original):
        self.layer = layer
        self.__wrapped__ = original

    @property
    def __signature__(self):
        return inspect.signature(self.__wrapped__)

    def __call__(self, *args, **kwargs):
        original = self.__wrapped__
        collector = _COLLECTOR.get()
        patches = _ACTIVE_PATCHES.get()
        if (collector is None and patches is None) or _symbolic(args):
            return original(*args, **kwargs)
        layer = self.layer
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
    return _ACTIVE_PATCHES.get()


@contextlib.contextmanager
def patching(functions: tuple) -> Iterator[Patches | None]:
    patches = Patches(functions) if functions else None
    token = _ACTIVE_PATCHES.set(patches)
    try:
        yield patches
    finally:
        _ACTIVE_PATCHES.reset(token)
