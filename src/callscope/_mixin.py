"""`ContextMixin`: context arguments through every entry point of a Keras model.

Keras caches one compiled function per model in three attributes,
`train_function`, `test_function` and `predict_function`. callscope keeps one set
of them per *key* (the frozen static context values) in a bounded LRU table and
swaps the right set in around each call to Keras. While a non-default key runs,
fresh per-key closures shadow `train_step`/`test_step`/`predict_step` on the
instance; each enters the key's values *inside* the traced step. That gives every
key its own callable for JAX's trace cache, reaches the replica threads of
`tf.distribute`, and leaves user-overridden steps untouched.

`cs.Model` and `cs.Sequential` are `ContextMixin` on top of the Keras classes;
`cs.enable(model)` swaps an existing instance's class for a cached subclass that
keeps the original name and module, so saved files load without callscope.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import threading
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import keras
import numpy as np

from callscope import _collector, _context, _keras_compat, _steps
from callscope._capturing import CAPTURE, PATCH, CaptureMixin, first_batch_of, patches_of, specs_of

DEFAULT_CACHE_SIZE = 8
_KINDS = ("train", "test", "predict")
_ENTRY_KINDS = {
    "fit": ("train", "test"),
    "evaluate": ("test",),
    "predict": ("predict",),
    "train_on_batch": ("train",),
    "test_on_batch": ("test",),
    "predict_on_batch": ("predict",),
}
_DYNAMIC = "<dynamic>"  # stands for a dynamic value in a key
_MISSING = object()


class _KeyEntry:
    """The compiled functions and step closures of one key."""

    def __init__(self, model: Any, key: tuple, values: Mapping[str, Any]):
        specs, patches = specs_of(key), patches_of(key)
        self.functions: dict[str, Any] = dict.fromkeys(_KINDS)
        self.steps = (
            {kind: _step_closure(model, kind, values, specs, patches) for kind in _KINDS}
            if key else {}
        )


def _step_closure(model, kind, values, specs, patches=()):
    """A fresh callable over `type(model).<kind>_step` that enters `values`.

    It is new per key on purpose: JAX keys its trace cache on the callable, and a
    bound method is equal across keys. Everything it reads is fixed by `values`
    and `specs`. With capture specs, it collects inside the step and returns the
    records as extra outputs.
    """
    step = getattr(type(model), f"{kind}_step")

    def scoped_step(*args, **kwargs):
        with _context.pushed(values), _collector.patching(patches) as active:
            if not specs:
                result = step(model, *args, **kwargs)
                model._cs.patch_hits.update(active.hits if active else ())
                return result
            with _collector.collecting_for(specs) as collector:
                if collector.wants_grads and kind != "predict":
                    result = _steps.step_with_grads(model, kind, step, args, kwargs, collector)
                else:
                    result = step(model, *args, **kwargs)
                result = _steps.unsmuggle(result, collector)
                model._cs.patch_hits.update(active.hits if active else ())
                model._cs.seen.update(dict.fromkeys(p for _, p, _, _, _ in collector.tree))
                return _steps.attach(kind, result, collector.finalize())

    scoped_step.__name__ = f"{kind}_step"
    return scoped_step


class _State:
    """callscope's per-model bookkeeping, kept out of Keras's attribute tracking."""

    def __init__(self):
        self.static: dict[str, None] = {}
        self.dynamic: dict[str, keras.Variable | None] = {}
        self.table: collections.OrderedDict[tuple, _KeyEntry] = collections.OrderedDict()
        self.installed: tuple = ()
        self.lock = threading.RLock()
        self.unbaked = False
        self.captures: list = []  # open cs.capture scopes, outermost first
        self.patches: list = []  # open cs.patch scopes: dicts {point: fn}
        self.patch_hits: set[str] = set()  # patched points seen in traces
        self.sinks: tuple = ()  # the captures the running call fills
        self.running: list[str] = []  # entry points in progress (fit, predict, ...)
        self.seen: dict[str, None] = {}  # points seen in traces, for error messages

    @property
    def names(self) -> set[str]:
        return set(self.static) | set(self.dynamic)

    def hidden_variables(self) -> list:
        return [v for v in self.dynamic.values() if v is not None]


class ContextMixin(CaptureMixin, _keras_compat.LossHook):
    """Adds context arguments to a Keras model. Used through `cs.Model`,
    `cs.Sequential` and `cs.enable`.

    Attributes:
        context_cache_size: how many distinct non-default keys keep their compiled
            functions (LRU, default 8). Past that, the least recently used key is
            evicted with a warning and retraces when it comes back.
    """

    context_cache_size: int = DEFAULT_CACHE_SIZE

    # ------------------------------------------------------------------
    # Declaring names
    # ------------------------------------------------------------------
    @property
    def _cs(self) -> _State:
        state = self.__dict__.get("_callscope_state")
        if state is None:
            state = self.__dict__["_callscope_state"] = _State()
            for name in getattr(type(self), "_callscope_context_args", ()):
                self.register_context_args(name)
        return state

    def register_context_args(self, *names: str, dynamic: bool = False) -> None:
        """Declares context arguments that every entry point of this model takes.

        Works before or after the model has been built or called. Static names
        (the default) select a compiled function per distinct value; dynamic names
        (`dynamic=True`) take numbers or arrays that reach layers as tensors and
        never retrace.

        Args:
            *names: the keyword names, e.g. `"debugging"`.
            dynamic: hold the values in non-trainable variables instead of
                compiling one function per value.

        Example:

        >>> import keras, numpy as np, callscope as cs
        >>> model = cs.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> model.register_context_args("debugging")
        >>> model.predict(np.ones((2, 2)), debugging=True, verbose=0).shape
        (2, 1)
        """
        for name in names:
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(
                    "Context argument names must be Python identifiers. "
                    f"Received: name={name!r}"
                )
            if name == "training":
                raise ValueError(
                    "`training` is already propagated by Keras and cannot be "
                    "registered as a context argument. Received: name='training'"
                )
        state = self._cs
        with state.lock:
            for name in names:
                other = state.static if dynamic else state.dynamic
                if name in other:
                    raise ValueError(
                        f"Context argument `{name}` is already registered as "
                        f"{'static' if dynamic else 'dynamic'}. Received: "
                        f"name={name!r}, dynamic={dynamic}"
                    )
                if dynamic:
                    state.dynamic.setdefault(name, None)
                else:
                    state.static.setdefault(name, None)
            _keras_compat.register_call_context_args(self, names)
            state.unbaked = False

    @property
    def context_args(self) -> dict[str, str]:
        """The registered context arguments, each mapped to "static" or "dynamic".

        Example:

        >>> import keras, callscope as cs
        >>> model = cs.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> model.register_context_args("mode")
        >>> model.register_context_args("temperature", dynamic=True)
        >>> model.context_args
        {'mode': 'static', 'temperature': 'dynamic'}
        """
        state = self._cs
        return {**dict.fromkeys(state.static, "static"), **dict.fromkeys(state.dynamic, "dynamic")}

    # ------------------------------------------------------------------
    # Resolving values
    # ------------------------------------------------------------------
    def _cs_split(self, method: str, kwargs: dict, allowed: set[str] | None) -> dict:
        """Pops registered names out of `kwargs`; rejects unknown keywords."""
        names = self._cs.names
        given = {name: kwargs.pop(name) for name in list(kwargs) if name in names}
        if allowed is not None:
            for name in kwargs:
                if name not in allowed:
                    raise _context.unknown_argument_error(method, name, names)
        return given

    def _cs_resolve(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Explicit value > scope value > absent; validates static values."""
        state = self._cs
        if not state.unbaked:
            _keras_compat.unbake_functional_defaults(self, state.names)
            state.unbaked = True
        scope = _context.scope_values()
        values = {}
        for name in state.names:
            value = given[name] if name in given else scope.get(name)
            if value is None:
                continue
            if name in state.static:
                _context.check_static(name, value)
            values[name] = value
        return values

    def _cs_key(self, values: Mapping[str, Any]) -> tuple:
        static = self._cs.static
        return tuple(sorted((n, v if n in static else _DYNAMIC) for n, v in values.items()))

    def _cs_dynamic_variable(self, name: str, value: Any) -> keras.Variable:
        """The variable holding dynamic `name`, created at its first value."""
        state = self._cs
        variable = state.dynamic.get(name)
        if isinstance(value, keras.Variable):
            return value
        array = np.asarray(keras.ops.convert_to_numpy(value))
        if variable is None:
            dtype = keras.config.floatx() if array.dtype.kind == "f" else str(array.dtype)
            strategy = getattr(self, "distribute_strategy", None)
            scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
            with scope:
                variable = keras.Variable(
                    array.astype(dtype), trainable=False, name=f"callscope_{name}"
                )
            _keras_compat.track_hidden_variable(self, variable)
            state.dynamic[name] = variable
        elif tuple(variable.shape) != array.shape:
            raise ValueError(
                f"Dynamic context argument `{name}` keeps the shape of its first value, "
                f"{tuple(variable.shape)}, so that it never retraces. Pass values of "
                f"that shape. Received: {name} with shape {array.shape}"
            )
        else:
            variable.assign(array.astype(variable.dtype))
        return variable

    # ------------------------------------------------------------------
    # Entry points
    # ------------------------------------------------------------------
    @contextlib.contextmanager
    def _cs_entry(self, method: str, given: Mapping[str, Any], first_batch=None) -> Iterator[None]:
        """Enters the key of one public call: scope, functions, step closures."""
        state = self._cs
        snapshot = (
            _keras_compat.snapshot_variable_values(self)
            if method in ("fit", "train_on_batch")
            else ()
        )
        captures = tuple(state.captures)
        patches = self._cs_patch_items()
        if not state.names and not captures and not patches:
            try:
                yield
            except BaseException:
                _keras_compat.restore_purged_values(snapshot)
                raise
            return
        values = self._cs_resolve(given)
        for name in state.dynamic:
            if name in values:
                values[name] = self._cs_dynamic_variable(name, values[name])
        key = self._cs_key(values)
        if captures:
            _steps.check_capture_supported(self, method, tuple(c.spec for c in captures))
        # Names this model registered but that are not set are blanked out, so an
        # outer scope's value cannot reach a trace of another key.
        pushed = {**dict.fromkeys(state.names), **values}
        with _context.pushed(pushed), state.lock:
            sinks, state.sinks = state.sinks, captures
            state.running.append(method)
            try:
                with self._cs_capturing(captures, patches, first_batch=first_batch) as specs:
                    if specs:
                        key = (*key, (CAPTURE, specs))
                    if patches:
                        key = (*key, (PATCH, patches))
                    previous = state.installed
                    swapped = key != previous
                    if swapped:
                        saved_steps = self._cs_install(key, values)
                    try:
                        yield
                    finally:
                        if swapped:
                            self._cs_uninstall(key, previous, saved_steps)
                for capture in captures:
                    capture._calls += 1
            except BaseException:
                _keras_compat.restore_purged_values(snapshot)
                raise
            finally:
                state.running.pop()
                state.sinks = sinks

    def _cs_entry_for(self, key: tuple, values: Mapping[str, Any]) -> _KeyEntry:
        state = self._cs
        entry = state.table.get(key)
        if entry is None:
            entry = state.table[key] = _KeyEntry(self, key, values)
            limit = max(1, int(self.context_cache_size))
            while sum(1 for k in state.table if k) > limit:
                evict = next(k for k in state.table if k and k not in (key, state.installed))
                del state.table[evict]
                warnings.warn(
                    f"callscope evicted the compiled functions of context {dict(evict)} "
                    f"(more than context_cache_size={limit} distinct values). It will "
                    "retrace if used again. Raise `model.context_cache_size` to keep more.",
                    stacklevel=5,
                )
        state.table.move_to_end(key)
        return entry

    def _cs_install(self, key: tuple, values: Mapping[str, Any]) -> dict:
        state = self._cs
        self._cs_store(state.installed)
        entry = self._cs_entry_for(key, values)
        saved_steps = {}
        for kind in _KINDS:
            # Written to __dict__: Keras's attribute tracking costs ms per call.
            self.__dict__[f"{kind}_function"] = entry.functions[kind]
            name = f"{kind}_step"
            saved_steps[name] = self.__dict__.pop(name, _MISSING)
            if entry.steps:
                self.__dict__[name] = entry.steps[kind]
        state.installed = key
        return saved_steps

    def _cs_uninstall(self, key: tuple, previous: tuple, saved_steps: dict) -> None:
        state = self._cs
        self._cs_store(key)
        entry = state.table.get(previous) or self._cs_entry_for(previous, {})
        for kind in _KINDS:
            # Written to __dict__: Keras's attribute tracking costs ms per call.
            self.__dict__[f"{kind}_function"] = entry.functions[kind]
        for name, step in saved_steps.items():
            self.__dict__.pop(name, None)
            if step is not _MISSING:
                self.__dict__[name] = step
        state.installed = previous

    def _cs_store(self, key: tuple) -> None:
        entry = self._cs.table.get(key)
        if entry is None:
            if key:
                return  # evicted while running
            entry = self._cs.table[key] = _KeyEntry(self, key, {})
        for kind in _KINDS:
            entry.functions[kind] = getattr(self, f"{kind}_function", None)

    def _cs_run(self, method: str, args: tuple, kwargs: dict) -> Any:
        allowed = _keras_method_parameters(type(self), method)
        given = self._cs_split(method, kwargs, allowed)
        first_batch = first_batch_of(args, kwargs) if self._cs.captures else None
        logging = next((c for c in reversed(self._cs.captures) if c.log), None)
        if method == "fit" and logging is not None:
            from callscope._logger import EpochStatistics

            callbacks = list(kwargs.get("callbacks") or [])
            kwargs["callbacks"] = [EpochStatistics(logging), *callbacks]
            self.__dict__["_callscope_fit_callbacks"] = callbacks
        try:
            with self._cs_entry(method, given, first_batch=first_batch):
                return getattr(super(), method)(*args, **kwargs)
        finally:
            self.__dict__.pop("_callscope_fit_callbacks", None)

    def fit(self, *args, **kwargs):
        return self._cs_run("fit", args, kwargs)

    def evaluate(self, *args, **kwargs):
        return self._cs_run("evaluate", args, kwargs)

    def predict(self, *args, **kwargs):
        return self._cs_run("predict", args, kwargs)

    def train_on_batch(self, *args, **kwargs):
        return self._cs_run("train_on_batch", args, kwargs)

    def test_on_batch(self, *args, **kwargs):
        return self._cs_run("test_on_batch", args, kwargs)

    def predict_on_batch(self, *args, **kwargs):
        return self._cs_run("predict_on_batch", args, kwargs)

    def compile(self, *args, **kwargs):
        # A new compile invalidates every key's functions (Keras resets its own).
        state = self._cs
        with state.lock:
            state.table.clear()
        return super().compile(*args, **kwargs)

    def compile_from_config(self, config):
        # Keras skips compiling on load when `compile` is overridden
        # (trainer.py:1003); ours only clears the cache, so compile as stock does.
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if getattr(self, "optimizer", None) is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    # ------------------------------------------------------------------
    # Delivery to the layers
    # ------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        state = self._cs
        eager_capture = (
            (state.captures or state.patches) and not state.running
            and _collector.active_collector() is None and _collector.active_patches() is None
            and not any(isinstance(a, keras.KerasTensor) for a in keras.tree.flatten(args))
        )
        if eager_capture:
            return self._cs_call_capturing(*args, **kwargs)
        if not state.names and not isinstance(self, _STRICT_KWARGS_CLASSES):
            return super().__call__(*args, **kwargs)
        allowed = _direct_call_parameters(self)
        given = self._cs_split("__call__", kwargs, allowed)
        values = self._cs_resolve(given)
        pushed = {**dict.fromkeys(state.names), **values}
        with _context.pushed(pushed):
            kwargs.update({n: _delivered(v) for n, v in values.items()})
            return super().__call__(*args, **kwargs)

    def stateless_call(
        self, trainable_variables, non_trainable_variables, *args, return_losses=False, **kwargs
    ):
        state = self._cs
        propagates = _keras_compat.stateless_call_propagates()
        if not state.names and propagates:
            return super().stateless_call(
                trainable_variables, non_trainable_variables, *args,
                return_losses=return_losses, **kwargs,
            )
        given = self._cs_split("stateless_call", kwargs, None)
        values = self._cs_resolve(given)
        # A dynamic value is read from the state passed in, not from the
        # (possibly purged) variable.
        hidden = {id(v): i for i, v in enumerate(self.non_trainable_variables)}
        delivered = {}
        for name, value in values.items():
            if isinstance(value, keras.Variable) and id(value) in hidden:
                value = non_trainable_variables[hidden[id(value)]]
            delivered[name] = _delivered(value)
        pushed = {**dict.fromkeys(state.names), **values}
        call = lambda: super(ContextMixin, self).stateless_call(  # noqa: E731
            trainable_variables, non_trainable_variables, *args,
            return_losses=return_losses, **kwargs,
        )
        with _context.pushed(pushed):
            if propagates:
                kwargs.update(delivered)
                return call()
            # As Keras's `__call__` does (and `stateless_call` on keras main): a
            # context argument the model's `call` does not declare, `training`
            # included, goes to the call context only.
            params = _keras_compat.call_signature_parameters(self)
            entered = dict(delivered)
            if kwargs.get("training") is not None:
                entered["training"] = kwargs["training"]
            if "training" in kwargs and "training" not in params:
                del kwargs["training"]
            kwargs.update({n: v for n, v in delivered.items() if n in params})
            with _keras_compat.entered_call_context(self, entered):
                return call()

    # ------------------------------------------------------------------
    # Saving: dynamic-context variables never reach the weights file
    # ------------------------------------------------------------------
    def save_own_variables(self, store):
        with _keras_compat.without_variables(self, self._cs.hidden_variables()):
            return super().save_own_variables(store)

    def load_own_variables(self, store):
        with _keras_compat.without_variables(self, self._cs.hidden_variables()):
            return super().load_own_variables(store)


