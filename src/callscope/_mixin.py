"""`ContextMixin`: context arguments, captures and patches for a Keras model.

`cs.Model` and `cs.Sequential` are `ContextMixin` on top of the Keras classes, and
`cs.enable` builds the same thing dynamically. Here: declaring names, resolving the
values of a call (explicit keyword > the caller's scope > unset), and delivering
them to the layers through a direct `model(x)` and the JAX `stateless_call`. The
entry points and compiled functions are the engine's (`_engine.py`).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Mapping, Set
from typing import Any

import keras
import numpy as np

from callscope import _backend, _grad, _keras_compat, _keys, _record, _scope
from callscope._engine import Engine, _State, check_not_feeding

_JAX_HOOKS = ((_keras_compat.AuxHook, _keras_compat.SyncHook)
              if keras.backend.backend() == "jax" else ())


_INHERITED_TENSOR = (
    "Context argument `{name}` is static on `{model}` (registered without "
    "`dynamic=True`), but its value reached it as a tensor from its caller: an "
    "enclosing model that registers `{name}` with `dynamic=True` (its layers get "
    "the value as a tensor), or a `cs.context` that set one. A static value selects "
    "a compiled function, so it cannot be a tensor. Register the name alike on every "
    "model that takes it: `register_context_args({name!r}, dynamic=True)` on "
    "`{model}` too, or static on all. Received: {name}={value}")


# The parameters of the entry points (keras 3.15.1's `fit`, `evaluate`, `predict`
# and `*_on_batch`: name -> the first that takes it), and `inputs` and `mask`,
# which a model's `call` takes from Keras: a context argument of one of those
# names took the call's own argument (`fit(epochs=3)` ran 1 epoch).
_KERAS_NAMES = {"inputs": "__call__", "mask": "__call__"}
for _method in ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch",
                "predict_on_batch"):
    for _name in inspect.signature(getattr(keras.Model, _method)).parameters:
        if _name not in ("self", "kwargs"):
            _KERAS_NAMES.setdefault(_name, _method)


def check_not_keras_name(name: str, how: str) -> None:
    method = _KERAS_NAMES.get(name)
    if method is not None:
        what = ("an argument Keras passes to a model's `call`" if method == "__call__"
                else "a parameter of `fit`, `evaluate`, `predict` or the `*_on_batch` "
                "methods")
        shown = "model(x" if method == "__call__" else f"{method}(..."
        raise ValueError(
            f"`{name}` is {what}, so a call could not tell the context value from "
            f"Keras's own (`{shown}, {name}=...)` would set it, not Keras's). Name the "
            f"context argument otherwise (e.g. `{name}_mode`). Received: "
            f"a context argument {how} as name={name!r}")


class ContextMixin(Engine, _keras_compat.LossHook, *_JAX_HOOKS):
    """Adds context arguments, captures and patches to a Keras model. Used through
    `cs.Model`, `cs.Sequential` and `cs.enable`, or mixed in first, before the Keras
    class (after it, Keras's `fit`, `predict` and `__call__` would shadow its own:
    that class is refused).

    Example:

    >>> import keras, numpy as np, callscope as cs
    >>> class Net(cs.ContextMixin, keras.Model):
    ...     def call(self, x, scale=None):
    ...         return x * 2.0 if scale else x
    >>> net = Net()
    >>> net.register_context_args("scale")
    >>> net.predict(np.ones((1, 2)), scale=True, verbose=0).tolist()
    [[2.0, 2.0]]

    Attributes:
        context_cache_size: how many distinct non-default keys keep their compiled
            functions (LRU, default 8). Past that, the least recently used key that
            no running call uses is evicted with a warning, and retraces when it
            comes back.
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # Listed after a Keras class (`class Net(keras.Model, cs.ContextMixin)`),
        # Keras's `predict`, `fit` and `__call__` come first in the MRO: nothing of
        # callscope's ran, and a capture stayed empty without a word.
        mro = cls.__mro__
        keras_first = next((b for b in mro if b.__module__.startswith("keras.")
                            and not issubclass(b, ContextMixin)), None)  # (cs.enable's)
        if keras_first is not None and mro.index(keras_first) < mro.index(ContextMixin):
            raise TypeError(
                f"`cs.ContextMixin` must come before the Keras classes among "
                f"`{cls.__name__}`'s bases, or Keras's `fit`, `predict` and `__call__` "
                f"shadow callscope's. Write `class {cls.__name__}(cs.ContextMixin, "
                f"{', '.join(b.__name__ for b in cls.__bases__ if b is not ContextMixin)})`"
                ", or use `cs.Model` / `cs.Sequential`. "
                f"Received: bases={[b.__name__ for b in cls.__bases__]}")
        if _keras_compat.runs_its_own_loop(cls):
            # (Where `generate` makes its loop: a `generate` of your own that decodes
            # by calling the model stays a run of calls.)
            cls.make_generate_function = _record.refusing_under_scopes(
                cls.make_generate_function, "generate")

    # ------------------------------------------------------------------
    # Per-model registry
    # ------------------------------------------------------------------
    @property
    def _cs(self) -> _State:
        state = _keras_compat.get_instance_attribute(self, "_callscope_state")
        if state is None:
            state = _State(self)
            _keras_compat.set_instance_attribute(self, "_callscope_state", state)
            for name in getattr(type(self), "_callscope_context_args", ()):
                self.register_context_args(name)
        return state

    def get_config(self):
        # A subclassed model's config drops its `name` in stock Keras, so a loaded
        # model would get a made-up one, and its points (named from the model's
        # name down) would change. Keep it where `__init__` can take it back.
        config = super().get_config()
        if isinstance(config, dict) and "name" not in config and _takes_name(type(self)):
            config = {**config, "name": self.name}
        return config

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
            check_not_keras_name(name, "registered")
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
    def _cs_split(self, method: str, kwargs: dict, allowed: Set[str] | None,
                  keras_own: Set[str] = frozenset()) -> dict:
        """Pops registered names out of `kwargs`; rejects unknown keywords.
        `keras_own`: those Keras's own `method` takes, for the message."""
        names = self._cs.names
        given = {name: kwargs.pop(name) for name in list(kwargs) if name in names}
        if allowed is not None:
            for name in kwargs:
                if name not in allowed:
                    raise unknown_argument_error(method, name, names, kwargs[name],
                                                 overridden=name in keras_own)
        return given

    # ------------------------------------------------------------------
    # Resolving values
    # ------------------------------------------------------------------
    def _cs_resolve(self, given: Mapping[str, Any], *, tracing: bool = False) -> dict[str, Any]:
        """Explicit value > scope value > absent; validates static values."""
        state = self._cs
        if not state.unbaked:
            # Also where the first use is inside the user's own `jax.jit`,
            # `tf.function` or `torch.compile`: the graph's nodes are Python, read
            # by this very trace.
            _backend.untraced(_keras_compat.unbake_functional_defaults)(self, state.names)
            state.unbaked = True
        values = {}
        for name in state.names:
            value = given[name] if name in given else _scope.lookup(name, tracing=tracing)
            if value is None:
                continue
            if name in state.static:
                # (The plain types first: dynamo cannot trace `is_tensor_like`.)
                if (name not in given and type(value) not in _keys.STATIC_TYPES
                        and _keys.is_tensor_like(value) and hasattr(value, "shape")
                        and _scope.set_by_a_call(name)):
                    raise TypeError(_INHERITED_TENSOR.format(
                        name=name, model=type(self).__name__, value=_keys.shown(value)))
                _keys.check_static(name, value, lambda: _registered(state))
            values[name] = value
        return values

    # ------------------------------------------------------------------
    # Delivery to the layers
    # ------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        state = self._cs
        leaves = keras.tree.flatten(args)
        symbolic = _backend.is_symbolic(leaves)
        tracing = not symbolic and _backend.is_tracing(leaves)
        inside_step = (_record.active_collector() is not None
                       or _record.active_patches() is not None)
        if state.names and not symbolic:  # (before a refusal: its error says the rest)
            _scope.read_all(state.names, kwargs)
        if not symbolic and not inside_step:
            captures, patches = self._cs_call_scopes(tracing)
            if captures or patches:
                return self._cs_call_capturing(captures, patches, args, kwargs)
        elif not symbolic:
            _grad.check_scopes_applied(self)
        # A step's own call of the model takes no gate: the method running the step
        # took the turn it needs. (Taking it here too, a TF or torch predict step
        # holding the dynamic-input lock waited for an evaluate in another thread
        # that held the gate and waited for that lock.)
        # Nor does a replica thread of a multi-replica step that tf.distribute runs
        # eagerly (fit's, or a user's `strategy.run`, this model's or an outer
        # model's): the caller waits for its replicas, which wait for each other in
        # their collectives (a synchronized BatchNormalization); one holding the gate
        # there deadlocked the rest (they see no contextvars, so not `stepping`).
        eager = not symbolic and not tracing
        in_step = eager and (_scope.stepping(self) or _backend.in_replica_thread())
        gate = state.gate if eager and not in_step else None
        if gate is not None and state.reading:
            check_not_feeding(self, "__call__", frozenset(("turn",)))
        token = gate.enter() if gate is not None else None
        try:
            if not state.names and not isinstance(self, _STRICT_KWARGS_CLASSES):
                return super().__call__(*args, **kwargs)
            allowed = _direct_call_parameters(self)
            given = self._cs_split("__call__", kwargs, allowed)
            values = self._cs_resolve(given, tracing=tracing)
            frame = _scope.overlay({**dict.fromkeys(state.names), **values}, keyed=True)
            # (A value given to this model, nested, is its own: not its siblings'.)
            with _scope.pushed(frame), _keras_compat.restored_call_context(state.names):
                kwargs.update({n: _delivered(self._cs_direct_value(n, v, tracing),
                                             n in state.dynamic) for n, v in values.items()})
                return super().__call__(*args, **kwargs)
        finally:
            if gate is not None:
                gate.exit(token)

    def _cs_direct_value(self, name: str, value: Any, tracing: bool) -> Any:
        """A value a direct call passes: a dynamic Python or numpy number checked as
        the entry points check it, in the dtype its variable holds. A tensor goes
        as it is: the layers get it uncast (nothing to check a cast for), and a
        gradient or JAX transform with respect to it (`jax.grad`, a tape, torch's
        backward) stays connected. Nothing under `torch.compile`, whose graph the
        checks would break (`torch.jit.trace` runs them: plain Python)."""
        if (name not in self._cs.dynamic or (tracing and _backend.BACKEND == "torch"
                                              and not _backend.torch_jit_tracing())
                or (_keys.is_tensor_like(value)
                    and not isinstance(value, np.ndarray | np.generic))):
            return value
        return self._cs_dynamic_array(name, value)

    def _cs_call_scopes(self, tracing: bool) -> tuple[tuple, tuple]:
        """The captures and patches that a direct call (not a step's) runs under."""
        if tracing and _keras_compat.in_symbolic_scope():
            return (), ()  # (a shape-only trace reaches no scope)
        captures, patches = self._cs_scopes()
        if not (captures or patches) or (tracing and _scope.run_inside(self)):
            # (A shape-only trace, Keras's symbolic build, or a trace inside a step
            # of this model or of a model that holds it, is not a call of its own;
            # a callback's `jax.jit` of the model between steps is refused below.)
            return (), ()
        if tracing:
            # (On JAX, inside a plain model's loop, which took its weights out.)
            _keras_compat.put_back_stock_loop_weights()
            raise RuntimeError(_OUTSIDE_COMPILE.format(
                what="cs.capture" if captures else "cs.patch", model=type(self).__name__))
        return captures, patches

    def stateless_call(
        self, trainable_variables, non_trainable_variables, *args, return_losses=False, **kwargs
    ):
        state = self._cs
        if state.names:  # (before a refusal: its error says the rest)
            _scope.read_all(state.names, kwargs)
        if _record.active_collector() is not None or _record.active_patches() is not None:
            _grad.check_scopes_applied(self)
        else:
            # A direct stateless call under a capture or patch scope is a run of its
            # own, as `model(x)` is (Keras's `stateless_call` never calls `__call__`).
            leaves = keras.tree.flatten(args)
            captures, patches = self._cs_call_scopes(_backend.is_tracing(leaves))
            if captures or patches:
                return self._cs_call_capturing(
                    captures, patches, args, kwargs, state=(trainable_variables,
                                                            non_trainable_variables),
                    invoke=lambda: self.stateless_call(
                        trainable_variables, non_trainable_variables, *args,
                        return_losses=return_losses, **kwargs))
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
            value = self._cs_direct_value(name, value, tracing)
            if isinstance(value, keras.Variable) and id(value) in hidden:
                value = non_trainable_variables[hidden[id(value)]]
            delivered[name] = _delivered(value, name in state.dynamic)
            if name in state.dynamic:  # (in the dtype a call of the model gives)
                delivered[name] = _keras_compat.as_call_argument(self, delivered[name])
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


