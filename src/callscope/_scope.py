"""The caller's scopes: context values, open captures and patches, running calls.

Everything a call needs to know about *who called it* lives in `contextvars`, never
on the model: a `cs.context`, `cs.capture` or `cs.patch` scope is visible to the
thread (or asyncio task) that opened it and to the calls made inside it, and to
nothing else. A worker thread started inside a scope does not inherit it (Python
starts threads with an empty context) unless it runs under
`contextvars.copy_context().run(...)`.

A `Frame` is one immutable layer of context values. Frames pushed eagerly (by
`cs.context` or an entry point) are *outside* any trace. A compiled step pushes a
*sealed* frame holding exactly the values of its key; a value that a trace would
read but that its key does not hold is an error (`StrayValueError`), never a
constant frozen into the trace.

While a made function runs (`steps_of`), the scopes are read from a thread-local
copy instead of the `contextvars` (`ScopeVar`): torch.compile cannot trace
`ContextVar.get`, and a graph break in every layer's wrapper would compile each
layer's resumed frame apart, up to dynamo's recompile limit.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import keras

from callscope import _backend, _keras_compat

_EMPTY: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class Frame:
    """The context values in effect, and where they were set.

    Attributes:
        values: name -> value (None means "not set").
        sealed: pushed inside a compiled step; holds exactly its key's values.
        outside: with `sealed`, the values of the caller's scope that are not part
            of the key (reading one is an error).
        reads: with `sealed`, the names outside the key that the trace looked up
            (the key's entry keeps them: a later call that sets one is refused).
        keyed: the names whose values were set by a call that keys its compiled
            functions on them (an entry point, a model's `__call__`, a step), and
            so may be read inside a trace. A `cs.context` value is not keyed until
            a model that registered the name takes it.
    """

    values: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    sealed: bool = False
    outside: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    keyed: frozenset = frozenset()
    reads: set | None = None
    # The frame it was made over, and the user's scope that pushed it (`Entered`),
    # if one did: a call that ends with a scope opened inside it still open (a
    # callback's) takes it away, and its later exit must not put the call's frame
    # back (`pushed`).
    parent: Frame | None = field(default=None, compare=False, repr=False)
    owner: Any = field(default=None, compare=False, repr=False)


class _Pinned(threading.local):
    """While a made function runs in this thread (`steps_of`): `on`, each
    `ScopeVar`'s value as an attribute of its name, `given` the caller's set
    values, and `joins` the sets to update after the call (`join_after`).
    (Set in `__init__`, each thread's first use: an attribute that is first a class
    default, then the instance's own, fails a compiled step's guard once. To the
    defaults, not the thread's values then: those of a thread that runs in a
    copied context are its caller's open scopes, and a pool's worker kept them,
    and the captures, patches and models they hold, alive for its life.)"""

    def __init__(self):
        self.on = False
        self.given = {}
        self.joins = []
        for var in _VARS:
            setattr(self, var.name, var.default)



class _PinnedToken(tuple):
    """What `ScopeVar.set` returns while pinned: `(value before,)`."""


class ScopeVar:
    """A `ContextVar`, but for the length of a made function's call (`steps_of`).

    torch.compile's dynamo cannot trace `ContextVar.get` or `set` (torch 2.13: a
    graph break), and a compiled step reads the scopes in every layer. `steps_of`
    copies every scope into attributes of a thread-local object, which a step reads
    and writes instead: dynamo traces that, and guards on what it read. (Not a dict:
    dynamo refuses a mappingproxy, such as Keras's `inspect.signature(...)
    .parameters` in every layer call, once a dict that existed before the trace has
    changed.) A made function runs synchronously in the caller's thread
    (tf.distribute replica threads see neither), so it sees exactly what the
    `ContextVar`s would give it.
    """

    def __init__(self, name: str, default: Any):
        self.name, self.default = name, default
        self.var = contextvars.ContextVar(f"callscope_{name}", default=default)

    def get(self) -> Any:
        return getattr(_PINNED, self.name) if _PINNED.on else self.var.get()

    def set(self, value: Any):
        if not _PINNED.on:
            return self.var.set(value)
        token = _PinnedToken((getattr(_PINNED, self.name),))
        setattr(_PINNED, self.name, value)
        return token

    def reset(self, token) -> None:
        if isinstance(token, _PinnedToken):
            setattr(_PINNED, self.name, token[0])
        else:
            self.var.reset(token)


_ROOT = Frame()  # immutable: safe as a ContextVar default
_FRAME = ScopeVar("frame", _ROOT)
_CAPTURES = ScopeVar("captures", ())
_PATCHES = ScopeVar("patches", ())
_RUNS = ScopeVar("runs", ())
_STEPPING = ScopeVar("stepping", ())
_VARS = (_FRAME, _CAPTURES, _PATCHES, _RUNS, _STEPPING)
_PINNED = _Pinned()


class StrayValueError(RuntimeError):
    """A context value would be read inside a compiled function not keyed on it:
    frozen into that function, it would be reused silently by later calls. Also a
    scope a callback opens while a call runs, whose value the call would ignore.

    Example:

    >>> import keras, numpy as np, callscope as cs
    >>> @cs.context_args("debugging")
    ... class Block(keras.layers.Layer):
    ...     def call(self, x, debugging=None):
    ...         return x * 0.0 if debugging else x
    >>> model = keras.Sequential([keras.Input((2,)), Block()])  # a stock model
    >>> try:
    ...     with cs.context(debugging=True):
    ...         _ = model.predict(np.ones((1, 2)), verbose=0)
    ... except cs.StrayValueError as error:
    ...     print(type(error).__name__)
    StrayValueError
    """

    def __init__(self, *args):
        super().__init__(*args)
        _refused_here()
        # (A refusal inside a plain Keras model's loop, on JAX, left it without weights.)
        _keras_compat.put_back_stock_loop_weights()


def _refused_here() -> None:
    """A refusal made where the user's scopes are open (in this thread or task, a
    compiled step's included) said what they would have done: each counts as
    reached, and warns nothing as it exits (`Entered`), even if it is caught
    there. (Another thread's refusal is not theirs.)"""
    for frame_ in {id(f): f for f in (_FRAME.var.get(), _FRAME.get())}.values():
        while frame_ is not None:
            if frame_.owner is not None:
                frame_.owner.reached = True
            frame_ = frame_.parent
    for item in _PATCHES.get():
        item.scope.reached = True


STRAY_VALUE = (
    "Context argument `{name}` is set in the caller's scope ({value!r}), but it is "
    "read inside a compiled function whose key does not include `{name}`: the value "
    "would be frozen into that function and silently reused by later calls. "
    "Fix: make the model that compiles the function know the name. "
    "Call `outer = cs.enable(outer)` and `outer.register_context_args({name!r})`, "
    "or decorate its class with `@cs.context_args({name!r})`. In a function you "
    "compile yourself (`jax.jit`, `tf.function`), or `cs.intermediate_grads`'s "
    "`loss_fn` on JAX (traced there), pass the value to the model's call instead "
    "(`model(x, {name}=...)`, `model.stateless_call(..., {name}=...)`), where the "
    "trace sees it. {opened_in_a_call}"
)
# The last words of both: a scope opened inside a call is never that call's.
_OPENED_IN_A_CALL = (
    "A scope opened while a call runs (in a callback of `fit`) is not that call's "
    "either: its values were fixed when it began; pass the value to the call itself "
    "(`fit(..., {name}=...)`). Received: {name}={value!r}")

# A value read in a callscope model's own step (a layer, its loss or metrics, a
# custom step) that its key lacks: the fix is that model's, compiled or not.
STRAY_IN_STEP = (
    "Context argument `{name}` is set in the caller's scope ({value!r}), but it is "
    "read in a step of the callscope model `{model}` (by a layer, a loss, a metric "
    "or a custom step), which does not register `{name}`: its steps are keyed on "
    "the names it registers, so a compiled step would freeze the value and silently "
    "reuse it in later calls (an eager step, `run_eagerly=True`, is refused alike, "
    "so that the code runs the same compiled). Fix: "
    "`model.register_context_args({name!r})` on `{model}` (with `dynamic=True` for "
    "numbers that change), or decorate its class with `@cs.context_args({name!r})`. "
    "{opened_in_a_call}"
)


def _stray(name: str, value: Any) -> StrayValueError:
    """The refusal of `name`'s value, read where a trace would freeze it: in a
    step of a callscope model (`stray_in_step`: the model is known, and so is
    the fix), or in a callscope model's build before its loop (Keras's symbolic
    build runs the loss and metrics on JAX), else anywhere (`STRAY_VALUE`)."""
    stepping_ = _STEPPING.get()
    model = stepping_[-1] if stepping_ else _keras_compat.building_model()
    if model is None or not _keras_compat.is_callscope(model):
        return StrayValueError(STRAY_VALUE.format(
            name=name, value=value,
            opened_in_a_call=_OPENED_IN_A_CALL.format(name=name, value=value)))
    return stray_in_step(name, value, model)


def stray_in_step(name: str, value: Any, model) -> StrayValueError:
    """The refusal of `name`'s value, read in a step of the callscope `model`
    that does not register it (`STRAY_IN_STEP`)."""
    return StrayValueError(STRAY_IN_STEP.format(
        name=name, value=value, model=model.name,
        opened_in_a_call=_OPENED_IN_A_CALL.format(name=name, value=value)))


# --------------------------------------------------------------------------
# Context values
# --------------------------------------------------------------------------
def frame() -> Frame:
    return _FRAME.get()


@contextlib.contextmanager
def pushed(frame_: Frame) -> Iterator[None]:
    token = push(frame_)
    try:
        yield
    except BaseException:
        _end_contexts_above(frame_, warn=False)
        pop(token)
        raise
    _end_contexts_above(frame_, warn=True)
    pop(token)


def _end_contexts_above(frame_: Frame, warn: bool) -> None:
    """A user's `cs.context` opened inside and still open when the call ends (a
    callback's, whose call raised before the callback closed it, or one it opened
    at the end) ends with the call, whose frame it sits on: its later exit does
    nothing (it put the call's frame back). `warn`: the call returned."""
    current = _FRAME.get()
    while current is not frame_ and current is not None:
        if current.owner is not None:
            current.owner.dropped = True
            if warn:
                warnings.warn(
                    f"{current.owner.what} was opened inside a call (in a callback, or a "
                    "layer's `call`) and was still open when the call returned, so it "
                    "ended with the call: later calls do not see it. Close it where it "
                    "was opened, or open it outside the call. Received: a scope left open "
                    "in a call", stacklevel=4)
        current = current.parent


def push(frame_: Frame):
    """`pushed` without a context manager, for a compiled step: dynamo cannot
    resume after a graph break (Keras's torch `train_step` has one, at
    `backward()`) inside a generator's `with`, only inside `try`/`finally`. Returns
    the token for `pop`."""
    return _FRAME.set(frame_)


def pop(token) -> None:
    _FRAME.reset(token)


def overlay(values: Mapping[str, Any], *, keyed: bool) -> Frame:
    """A frame with `values` over the current one (keeps its seal)."""
    current = _FRAME.get()
    if not values:
        return current
    names = frozenset(values)
    return Frame(MappingProxyType({**current.values, **values}), current.sealed,
                 current.outside, current.keyed | names if keyed else current.keyed - names,
                 current.reads, current)


def sealed(values: Mapping[str, Any]) -> Frame:
    """The frame one call of a compiled step runs under: exactly `values` (its key's,
    a mapping that never changes), with the caller's values outside them (reading
    one raises), and a `reads` set of its own, for the names outside the key that
    the step looks up. The caller adds those to the key's after the step: a
    compiled step must not change a set from before its trace while layers run
    (see `ScopeVar`).

    Inside a made function, the caller's set values were noted by `steps_of`; only
    their names are compared here, so a compiled step never guards on a dynamic
    value (a float would recompile at every new value)."""
    given = _PINNED.given if _PINNED.on else _FRAME.var.get().values
    outside = {n: given[n] for n in given if n not in values and given[n] is not None}
    return Frame(values, True, MappingProxyType(outside), frozenset(values), set())


def check_unkeyed(reads, keyed, model) -> None:
    """Refuses a call of `model` whose compiled function once looked up a name
    outside its key (`reads`) while the caller's scope now sets it: the cached
    function would silently ignore the value."""
    values = _FRAME.get().values
    for name in reads:
        if name not in keyed and values.get(name) is not None:
            raise stray_in_step(name, values[name], model)


NOT_PASSED = (
    "Context argument `{name}` is set in the caller's scope ({value!r}), but "
    "`{layer}` (which declares it with `@cs.context_args`) is called without it: no "
    "enclosing model passes it (a stock Keras model, such as `clone_model`'s copy "
    "of a `cs.Sequential`, called directly or in a callback of a call given the "
    "value; a layer called on its own; or a checkpoint, `keras.remat`, "
    "recomputing it in a backward pass after the model's call returned; or a "
    "`cs.context` opened in an eager call, around a function traced there: your own "
    "`jax.jit`, or on JAX an RNN's or a loop's body), so it would "
    "silently run with its default. Fix: run it inside a callscope model that "
    "registers the name (`model = cs.enable(model)` and "
    "`model.register_context_args({name!r})`), through `fit`/`train_on_batch` for a "
    "recompute, or pass it to the call (`layer(x, {name}=...)`). Received: "
    "{name}={value!r}"
)


def has_values() -> bool:
    """Whether any context value is set where this code runs (a cheap first test)."""
    current = _FRAME.get()
    return bool(current.values or current.outside)


def unpassed_values(layer, names) -> dict[str, Any]:
    """For a call of a `@cs.context_args` layer that no enclosing layer passes
    `names` (Keras's call context lacks them): the values a callscope model's
    call or step in progress keys on, which the layer must get (a checkpoint's
    recompute, or a custom step calling the layer, runs outside the model's call
    context). A value only the caller's scope sets raises: the layer would run
    with its default, silently."""
    current = _FRAME.get()
    found = {}
    for name in names:
        value = current.values.get(name)
        if value is not None:
            read_from(current, name)  # (a scope opened inside the call hands it over)
        else:
            value = current.outside.get(name)
        if value is None or _keras_compat.passed_by_an_outer_layer(name):
            continue
        if current.values.get(name) is None or name not in current.keyed and not (
                not _backend.is_tracing_now() and _set_inside_a_call(current, name)) or (
                _between_steps()):
            raise StrayValueError(NOT_PASSED.format(name=name, value=value, layer=layer.name))
        found[name] = value
    return found


def lookup(name: str, *, tracing: bool) -> Any:
    """The value of `name` in effect; raises where a trace would freeze it."""
    current = _FRAME.get()
    value = current.values.get(name)
    if current.sealed:
        if name not in current.values and current.reads is not None:
            current.reads.add(name)
        if value is None and name in current.outside:
            raise _stray(name, current.outside[name])
        if name in current.values:  # (a scope opened inside the step: to its sealed root)
            read_from(current, name)
        return value
    if value is not None and tracing and name not in current.keyed:
        raise _stray(name, value)
    read_from(current, name)
    return value


def read_from(frame_: Frame, name: str) -> None:
    """Marks `name` read in the user's scopes under `frame_` that set it (`NOT_READ`)."""
    while frame_ is not None:
        if frame_.owner is not None and name in frame_.owner.names:
            frame_.owner.read.add(name)
        frame_ = frame_.parent


def read_all(names, given) -> None:
    """`names` read at the start of a call that takes them, but those `given` to it
    (which win over a scope): before anything there may refuse the call, whose
    error says the rest."""
    current = _FRAME.get()
    if current.parent is not None:  # (a user's scope or a call's frame is open)
        for name in names:
            if name not in given:
                read_from(current, name)


def context(**values: Any) -> Entered:
    """Sets context arguments for every call of an enabled model in this scope.

    Values set here reach `fit`, `evaluate`, `predict`, the `*_on_batch` methods
    and `model(x)` of every model that registered the names, exactly as if they
    had been passed as keyword arguments. An explicit keyword argument wins over
    the scope. Scopes nest; the inner value wins.

    The scope follows the caller, like `contextvars`: it is seen by the thread or
    asyncio task that opened it and by the calls made inside it. A thread started
    inside the scope does not see it, unless it runs under
    `contextvars.copy_context().run(...)`.

    Example:

    >>> import callscope as cs
    >>> with cs.context(debugging=True):
    ...     cs.current("debugging")
    True
    >>> cs.current("debugging") is None
    True
    """
    shown = ", ".join(f"{name}={value!r}" for name, value in values.items())
    def opens(scope):
        # Opened inside a trace, it is part of that trace: its values may be read
        # there. Opened eagerly inside a call, its layers take its values, but a
        # trace begun inside it (your own `jax.jit` in a layer's call) must not.
        scope.inside_call = _opened_inside_a_call()
        return dataclasses.replace(overlay(values, keyed=bool(values) and (
            _backend.is_tracing_now())), parent=_FRAME.get(), owner=scope)

    return Entered(f"`cs.context({shown})`", _FRAME, opens, (lambda unread: NOT_READ.format(
            what=f"`cs.context({shown})`", names=", ".join(f"`{n}`" for n in unread),
            those="that value" if len(unread) == 1 else "those values",
            shown=", ".join(f"{n}={values[n]!r}" for n in unread))) if values else None,
        names=tuple(values))


def _between_steps() -> bool:
    """Whether calls are running here, each between its steps (in a callback): a
    layer called now is not part of their computation, though their values are in
    effect (a stock model's `predict` in a callback of `fit(debugging=True)` ran
    with the value, and its compiled function kept it for later calls)."""
    runs = _RUNS.get()
    return bool(runs) and not any(calling(run) for run in runs)


def _opened_inside_a_call() -> bool:
    """Whether a scope opened here is part of a call's computation, whose values
    its declaring layers take as if passed (`unpassed_values`): inside a layer's
    call or a step of a callscope model (eager, as torch's steps run; in a trace,
    its values are the trace's own). A scope opened between a call's steps (in
    a callback), or around a call, is not: a model that registered the names
    carries it in."""
    return (_keras_compat.current_call_context() is not None
            or any(stepping(run.model) for run in _RUNS.get()))


def set_by_a_call(name: str) -> bool:
    """Was `name`'s value in effect set by a call's frame (an enclosing model's
    call or step), not by a user's `cs.context`?"""
    frame_ = _FRAME.get()
    while frame_ is not None:
        parent = frame_.parent
        if parent is None or parent.values.get(name) is not frame_.values.get(name):
            return frame_.owner is None
        frame_ = parent
    return False


def _set_inside_a_call(frame_: Frame, name: str) -> bool:
    """Was `name`'s value set by a user's scope opened inside a call's computation?"""
    while frame_ is not None:
        if frame_.owner is not None and name in frame_.owner.names:
            return frame_.owner.inside_call
        frame_ = frame_.parent
    return False


NOT_READ = (
    "{what}: no call inside it looked up {names}, so {those} changed nothing (a "
    "callscope model reads the names it registered at each call, and a "
    "`@cs.context_args` layer the names its class declares; `cs.current` reads too). A "
    "function compiled before the scope opened (your own `jax.jit` or `tf.function`, a "
    "stock model's `predict` run once already) runs its trace and never reads it: pass "
    "the value to the model's call inside the function, or `cs.enable` the stock model "
    "and register the names. Received: {shown}")


def current(name: str, default: Any = None) -> Any:
    """The value of context argument `name` in effect, or `default`.

    Works in a layer's `call`, in `train_step`/`test_step`/`predict_step`
    (including the stateless JAX style) and in callbacks. Inside a compiled step a
    static value is a plain Python value; a dynamic one is a tensor (on TF and
    torch, the variable that holds it). Elsewhere (a direct `model(x)`, a
    callback) a dynamic value is what was set (a number, a numpy array, or a
    tensor passed as it is), while a layer that declares the name receives it as
    a tensor: `keras.ops.convert_to_tensor` it where a tensor is needed.
    Inside a compiled function that is not keyed on `name`, a value set outside
    raises instead of being frozen into the function.

    Example:

    >>> import callscope as cs
    >>> cs.current("mode", default="eval")
    'eval'
    >>> with cs.context(mode="train"):
    ...     cs.current("mode")
    'train'
    """
    current_frame = _FRAME.get()
    value = current_frame.values.get(name)
    tracing = (value is not None and not current_frame.sealed
               and name not in current_frame.keyed and _backend.is_tracing_now())
    value = lookup(name, tracing=tracing)
    if value is None:
        return default
    if isinstance(value, keras.Variable):  # a dynamic value
        return variable_value(value)
    return value


# JAX: id(variable) -> its value in the state of the step being traced, for the
# dynamic values' variables (`enter_step_state`).
_STEP_STATE: contextvars.ContextVar = contextvars.ContextVar("callscope_step_state",
                                                             default=None)


def variable_value(variable):
    """A dynamic value's variable, read where the caller runs. Inside a JAX step,
    Keras's loop holds the value in the step's state and has purged it from the
    variable: a `keras.StatelessScope` (`stateless_call`) maps it, and elsewhere
    in the step (a stateless `train_step`'s own code) the state does."""
    state = _STEP_STATE.get()
    if state is not None and id(variable) in state and (
            _keras_compat.stateless_value(variable) is None):
        return state[id(variable)]
    return variable.value


def enter_step_state(model, state):
    """JAX: while a step traces, its state's values of the dynamic values'
    variables (`variable_value`); returns the token for `exit_step_state`."""
    hidden = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
    found = {id(v): state[1][hidden[id(v)]] for v in model._cs.dynamic.values()
             if v is not None and id(v) in hidden}
    return _STEP_STATE.set(found or None)


def exit_step_state(token) -> None:
    _STEP_STATE.reset(token)


# --------------------------------------------------------------------------
# Open captures and patches, and the runs in progress
# --------------------------------------------------------------------------
@contextlib.contextmanager
def opened(var: ScopeVar, item: Any) -> Iterator[None]:
    token = var.set((*var.get(), item))
    try:
        yield
    finally:
        var.reset(token)


class Entered(contextlib.ContextDecorator):
    """A user's scope (`cs.context`, `cs.patch`): `var` holds what `opens(self)`
    gives when it is entered, until it exits (`close`).

    Not a generator: an exit that is refused (`close`) leaves the scope open, for
    the right exit. A generator's scope was over by then: in another thread its
    `var.reset` raised a bare ValueError, and the scope stayed open for good in
    the thread that entered it."""

    def __init__(self, what: str, var: ScopeVar, opens, unreached=None, names: tuple = ()):
        self.what, self.var, self.opens = what, var, opens
        # Warned where no call reached the scope: a patch's call; a lookup of each of
        # the `names` a context sets (`unreached(unread names)` says which were not).
        self.unreached, self.names = unreached, names
        self.token = self.thread = self.value = None
        self.dropped = self.reached = self.inside_call = False
        self.read: set[str] = set()  # of `names`, those a call looked up

    def _recreate_cm(self):  # used as a decorator: a scope of its own per call
        return Entered(self.what, self.var, self.opens, self.unreached, self.names)

    def __enter__(self) -> None:
        if self.token is not None:
            raise RuntimeError(f"{self.what} is open already: a scope is entered once at "
                               "a time. Open a new one (call it again) to nest another.")
        self.value = self.opens(self)
        self.token, self.dropped = self.var.set(self.value), False
        self.reached, self.read = False, set()
        # (Opened in a call for the output's shape only, it reaches nothing by design.)
        self.shapes_only = _keras_compat.in_symbolic_scope()
        self.thread = threading.current_thread().name

    def __exit__(self, *exc) -> None:
        item = self.value if self.var is _FRAME or self.value is None else self.value[-1]
        if not self.dropped:
            close(self.var, self.token, item, self.what, self.thread)
        self.token = self.thread = self.value = None
        # (A refusal while it was open, caught inside it, said the rest: reached.)
        if exc[0] is None and self.unreached is not None and not (
                self.reached or self.dropped or self.shapes_only):
            if not self.names:
                warnings.warn(self.unreached, stacklevel=_user_level())
            elif unread := [n for n in self.names if n not in self.read]:
                warnings.warn(self.unreached(unread), stacklevel=_user_level())


def _user_level() -> int:
    """The `stacklevel` of the user's line that exits a scope: its `with`, or the
    function a scope decorates (`@cs.context(...)`: contextlib's wrapper exits it)."""
    level, frame_ = 2, sys._getframe(2)
    while frame_ is not None and frame_.f_code.co_filename == contextlib.__file__:
        level, frame_ = level + 1, frame_.f_back
    return level


OTHER_CONTEXT = (
    "{what} was exited in another thread or asyncio task (another `contextvars."
    "Context`) than the one that entered it, where it is not open. It stays open where "
    "it was entered: exit it there (a `with` block does). A scope reaches the calls "
    "made inside it in its own thread or task; to carry it into a thread, start the "
    "thread's work under `contextvars.copy_context().run(...)`. Received: entered in "
    "thread {entered!r}, exited in thread {exited!r}")
CALL_INSIDE = (
    "{what} was exited while `{method}`, a call made inside it, runs (in one of its "
    "callbacks): the call keeps the scopes it began with to its end, so the scope "
    "would go on applying to it. It stays open: exit it after the call returns (a "
    "`with` block around the call does). Received: {what} exited during `{method}`")
SCOPE_INSIDE = (
    "{what} was exited while a scope opened inside it is still open: scopes close "
    "innermost first, and closing this one would end that one too, which would then "
    "put this one back on its own exit. It stays open: exit the inner one first (`with` "
    "blocks do), then this one again. (An `ExitStack` or a generator that exited it "
    "will not exit it again: call its `__exit__(None, None, None)` yourself, or it "
    "goes on applying to every call in this thread.) Received: {what} exited before "
    "the scope opened inside it")


def _holds(value, item) -> bool:
    """Whether a scope var's `value` holds `item` (a frame over it, or a tuple with it)."""
    if isinstance(value, Frame):
        while value is not None and value is not item:
            value = value.parent
        return value is not None
    return any(entry is item for entry in value)


def close(var: ScopeVar, token, item, what: str, thread: str | None) -> None:
    """`var.reset(token)`, the exit of the user's scope that set `item`, unless it
    would be wrong; then a clear error, and the scope stays open:
    - a call made inside it still runs (a callback exits it): `CALL_INSIDE`;
    - a scope opened inside it is still open: `SCOPE_INSIDE`;
    - another `contextvars.Context` (thread or asyncio task): `OTHER_CONTEXT`."""
    if token is None:
        raise RuntimeError(f"{what} is not open: it was exited already, or never entered.")
    index = _VARS.index(var)
    for run in reversed(_RUNS.get()):
        if run.scopes and _holds(run.scopes[index], item):
            raise RuntimeError(CALL_INSIDE.format(what=what, method=run.method))
    current = var.get()
    innermost = current is item if var is _FRAME else bool(current) and current[-1] is item
    if not innermost and _holds(current, item):
        raise RuntimeError(SCOPE_INSIDE.format(what=what))
    try:
        var.reset(token)
    except ValueError as error:  # set in another Context: nothing was reset
        raise RuntimeError(OTHER_CONTEXT.format(
            what=what, entered=thread, exited=threading.current_thread().name)) from error


def enter_capture(capture):
    return _CAPTURES.set((*_CAPTURES.get(), capture))


def exit_capture(token, capture, thread: str) -> None:
    close(_CAPTURES, token, capture, "A `cs.capture`", thread)


TWO_PATCHES = (
    "Two open cs.patch scopes patch {what}, and a point takes one patch at a time "
    "(one of the two would be lost). Put both changes in one function, or close "
    "one scope before opening the other. Received: {received}")


class _OpenPatch(tuple):
    """`(model, {point: fn})` of an open patch scope, and the scope (`.scope`)."""


@contextlib.contextmanager
def ending_scopes_opened_in(run) -> Iterator[None]:
    """A call that raises also ends the captures and patches opened inside it and
    still open (a callback's, whose call raised before the callback closed it):
    their later exit does nothing. (They stayed open: a patch went on patching
    every later call, a capture recording it. A context ends in `pushed`.) A call
    that returns leaves them open: a scope a callback opens at its end is the
    caller's from then on."""
    try:
        yield
    except BaseException:
        for index, var in ((1, _CAPTURES), (2, _PATCHES)):
            began, now = run.scopes[index], var.get()
            if now is began or len(now) <= len(began) or any(
                    a is not b for a, b in zip(now, began)):
                continue
            for item in now[len(began):]:
                getattr(item, "scope", item).dropped = True
            var.set(began)
        raise


def open_patch(model, patches: Mapping) -> Entered:
    """The scope of `patches` on `model`; one that patches a point an open scope
    on the same model patches is refused when it is entered (`TWO_PATCHES`; other
    models' points that are one layer are refused when a call reaches it:
    `Patches.find`)."""

    def opens(scope) -> tuple:
        for owner, open_ones in _PATCHES.get():
            both = sorted(set(open_ones).intersection(patches)) if owner is model else ()
            if both:
                raise ValueError(TWO_PATCHES.format(
                    what=f"{', '.join(f'`{p}`' for p in both)} of `{model.name}`",
                    received=f"patches={sorted(patches)}"))
        item = _OpenPatch((model, patches))
        item.scope = scope
        return (*_PATCHES.get(), item)

    return Entered(f"`cs.patch` of {sorted(patches)}", _PATCHES, opens, NO_CALL.format(
        what=f"cs.patch of {sorted(patches)}", model=model.name, effect="it patched nothing"))


NO_CALL = (
    "{what} saw no call of `{model}`, so {effect}. It applies to the model's `fit`, "
    "`evaluate`, `predict`, `*_on_batch` and `model(x)` calls (and those of a callscope "
    "model that holds it) made in this thread, or in a context copied inside the scope; "
    "a function compiled before the scope opened (your own `jax.jit` or `tf.function`) "
    "runs its trace and never calls the model "
    "again. Call the model inside the scope, in this thread. Received: 0 calls of "
    "`{model}`")


def records_open() -> bool:
    """Whether any capture or patch is open here (a cheap first test)."""
    return bool(_CAPTURES.get() or _PATCHES.get())


def open_captures() -> tuple:
    return _CAPTURES.get()


def open_patches() -> tuple:
    """`(model, {point: fn})` of each open patch scope."""
    return _PATCHES.get()


def captures_where(owned) -> tuple:
    """The open captures whose model satisfies `owned(model)`, asked for by a call
    of that model: each is marked reached (one that no call reached warns as it
    exits that it is empty: `NO_CALL`)."""
    found = tuple(c for c in _CAPTURES.get() if owned(c.model))
    for capture in found:
        capture.reached = True
    return found


def patches_where(owned) -> tuple:
    """The open patches of models that satisfy `owned`, as `(id(owner), point,
    fn)` (each point of a model is in one scope: `open_patch`), asked for by a call
    of that model: their scopes are marked reached, as `captures_where` does."""
    found = []
    for item in _PATCHES.get():
        owner, patches = item
        if owned(owner):
            item.scope.reached = True
            found += [(id(owner), point, fn) for point, fn in patches.items()]
    return tuple(found)


def captures_for(model) -> tuple:
    return captures_where(lambda m: m is model)


def patches_for(model) -> tuple:
    return patches_where(lambda m: m is model)


def scopes_now() -> tuple:
    """The caller's scopes as they stand: (frame, captures, patches). A run keeps
    them as it begins, and compares them by identity before each step
    (`Run.check_before_step`)."""
    return _FRAME.get(), _CAPTURES.get(), _PATCHES.get()


def running(run):
    return opened(_RUNS, run)


class steps_of:
    """Marks that `model`'s made function is running (its steps belong to the run),
    and pins the scopes for its length (`ScopeVar`).

    It runs around every step, so it swaps the thread's pinned values in two dict
    updates (the thread-local's own dict, `vars`, which holds exactly the names that
    `_Pinned.__init__` set) rather than an attribute at a time: about 5 µs a step
    where 16 `setattr`s and their dicts took 3x that (a predict of 32 steps of
    4 ms spent ~2 ms more of the main thread's CPU than Keras's own loop)."""

    __slots__ = ("_model", "_outer", "_joins")

    def __init__(self, model):
        self._model = model

    def __enter__(self) -> None:
        pinned = vars(_PINNED)
        self._outer = outer = pinned.copy()
        if outer["on"]:  # nested: the pinned values are the scopes
            frame_, stepping_ = outer[_FRAME.name], outer[_STEPPING.name]
            values = {var.name: outer[var.name] for var in _VARS}
        else:
            values = {var.name: var.var.get() for var in _VARS}
            frame_, stepping_ = values[_FRAME.name], values[_STEPPING.name]
        values[_STEPPING.name] = (*stepping_, self._model)
        # The caller's set values, for `sealed`: read here, outside the compiled
        # step (a value not None is set).
        values["given"] = {n: v for n, v in frame_.values.items() if v is not None}
        values["joins"] = self._joins = []
        values["on"] = True
        pinned.update(values)

    def __exit__(self, *exc) -> None:
        vars(_PINNED).update(self._outer)
        for later, items in self._joins:  # also after a raise: what a trace learned
            later.join(items)


class Later:
    """A set (or dict) that steps add to after each made function's call
    (`join_after`). Held in a plain object: a compiled step that hands a set
    itself on guards on what it holds, and compiles again once it holds more."""

    __slots__ = ("target",)

    def __init__(self, target):
        self.target = target

    def join(self, items) -> None:
        self.target.update(items)


class LaterByTrace(Later):
    """A dict of sets by trace number, joined set by set: the steps of one trace
    (TF's `steps_per_execution`, each replica of tf.distribute) add theirs."""

    __slots__ = ()

    def join(self, items) -> None:
        for number, points in items.items():
            self.target.setdefault(number, set()).update(points)


def join_after(later: Later, items) -> None:
    """`later.target.update(items)`, or, in a made function's call, when it
    returns. A step notes what its trace learned in sets of its key (the names it
    looked up outside the key, the patched points it reached)."""
    if _PINNED.on:
        _PINNED.joins.append((later, items))
    else:
        later.join(items)


def stepping(model) -> bool:
    return any(m is model for m in _STEPPING.get())


def calling(run) -> bool:
    """Is `run` in one of its steps, or a direct call? Between its steps (its
    callbacks) it is not."""
    return run.method == "__call__" or stepping(run.model)


def run_inside(layer) -> bool:
    """Is a run of `layer`, or of a model that holds it, in a step (or a direct
    call) here?"""
    return any(calling(run) and id(layer) in _keras_compat.layers_held(run.model)
               for run in _RUNS.get())


def runs_here() -> tuple:
    """The runs in progress in this thread, the innermost last."""
    return tuple(_RUNS.get())


def run_of(model):
    """The innermost run of `model` in this thread, or None."""
    for run in reversed(_RUNS.get()):
        if run.model is model:
            return run
    return None