def _delivered(value):
    return value.value if isinstance(value, keras.Variable) else value


_STRICT_KWARGS_CLASSES = (keras.Sequential, _keras_compat.functional_class())
_PARAMETER_CACHE: dict = {}


def _keras_method_parameters(cls, method) -> set[str] | None:
    """The keywords Keras's own `method` accepts (None: anything goes)."""
    key = (cls, method)
    if key not in _PARAMETER_CACHE:
        ours = set(ContextMixin.__mro__)
        base = next(c for c in cls.__mro__ if c not in ours and not issubclass(c, ContextMixin))
        params = inspect.signature(getattr(base, method)).parameters
        names = {n for n, p in params.items() if p.kind is not p.VAR_KEYWORD}
        if method == "evaluate":
            names.add("_use_cached_eval_dataset")  # fit's validation (trainer.py:469)
        elif any(p.kind is p.VAR_KEYWORD for p in params.values()):
            names = None
        _PARAMETER_CACHE[key] = names
    return _PARAMETER_CACHE[key]


def _direct_call_parameters(model) -> set[str] | None:
    """Keywords a direct `model(...)` takes, for models whose call eats **kwargs.

    Keras's Sequential and Functional `call` accept and silently drop any keyword,
    so a typo'd context argument would do nothing. For them only the named
    parameters pass; a subclassed model's own signature is left to Python.
    """
    if not isinstance(model, _STRICT_KWARGS_CLASSES):
        return None
    params = inspect.signature(type(model).call).parameters
    return {n for n, p in params.items() if p.kind is not p.VAR_KEYWORD and n != "self"}
