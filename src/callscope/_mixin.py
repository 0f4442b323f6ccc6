"""`ContextMixin`: context arguments, captures and patches through every entry point.

Each public call (`fit`, `evaluate`, `predict`, the `*_on_batch` methods, a direct
`model(x)`) makes one `Run` (`_run.py`) from the caller's scopes and its keyword
arguments, and holds it in a `ContextVar` while Keras runs. Nothing about the call
is written to the model:

- Keras reads and writes `self.train_function`/`test_function`/`predict_function`.
  Here they are data descriptors that resolve through the run in effect to the
  `KeyTable` entry of its key (`_keys.py`), so two threads with different keys each
  get their own compiled functions, with no swap and no lock across Keras's loop.
- `train_step`/`test_step`/`predict_step` are shadowed once, on the instance, by a
  dispatcher that calls the key's fresh step closure. The closure enters exactly the
  key's values *inside* the traced step (a sealed frame, `_scope.py`), which reaches
  the replica threads of `tf.distribute` and leaves user-overridden steps unchanged.
- Layer wrappers are installed once and consult the collector of the step in
  effect (`_collector.py`).
- Dynamic values travel with the run: substituted into the JAX state of each step,
  or assigned to a hidden variable for the length of one compiled call on
  TensorFlow and torch. They are never weights.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import warnings
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

from callscope import _backend, _collector, _keras_compat, _keys, _scope, _steps
from callscope._capturing import CAPTURE, PATCH, CaptureMixin, first_batch_of
from callscope._run import Gate, Run, with_gate_callbacks

DEFAULT_CACHE_SIZE = 8
_KINDS = _keys.KINDS
# JAX: stock Keras purges a model's variables while its loop runs, so calls are
# serialised (one gate for all models: layers can be shared between models).
GATE = Gate() if keras.backend.backend() == "jax" else None


class _State:
    """callscope's per-model registry: names, compiled functions, known points.

    It holds what is true of the model, never of one call.
    """

    def __init__(self, model):
        self.static: dict[str, None] = {}
        self.dynamic: dict[str, keras.Variable | None] = {}
        self.lock = threading.RLock()  # registration only; never held across a call
        self.unbaked = False
        self.declared: frozenset | None = None  # names declared by sublayers
        self.patch_hits: set[str] = set()  # patched points seen in traces
        self.seen: dict[str, None] = {}  # points seen in traces, for error messages
        self.replica_lock = threading.Lock()  # tf.distribute: replica threads see no
        self.replica_entry = None  # contextvars, so the tracing call's entry is here
        self.dynamic_lock = threading.Lock()  # TF/torch: one assign-and-call at a time
        self.make_lock = threading.RLock()  # make_*_function reads the step once

    @property
    def names(self) -> set[str]:
        return set(self.static) | set(self.dynamic)


class _PerKeyFunction:
    """`self.<kind>_function`, resolved through the run in effect (see above)."""

    def __init__(self, kind: str):
        self.kind = kind

    def __get__(self, model, owner=None):
        if model is None:
            return self
        return model._cs_entry_now().functions[self.kind]

    def __set__(self, model, value):
        model._cs_entry_now().functions[self.kind] = value


class _StepDispatch:
    """Shadows `<kind>_step` on the instance: calls the step closure of the key in
    effect. Holds the model as an attribute (not a closure), so deep copies rebind."""

    def __init__(self, model, kind: str):
        self.model = model
        self.kind = kind

    def __call__(self, *args, **kwargs):
        model = self.model
        run = _scope.run_of(model)
        entry = run.entry if run is not None else (model._cs.replica_entry
                                                   or model._cs_table().default)
        return entry.steps[self.kind](*args, **kwargs)


def _step_closure(model, kind, values, specs, patches=()):
    """A fresh callable over `type(model).<kind>_step` that enters `values`.

    New per key on purpose: JAX keys its trace cache on the callable. Everything it
    reads is fixed by `values`, `specs` and `patches`: the frame it enters is sealed,
    so a scope value outside the key cannot leak into the trace. With capture
    specs, it collects inside the step and returns the records as extra outputs.
    """
    step = getattr(type(model), f"{kind}_step")

    def scoped_step(*args, **kwargs):
        with _scope.pushed(_scope.sealed(values)), _collector.patching(patches) as active:
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


def _marked(key: tuple, mark: str) -> tuple:
    return next((item[1] for item in key if item[0] == mark), ())


class ContextMixin(CaptureMixin, _keras_compat.LossHook):
    """Adds context arguments, captures and patches to a Keras model. Used through
    `cs.Model`, `cs.Sequential` and `cs.enable`.

    Attributes:
        context_cache_size: how many distinct non-default keys keep their compiled
            functions (LRU, default 8). Past that, the least recently used key that
            no running call uses is evicted with a warning, and retraces when it
            comes back.
    """

    context_cache_size: int = DEFAULT_CACHE_SIZE
    train_function = _PerKeyFunction("train")
    test_function = _PerKeyFunction("test")
    predict_function = _PerKeyFunction("predict")

    # ------------------------------------------------------------------
    # Per-model registry
    # ------------------------------------------------------------------
    @property
    def _cs(self) -> _State:
        state = self.__dict__.get("_callscope_state")
        if state is None:
            state = _State(self)
            _keras_compat.set_instance_attribute(self, "_callscope_state", state)
            for name in getattr(type(self), "_callscope_context_args", ()):
                self.register_context_args(name)
        return state

    def _cs_table(self) -> _keys.KeyTable:
        table = self.__dict__.get("_callscope_table")
        if table is None:
            table = _keys.KeyTable(self._cs_make_steps)
            table.default.steps = self._cs_make_steps((), {})
            _keras_compat.set_instance_attribute(self, "_callscope_table", table)
        return table

    def _cs_make_steps(self, key: tuple, values: Mapping) -> dict:
        specs, patches = _marked(key, CAPTURE), _marked(key, PATCH)
        return {kind: _step_closure(self, kind, dict(values), specs, patches) for kind in _KINDS}

    def _cs_entry_now(self) -> _keys.Entry:
        run = _scope.run_of(self)
        return run.entry if run is not None else self._cs_table().default

    def _cs_install_steps(self) -> None:
        for kind in _KINDS:
            name = f"{kind}_step"
            if not isinstance(self.__dict__.get(name), _StepDispatch):
                _keras_compat.set_instance_attribute(self, name, _StepDispatch(self, kind))

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
                    raise unknown_argument_error(method, name, names)
        return given

    # ------------------------------------------------------------------
    # Resolving values
    # ------------------------------------------------------------------
    def _cs_resolve(self, given: Mapping[str, Any], *, tracing: bool = False) -> dict[str, Any]:
        """Explicit value > scope value > absent; validates static values."""
        state = self._cs
        if not state.unbaked and not tracing:
            _keras_compat.unbake_functional_defaults(self, state.names)
            state.unbaked = True
        values = {}
        for name in state.names:
            value = given[name] if name in given else _scope.lookup(name, tracing=tracing)
            if value is None:
                continue
            if name in state.static:
                _keys.check_static(name, value)
            values[name] = value
        return values

    def _cs_check_stray(self) -> None:
        """A scope value that a sublayer declares but this model's key would not hold
        would be frozen into (or silently missing from) the compiled function."""
        state = self._cs
        if state.declared is None:
            if not self.built:
                return
            declared = set()
            for layer in _keras_compat.flatten_layers(self):
                declared |= _keras_compat.registered_call_context_args(layer)
            state.declared = frozenset(declared - {"training"})
        values = _scope.frame().values
        for name in state.declared:
            if name not in state.static and name not in state.dynamic \
                    and values.get(name) is not None:
                raise _scope.StrayValueError(
                    _scope.STRAY_VALUE.format(name=name, value=values[name])
                    .replace("the model that compiles the function",
                             f"`{type(self).__name__}` (which compiles the function)")
                )

    def _cs_dynamic_variable(self, name: str, value: Any) -> tuple[keras.Variable, np.ndarray]:
        """The hidden variable of dynamic `name` (made at its first value), and the
        value as an array of its dtype and shape."""
        state = self._cs
        variable = state.dynamic.get(name)
        array = np.asarray(keras.ops.convert_to_numpy(value))
        with state.lock:
            variable = state.dynamic.get(name)
            if variable is None:
                dtype = keras.config.floatx() if array.dtype.kind == "f" else str(array.dtype)
                strategy = getattr(self, "distribute_strategy", None)
                scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
                with scope:
                    variable = keras.Variable(array.astype(dtype), trainable=False,
                                              name=f"callscope_{name}")
                _keras_compat.add_hidden_state(self, variable)
                state.dynamic[name] = variable
        if tuple(variable.shape) != array.shape:
            raise ValueError(
                f"Dynamic context argument `{name}` keeps the shape of its first value, "
                f"{tuple(variable.shape)}, so that it never retraces. Pass values of "
                f"that shape. Received: {name} with shape {array.shape}"
            )
        return variable, array.astype(variable.dtype)

    # ------------------------------------------------------------------
    # Entry points: one run per call
    # ------------------------------------------------------------------
    def _cs_run(self, method: str, args: tuple, kwargs: dict) -> Any:
        state = self._cs
        given = self._cs_split(method, kwargs, _keras_method_parameters(type(self), method))
        captures = _scope.captures_for(self)
        patches = _scope.patches_for(self)
        self._cs_check_stray()
        values = self._cs_resolve(given)
        dynamic = []
        for name in state.dynamic:
            if name in values:
                variable, array = self._cs_dynamic_variable(name, values[name])
                values[name] = variable
                dynamic.append((variable, array))
        key = _keys.static_key(values, set(state.static))
        if captures:
            _steps.check_capture_supported(self, method, tuple(c.spec for c in captures))
        if captures or patches:
            specs = self._cs_prepare_capture(captures, first_batch_of(args, kwargs))
            if specs:
                key = (*key, (CAPTURE, specs))
            if patches:
                key = (*key, (PATCH, patches))
        # Names this model registered but that are not set are blanked out, so an
        # outer scope's value cannot reach a trace of another key.
        frame = _scope.overlay({**dict.fromkeys(state.names), **values}, keyed=True)
        table = self._cs_table()
        entry = table.acquire(key, values, self.context_cache_size)
        try:
            self._cs_install_steps()
            nested = _scope.run_of(self) is not None
            calls = tuple(c._begin(method, nested) for c in captures)
            if dynamic and _JAX:
                positions = {id(v): i for i, v in enumerate(self.non_trainable_variables)}
                dynamic = [(positions[id(v)], a) for v, a in dynamic]
            run = Run(self, method, entry, tuple(dynamic), calls, patches, nested)
            logging = next((i for i, c in enumerate(captures) if c.log), None)
            if method == "fit" and logging is not None:
                from callscope._logger import EpochStatistics

                user = list(kwargs.get("callbacks") or [])
                kwargs["callbacks"] = [EpochStatistics(calls[logging], user), *user]
            if GATE is not None and method in ("fit", "evaluate", "predict"):
                kwargs["callbacks"] = with_gate_callbacks(kwargs.get("callbacks"), GATE, self)
            return self._cs_call_keras(method, run, frame, args, kwargs)
        finally:
            table.release(entry)

    def _cs_call_keras(self, method, run, frame, args, kwargs):
        snapshot = _keras_compat.snapshot_variable_values(self)
        if GATE is not None:
            GATE.enter()
        try:
            with _scope.pushed(frame), _scope.running(run):
                return getattr(super(), method)(*args, **kwargs)
        except BaseException:
            _keras_compat.restore_purged_values(self, snapshot)
            raise
        finally:
            if GATE is not None:
                GATE.exit()

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

    # ------------------------------------------------------------------
    # The made functions: per-run values in, captured values out
    # ------------------------------------------------------------------
    def _cs_wrap_function(self, kind: str):
        entry = self._cs_entry_now()
        function = entry.functions[kind]
        if function is None or isinstance(function, _RunFunction):
            return function
        wrapped = entry.functions[kind] = _RunFunction(self, kind, function)
        return wrapped

    def _cs_make(self, kind: str, make, force: bool):
        # JAX's trainer reads `self.<kind>_step` once, at make time, and keys its
        # trace cache on that callable: it must see the key's own closure then.
        # TF and torch read it at trace or call time, through the dispatcher.
        name = f"{kind}_step"
        with self._cs.make_lock:
            dispatcher = self.__dict__.get(name)
            if _JAX and isinstance(dispatcher, _StepDispatch):
                _keras_compat.set_instance_attribute(
                    self, name, self._cs_entry_now().steps[kind])
            try:
                make(force=force)
            finally:
                if _JAX and isinstance(dispatcher, _StepDispatch):
                    _keras_compat.set_instance_attribute(self, name, dispatcher)
        return self._cs_wrap_function(kind)

    def make_train_function(self, force=False):
        return self._cs_make("train", super().make_train_function, force)

    def make_test_function(self, force=False):
        return self._cs_make("test", super().make_test_function, force)

    def make_predict_function(self, force=False):
        return self._cs_make("predict", super().make_predict_function, force)

    def compile(self, *args, **kwargs):
        # A new compile invalidates every key's functions (Keras resets its own).
        self._cs_table().clear()
        return super().compile(*args, **kwargs)

    def compile_from_config(self, config):
        # Keras skips compiling on load when `compile` is overridden
        # (trainer.py:1003); ours only clears the cache, so compile as stock does,
        # unless the user's own `compile` takes other arguments: then warn and
        # load uncompiled, as stock Keras does for any overridden `compile`.
        return _keras_compat.compile_from_config(self, config, ContextMixin.compile)

    # ------------------------------------------------------------------
    # Delivery to the layers
    # ------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        state = self._cs
        leaves = keras.tree.flatten(args)
        symbolic = _backend.is_symbolic(leaves)
        tracing = not symbolic and _backend.is_tracing(leaves)
        inside_step = (_collector.active_collector() is not None
                       or _collector.active_patches() is not None)
        if not symbolic and not inside_step:
            captures, patches = _scope.captures_for(self), _scope.patches_for(self)
            if (captures or patches) and not (tracing and _scope.run_of(self) is not None):
                # (A trace inside this model's own run, such as Keras's symbolic
                # build, is not a call of its own.)
                if tracing:
                    raise RuntimeError(_OUTSIDE_COMPILE.format(
                        what="cs.capture" if captures else "cs.patch",
                        model=type(self).__name__))
                return self._cs_call_capturing(captures, patches, args, kwargs)
        gated = GATE is not None and not symbolic and not tracing
        if gated:
            GATE.enter()
        try:
            if not state.names and not isinstance(self, _STRICT_KWARGS_CLASSES):
                return super().__call__(*args, **kwargs)
            allowed = _direct_call_parameters(self)
            given = self._cs_split("__call__", kwargs, allowed)
            values = self._cs_resolve(given, tracing=tracing)
            frame = _scope.overlay({**dict.fromkeys(state.names), **values}, keyed=True)
            with _scope.pushed(frame):
                kwargs.update({n: _delivered(v) for n, v in values.items()})
                return super().__call__(*args, **kwargs)
        finally:
            if gated:
                GATE.exit()

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
        tracing = _backend.is_tracing(keras.tree.flatten(args))
        values = self._cs_resolve(given, tracing=tracing)
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
        with _scope.pushed(_scope.overlay(pushed, keyed=True)):
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



class _RunFunction:
    """Wraps a made `*_function`: puts the run's dynamic values in, and takes its
    captured values out before Keras's loop sees them.

    It reads the run from the caller's context, so the same compiled function
    serves every run of its key, each with its own values and sinks.
    """

    def __init__(self, model, kind: str, function):
        self.model, self.kind, self.__wrapped__ = model, kind, function

    def __call__(self, *args, **kwargs):
        model, function = self.model, self.__wrapped__
        run = _scope.run_of(model)
        if run is not None and run.dynamic and _JAX:
            args = (_backend.with_state_values(args[0], run.dynamic), *args[1:])
        with contextlib.ExitStack() as stack:
            state = model._cs
            if run is not None and _keras_compat.replicas(model) > 1:
                # Replica threads see no contextvars: they find the entry here.
                stack.enter_context(state.replica_lock)
                state.replica_entry = run.entry
                stack.callback(setattr, state, "replica_entry", None)
            if run is not None and run.dynamic and not _JAX:
                stack.enter_context(state.dynamic_lock)
                for variable, array in run.dynamic:
                    variable.assign(array)
            result = function(*args, **kwargs)
        return _steps.pop_sown(self.kind, result, run)


_OUTSIDE_COMPILE = (
    "{what} cannot record or intervene inside a function it did not compile: "
    "`{model}` was called inside your own `jax.jit`/`tf.function`/`torch.compile`, "
    "so what it records would be tracers of your trace, and a cached run of your "
    "function would silently skip it. Call the model outside your compiled "
    "function under the scope, or capture through `fit`/`evaluate`/`predict`, "
    "which compile the capture themselves. Received: a traced call of {model}"
)
_JAX = keras.backend.backend() == "jax"


def _delivered(value):
    return value.value if isinstance(value, keras.Variable) else value


def unknown_argument_error(method: str, name: str, registered: set[str]) -> TypeError:
    known = ", ".join(sorted(registered)) or "none"
    return TypeError(
        f"`{method}()` got an unexpected keyword argument `{name}`. It is neither an "
        f"argument of `{method}()` nor a registered context argument "
        f"(registered: {known}). To pass it to the model's layers, declare it with "
        f"`model.register_context_args({name!r})` or decorate the model class with "
        f"`@callscope.context_args({name!r})`. Received: {name}=..."
    )


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
            names |= _keras_compat.PRIVATE_EVALUATE_ARGUMENTS  # fit's validation
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