def _takes_name(cls) -> bool:
    try:
        parameters = inspect.signature(cls.__init__).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "name" or p.kind is p.VAR_KEYWORD for p in parameters)


_OUTSIDE_COMPILE = (
    "{what} cannot record or intervene inside a function it did not compile: "
    "`{model}` was called while another function was being compiled (your own "
    "`jax.jit`/`tf.function`/`torch.compile`/`torch.jit.trace`, or the fit/predict "
    "of an outer model that is not a callscope model), so what it records would be tracers of that "
    "trace, and a cached run of it would silently skip the capture. Call the model "
    "outside that function under the scope, or make the outer model a callscope "
    "model (`outer = cs.enable(outer)`) so that its fit/evaluate/predict compile "
    "the capture themselves. Received: a traced call of {model}"
)
_JAX = keras.backend.backend() == "jax"


def _delivered(value, dynamic: bool):
    """What a layer receives: a tensor for a dynamic value, the value itself for a
    static one."""
    if isinstance(value, keras.Variable):
        return value.value
    if dynamic and not keras.ops.is_tensor(value):
        array = np.asarray(value)
        if array.dtype.kind == "f":
            array = array.astype(keras.config.floatx())
        return keras.ops.convert_to_tensor(array)
    return value


def _registered(state) -> str:
    """The model's context arguments, for an error: `mode (static), temperature
    (dynamic)`."""
    return ", ".join([*(f"{n} (static)" for n in sorted(state.static)),
                      *(f"{n} (dynamic)" for n in sorted(state.dynamic))])


def unknown_argument_error(method: str, name: str, registered: set[str],
                           value: Any, overridden: bool = False) -> TypeError:
    known = ", ".join(sorted(registered)) or "none"
    if overridden:  # Keras's own takes it (and may pass it itself: fit's validation)
        return TypeError(
            f"`{method}()` got an unexpected keyword argument `{name}`: Keras's own "
            f"`{method}()` takes it, but the model's class overrides `{method}()` without "
            "it" + (" (`fit`'s validation passes every one of them)" if method == "evaluate"
                    else "") + ". Let the override take `**kwargs` and pass them on to "
            f"`super().{method}()`. Received: {name}={_keys.shown(value)}")
    return TypeError(
        f"`{method}()` got an unexpected keyword argument `{name}`. It is neither an "
        f"argument of `{method}()` nor a registered context argument "
        f"(registered: {known}). To pass it to the model's layers, declare it with "
        f"`model.register_context_args({name!r})` or decorate the model class with "
        f"`@callscope.context_args({name!r})`. Received: {name}={_keys.shown(value)}"
    )


_STRICT_KWARGS_CLASSES = (keras.Sequential, _keras_compat.functional_class())


def _direct_call_parameters(model) -> set[str] | None:
    """Keywords a direct `model(...)` takes, for models whose call eats **kwargs.

    Keras's Sequential and Functional `call` accept and silently drop any keyword,
    so a typo'd context argument would do nothing. For them only the named
    parameters pass; a subclassed model's own signature is left to Python.
    """
    if not isinstance(model, _STRICT_KWARGS_CLASSES):
        return None
    cls = type(model)
    names = _CALL_PARAMETERS.get(cls)
    if names is None:  # once per class: `inspect.signature` costs ~10 us a call
        params = inspect.signature(cls.call).parameters
        names = _CALL_PARAMETERS[cls] = frozenset(
            n for n, p in params.items() if p.kind is not p.VAR_KEYWORD and n != "self")
    return names


_CALL_PARAMETERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
