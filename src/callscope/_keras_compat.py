"""Every use of private Keras API, in one place.

callscope rides on a few Keras internals that have no public equivalent. Each
function below names the internal it touches and the Keras version it was checked
against. Where Keras's behaviour differs between versions (3.15 drops context
arguments in `stateless_call` and bakes signature defaults into Functional nodes;
3.16 fixes both), the workaround is switched on by a behavioural probe run once per
process, never by a version string, so it switches itself off on a Keras that no
longer needs it.

`tests/test_keras_compat.py` asserts that every attribute used here still exists,
so a Keras upgrade that moves one fails loudly instead of silently.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import sys
import threading

import keras
from keras.src.backend.common import global_state as _global_state
from keras.src.backend.common import masking as _masking

CHECKED_AGAINST = "3.15.1"


def _jax_core():
    """JAX's own core module (jax 0.10.2: jax/_src/core.py), for `jax_at_top_level`."""
    from jax._src import core

    return core


# (object, attribute) pairs this module relies on. Checked by the tests.
REQUIRED_ATTRIBUTES = (
    (keras.layers.Layer, "_call_context_args"),  # instance attr, layer.py:326
    (keras.layers.Layer, "_call_has_context_arg"),  # instance attr, layer.py:327
    (keras.layers.Layer, "_register_call_context_args"),  # layer.py:1803
    (keras.layers.Layer, "_get_call_context"),  # layer.py:1691
    (keras.layers.Layer, "_maybe_reset_call_context"),  # layer.py:1703
    (keras.layers.Layer, "_tracker"),  # instance attr, layer.py:~350
    (keras.layers.Layer, "_non_trainable_variables"),  # layer.py:1444
    (keras.Model, "_compute_loss"),  # trainers/trainer.py:404, hooked by LossHook
    (keras.Model, "_flatten_layers"),  # layers/layer.py:1708
    (keras.Model, "_symbolic_build"),  # trainers/trainer.py:1125
    (keras.layers.Layer, "_seed_generators"),  # instance attr, layer.py:393
    (keras.layers.Layer, "_remat_mode"),  # instance attr, ops/operation.py:34
    (keras.layers.Layer, "_convert_input_args"),  # instance attr, layer.py:337
    (_global_state, "get_global_attribute"),  # backend/common/global_state.py
    (_masking, "get_keras_mask"),  # backend/common/masking.py:16
    (_masking, "set_keras_mask"),  # backend/common/masking.py:5
) + (
    (
        (keras.Model, "_update_metrics_variables"),  # backend/jax/trainer.py:98
        (keras.Model, "compute_loss_and_updates"),  # backend/jax/trainer.py:60
        (keras.Model, "jax_state_sync"),  # backend/jax/trainer.py:880
        (keras.Model, "_jax_state_synced"),  # instance attr, backend/jax/trainer.py:37
        (keras.Model, "_get_jax_state"),  # backend/jax/trainer.py:1039
        (_jax_core(), "trace_state_clean"),  # jax 0.10.2: jax/_src/core.py:1561
    )
    if keras.backend.backend() == "jax" else ()
)


def has_private_attribute(cls, name):
    """True if `cls` or a fresh instance of it has `name` (for the tests)."""
    if hasattr(cls, name):
        return True
    if not isinstance(cls, type):  # a module (JAX's core)
        return False
    probe = cls() if cls is not keras.layers.Layer else keras.layers.Layer()
    return hasattr(probe, name)


# --------------------------------------------------------------------------
# Registration (keras 3.15.1: layers/layer.py:1803-1862)
# --------------------------------------------------------------------------
def register_call_context_args(layer, names):
    """Registers `names` on `layer`, also after it has been called.

    `_register_call_context_args` refuses once `layer._called` is set (any
    symbolic call sets it), so for a called layer the two attributes it would set
    are updated directly. Checked against keras 3.15.1.
    """
    names = tuple(names)
    if not getattr(layer, "_called", False):
        layer._register_call_context_args(*names)
        return
    layer._call_context_args = set(layer._call_context_args) | set(names)
    params = layer.call_signature_parameters
    layer._call_has_context_arg.update({n: n in params for n in names})


def registered_call_context_args(layer):
    """The names Keras propagates through `layer` (always includes training)."""
    return set(getattr(layer, "_call_context_args", ()))


def call_signature_parameters(layer):
    """Parameter names of the layer's own `call` (cached by Keras at init, so an
    instance-level wrapper installed by a capture does not hide them)."""
    return set(layer.call_signature_parameters)


# --------------------------------------------------------------------------
# Instance attributes callscope writes without Keras's attribute tracking
# (keras 3.15.1: Layer.__setattr__ tracks every value, at a cost of ms per call,
# and would try to track our callables)
# --------------------------------------------------------------------------
def set_instance_attribute(obj, name, value):
    """Writes `obj.__dict__[name]`, bypassing `Layer.__setattr__`. Checked 3.15.1."""
    obj.__dict__[name] = value


def set_instance_call(layer, wrapper, name="call"):
    """Shadows `layer.call` (or `layer.quantized_call`) for `Operation.__call__`
    (keras 3.15.1: ops/operation.py:46-79, `self.quantized_call(...)` when the
    layer is quantized, else `self.call(...)`)."""
    layer.__dict__[name] = wrapper


def get_instance_attribute(obj, name, default=None):
    """`obj.__dict__.get(name)`: what callscope put there, or a layer's own."""
    return obj.__dict__.get(name, default)


def rebase(cls, bases):
    """`cls.__bases__ = bases`: what Keras's `inject_functional_model_class` does
    to a `keras.Model` subclass built the functional way (3.15.1:
    models/model.py:inject_functional_model_class)."""
    cls.__bases__ = bases


def swap_class(obj, cls):
    """`obj.__class__ = cls` (what `cs.enable` does; Keras reads the class name
    for serialization from `__name__`/registration, so the subclass keeps both)."""
    obj.__class__ = cls


# --------------------------------------------------------------------------
# Keras masks (keras 3.15.1: backend/common/masking.py). A tensor's mask is an
# attribute (or, for a JAX array, an entry keyed by its id); `Layer.__call__`
# keeps a mask already on a call's output (layers/layer.py:1725-1741).
# --------------------------------------------------------------------------
def keras_mask(tensor):
    """The Keras mask set on `tensor`, or None."""
    return _masking.get_keras_mask(tensor)


def set_keras_mask(tensor, mask) -> None:
    _masking.set_keras_mask(tensor, mask)


# --------------------------------------------------------------------------
# Logits under a probability (keras 3.15.1: backend/tensorflow/nn.py:41-45 and
# :166-173, activations/activations.py:158-163 and :497-502 set `_keras_logits` on
# a sigmoid's or softmax's output; `_get_logits`, nn.py:1262-1295, makes every
# crossentropy compute from them, exactly where the probability saturates. It also
# takes the input of a graph tensor's `Sigmoid` op for a binary crossentropy, and a
# `Softmax` op's for a categorical one: not kept here, since an attribute would
# serve either loss, whatever the op.)
# --------------------------------------------------------------------------
def keras_logits(tensor):
    """The logits Keras keeps on a sigmoid's or softmax's output (TF), or None."""
    return getattr(tensor, "_keras_logits", None)


def set_keras_logits(tensor, logits) -> None:
    tensor._keras_logits = logits


# --------------------------------------------------------------------------
# State owned by the model but not a weight (keras 3.15.1: layers/layer.py:664-700)
# --------------------------------------------------------------------------
class _HiddenState:
    """Looks like a SeedGenerator to `Layer.variables`: its `state` joins
    `variables`/`non_trainable_variables` (so JAX threads it through compiled
    steps), but not `weights`, `get_weights()` or the saved file (saving only walks
    KerasSaveable objects)."""

    def __init__(self, variable):
        self.state = variable


def add_hidden_state(model, variable):
    """Makes `variable` model state that is not a weight. Checked against 3.15.1."""
    model._seed_generators.append(_HiddenState(variable))


# fit's validation calls `evaluate(..., _use_cached_eval_dataset=True)`
# (keras 3.15.1: backend/*/trainer.py fit).
PRIVATE_EVALUATE_ARGUMENTS = frozenset({"_use_cached_eval_dataset"})


def is_fit_validation(method, kwargs):
    """Is this `evaluate` the validation that `fit` runs (3.15.1: only fit passes
    `_use_cached_eval_dataset=True`, backend/*/trainer.py fit)?"""
    return method == "evaluate" and bool(kwargs.get("_use_cached_eval_dataset"))


def peek_batch(args) -> tuple:
    """(the batch a made function's first step will see, the arguments to call it
    with, its JAX state or None). Keras 3.15.1 passes: JAX `(state, iterator)`
    (backend/jax/trainer.py:462, 787); TensorFlow a `tf.data` or distributed
    iterator, or a generator for `*_on_batch` (backend/tensorflow/trainer.py:399,
    629), which Keras's function also takes as any iterable of batches, and a list
    of batches to predict (:587, 660); torch a list of batches
    (backend/torch/trainer.py:267, 479)."""
    backend = keras.backend.backend()
    if backend == "jax":
        state, iterator = args[0], args[1]
        first = next(iterator)
        return first, (state, itertools.chain([first], iterator), *args[2:]), state
    if backend == "tensorflow" and not isinstance(args[0], list | tuple):
        iterator = args[0]
        first = iterator.get_next() if hasattr(iterator, "get_next") else next(iterator)
        return first, ([first], *args[1:]), None
    return args[0][0], args, None  # a list of batches (torch; TF's predict)


def whole_batch(model, data) -> tuple:
    """`(x, y, sample_weight)` of the global batch `data` (a tf.distribute
    PerReplica value holds one part per replica: they are put back together)."""
    strategy = getattr(model, "distribute_strategy", None)
    if strategy is not None and getattr(strategy, "num_replicas_in_sync", 1) > 1:
        data = keras.tree.map_structure(
            lambda v: keras.ops.concatenate(
                [keras.ops.convert_to_tensor(p) for p in strategy.experimental_local_results(v)
                 if p.shape[0] != 0], axis=0), data)
    return keras.utils.unpack_x_y_sample_weight(data)


def state_mapping(model, state) -> list:
    """(variable, value) pairs for a `keras.StatelessScope`: the JAX step's state
    where Keras's loop holds the values (its layout: trainable, non-trainable, ...,
    metrics last; backend/jax/trainer.py:98-196), else each variable's value."""
    if state is None:
        return [(v, v.value) for v in model.trainable_variables + model.non_trainable_variables]
    pairs = list(zip(model.trainable_variables, state[0]))
    pairs += list(zip(model.non_trainable_variables, state[1]))
    if len(state) > 2:
        pairs += list(zip(model.metrics_variables, state[-1]))
    return pairs


@contextlib.contextmanager
def collected_updates():
    """JAX: a `keras.StatelessScope` over the one in effect (its values kept), that
    collects what layers assign (a BatchNormalization's moving statistics under
    `training=True`, a stateful RNN's state, a seed generator's) and the losses
    they add: yields the scope, whose `assigned_values()` lists them. Inside a trace, an
    assignment wrote a tracer into the variable, and the model was broken for
    good (`UnexpectedTracerError`); a loss added to an outer scope's list was a
    tracer there. `write_back` puts the values, computed, where a direct call
    puts them (keras 3.15.1: backend/common/stateless_scope.py, `state_mapping`,
    `add_update`, `losses`; backend/common/variables.py, `_value`, what `value`
    reads outside any scope; layers/layer.py:1276-1283 and 1323-1336, how a
    layer adds its losses, and clears them at each call, by `_loss_ids`)."""
    from keras.src.backend.common.stateless_scope import get_stateless_scope

    scope = _CollectingScope(get_stateless_scope())
    with scope:
        yield scope


class _CollectingScope(keras.StatelessScope):
    """`collected_updates`' scope: over `outer` (a step's, or None)."""

    def __init__(self, outer):
        # Collecting the losses `add_loss` adds, which `model.losses` reads inside
        # (without, they were dropped, and a loss of `loss_fn` that adds them too),
        # over a copy of the outer scope's where it collects them too.
        super().__init__(collect_losses=True, initialize_variables=False)
        from callscope import _backend

        self.outer, self.updates, self.added = outer, {}, []
        self.marker = _backend.trace_marker()  # (the trace it collects for)
        self.outer_had = None  # ids of the outer scope's losses before
        if outer is not None:
            self.state_mapping = dict(outer.state_mapping)
            if outer.collect_losses:
                self.losses = list(outer.losses)
                self.outer_had = {id(loss) for loss in outer.losses}

    def add_update(self, update):
        super().add_update(update)
        self.updates[id(update[0])] = update

    def add_loss(self, loss, layer=None):
        super().add_loss(loss)
        # The layer, where `Layer.add_loss` adds it (it then notes the loss's id in
        # its `_loss_ids`), or `write_back` of a scope inside this one; a loss the
        # caller adds to the scope itself has none. Made inside another trace
        # than this scope's (a model called under `jax.vmap` or `jax.checkpoint`
        # in `loss_fn`), it cannot leave that one, and is dropped as before.
        from callscope import _backend

        caller = sys._getframe(1)
        if layer is None and caller.f_code is keras.layers.Layer.add_loss.__code__:
            layer = caller.f_locals.get("self")
        if _backend.trace_marker()[1:] == self.marker[1:]:
            self.added.append((layer, loss))

    def get_current_value(self, variable):
        # A variable no scope maps reads as itself: a weight regularizer reads its
        # variable through this (layers/layer.py:1301-1305), and got None.
        value = super().get_current_value(variable)
        return variable._value if value is None and self.outer is None else value

    def assigned_values(self) -> list:
        """Taken as the trace ends, the traced values of what `write_back` puts:
        each variable assigned; each loss added here that the call kept (a later
        call of its layer clears the earlier ones); each loss the caller added to
        the outer scope itself, meanwhile."""
        kept = {id(loss) for loss in self.losses}
        self.kept_losses = [(layer, loss) for layer, loss in self.added if id(loss) in kept]
        self.ours = kept
        self.outer_added = [] if self.outer_had is None else [
            loss for loss in self.outer.losses if id(loss) not in self.outer_had]
        return [*(value for _, value in self.updates.values()),
                *(loss for _, loss in self.kept_losses), *self.outer_added]


def write_back(scope: _CollectingScope, values) -> None:
    """The values of `scope.assigned_values()`, computed, where a direct call puts
    them: a variable's to the scope in effect (a step's), or into the variable; a
    layer's loss into the scope in effect where it collects losses (this model's
    earlier ones cleared out of it, as its call clears them), to the layer outside
    any scope, or nowhere in a scope that does not collect them."""
    outer = scope.outer
    values = list(values)
    variables = [variable for variable, _ in scope.updates.values()]
    for variable, value in zip(variables, values):
        if outer is not None:
            outer.add_update((variable, value))
        else:
            variable.assign(value)
    values = values[len(variables):]
    losses, outer_added = values[:len(scope.kept_losses)], values[len(scope.kept_losses):]
    for (layer, traced), value in zip(scope.kept_losses, losses):
        if layer is not None:
            layer._loss_ids.discard(id(traced))
            if outer is None:
                layer._losses.append(value)
    if outer is None or not outer.collect_losses:
        return
    computed = {id(traced): value for traced, value in zip(scope.outer_added, outer_added)}
    outer.losses[:] = [computed.get(id(loss), loss) for loss in outer.losses
                       if id(loss) not in scope.outer_had or id(loss) in scope.ours]
    for (layer, _), value in zip(scope.kept_losses, losses):
        if isinstance(outer, _CollectingScope):  # (one `intermediate_grads` in another's)
            outer.add_loss(value, layer)
        else:
            outer.add_loss(value)
        if layer is not None:
            layer._loss_ids.add(id(value))


def stateless_value(variable):
    """`variable`'s value in the innermost `keras.StatelessScope`, or None where
    no scope holds it (keras 3.15.1: backend/common/stateless_scope.py; the
    public `variable.value` falls back to the variable itself, purged on JAX
    while Keras's loop runs)."""
    from keras.src.backend.common.stateless_scope import get_stateless_scope

    scope = get_stateless_scope()
    return None if scope is None else scope.get_current_value(variable)


def own_compile_cache(function, *, eager: bool = False):
    """A made function that Keras compiled with `torch.compile` (keras 3.15.1
    backend/torch/trainer.py:128, 149, 170: `torch.compile(one_step_on_data)`),
    compiled again with its own cache of compiled frames (torch 2.13:
    `isolate_recompiles=True`; `_torchdynamo_orig_callable` holds the function
    `torch.compile` wrapped). Every key's function, of every model, compiles the
    same code (Keras's `one_step_on_data` and `train_step`): sharing one cache,
    each key and model would count against dynamo's recompile limit of the others.

    `eager`: the function uncompiled. Gradients with respect to intermediates
    (`kinds=("grad",)`) are `torch.autograd.grad(loss, sources)` in the loss hook,
    which dynamo does not trace (`trace_autograd_ops` is off): the forward pass
    up to the loss is then one compiled autograd function whose outputs are both
    the sources and the loss, and the gradient of one of its outputs with respect
    to another is silently zero. Run eagerly, the values are right.

    Anything else is returned as it is (a torch without the option shares the
    cache)."""
    original = getattr(function, "_torchdynamo_orig_callable", None)
    if original is None or keras.backend.backend() != "torch":
        return function
    if eager:
        return original
    import torch

    if "isolate_recompiles" not in inspect.signature(torch.compile).parameters:
        return function
    return torch.compile(original, isolate_recompiles=True)


def replicas(model) -> int:
    """Replicas of the model's tf.distribute strategy (1 elsewhere)."""
    strategy = getattr(model, "distribute_strategy", None)
    return getattr(strategy, "num_replicas_in_sync", 1)


def replica_threads(model) -> bool:
    """Does the model's tf.distribute strategy run its steps in replica threads,
    which see none of the caller's contextvars? Several replicas, or a
    `MirroredStrategy` of one (a one-GPU or CPU machine's plain
    `MirroredStrategy()`: tensorflow 2.21.0 distribute/mirrored_run.py runs even
    one replica in a `_MirroredReplicaThread`; its values were dropped)."""
    from callscope import _backend

    return replicas(model) > 1 or _backend.is_mirrored(getattr(model, "distribute_strategy",
                                                               None))


def compile_from_config(model, config, own_compile):
    """Loads a compiled model's compile config, as `Trainer.compile_from_config`
    does (keras 3.15.1: trainers/trainer.py:990-1020), but also through callscope's
    `compile` override. A user's own `compile` with another signature gets stock
    Keras's treatment: a warning, and the model loads uncompiled."""
    config = keras.saving.deserialize_keras_object(config)
    user_compile = next((c.__dict__["compile"] for c in type(model).__mro__
                         if "compile" in c.__dict__), None)
    if user_compile not in (own_compile, keras.Model.compile):
        try:
            inspect.signature(model.compile).bind(**config)
        except TypeError:
            return keras.Model.compile_from_config(model, config)
    model.compile(**config)
    if getattr(model, "optimizer", None) is not None and model.built:
        model.optimizer.build(model.trainable_variables)


def current_call_context():
    """Keras's call context in progress, or None outside any layer's call
    (keras 3.15.1: layers/layer.py:1691-1701; `current_call_ctx`)."""
    return _global_state.get_global_attribute("current_call_ctx")


@contextlib.contextmanager
def restored_call_context(names):
    """Puts back, after a nested layer's call, the values the call context held
    for `names`. Keras's `Layer.__call__` stores the value it resolved for the
    layer (one passed to it, or its `call` signature's default) in the context it
    shares with the whole outer call, and never restores it: every layer called
    after it inherited that value, not the caller's (a value pinned on one node of
    a Functional graph reached its siblings). The entry layer's call makes and
    resets a context of its own: nothing to do (keras 3.15.1:
    layers/layer.py:1065-1086, 1703-1709)."""
    context = current_call_context()
    if context is None:
        yield
        return
    saved = [(name, context.get_value(name)) for name in names]
    try:
        yield
    finally:
        for name, value in saved:
            context.set_value(name, value)


def call_context_value(name: str):
    """The value Keras's call context in progress holds for context argument
    `name` (what an enclosing layer's call passed, and `Layer.__call__` gives a
    layer that registered the name), or None; enters no context (keras 3.15.1:
    layers/layer.py:1691-1701, 1065-1086; `current_call_ctx`)."""
    context = current_call_context()
    return None if context is None else context.get_value(name)


def in_symbolic_scope() -> bool:
    """Whether Keras runs a layer's `call` only for its output's shape: its
    `compute_output_spec` runs `call` on placeholders (JAX tracers, TF graph or
    torch meta tensors) inside a `keras.SymbolicScope` (keras 3.15.1:
    backend/common/symbolic_scope.py:18; backend/{jax,tensorflow,torch}/core.py)."""
    return _global_state.get_global_attribute("symbolic_scope") is not None


def passed_by_an_outer_layer(name: str) -> bool:
    """Whether Keras's call context in progress holds a value for `name`."""
    return call_context_value(name) is not None


# --------------------------------------------------------------------------
# JAX: stateless_call propagation (keras 3.15.1: layers/layer.py:1089-1200)
# --------------------------------------------------------------------------
def as_call_argument(layer, value):
    """`value` converted as `Layer.__call__` converts a tensor argument (a float
    cast to the layer's input dtype under a mixed-precision policy), where the
    layer converts them; `stateless_call` converts none (keras 3.15.1:
    layers/layer.py:881-900; Functional sets `_convert_input_args = False`,
    models/functional.py:145)."""
    if not layer._convert_input_args:
        return value
    return layer.dtype_policy.convert_input(value, layer.autocast, layer.input_dtype)


@contextlib.contextmanager
def entered_call_context(model, values):
    """Makes `model` the entry of Keras's call context, holding `values`.

    `Layer.stateless_call` calls `self.call` directly in 3.15.1, so the model
    never enters Keras's call context and nested layers never see the context
    arguments (nor `training`). This does what `Layer.__call__` would have done:
    enter the context as the entry layer, set the values, and reset on exit.
    Mirrors keras main (#23364). Checked against 3.15.1.
    """
    call_context = model._get_call_context()
    previous = {name: call_context.get_value(name) for name in values}
    for name, value in values.items():
        call_context.set_value(name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            call_context.set_value(name, value)
        model._maybe_reset_call_context()


# The probe's answer, found once. Not `functools.cache`: torch.compile warns on
# a call of a cached function (a user's compiled `stateless_call`), and reads a
# module's list plainly.
_propagates: list[bool] = []


def stateless_call_propagates() -> bool:
    """Probe: does `stateless_call` pass a context argument to nested layers?

    False on keras 3.15.1 (the polyfill above is then used), True on keras main
    after #23364.
    """
    if not _propagates:
        _propagates.append(_probe_stateless_call())
    return _propagates[0]


def _probe_stateless_call() -> bool:
    seen = []

    class Probe(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self._register_call_context_args("callscope_probe")

        def call(self, x, callscope_probe=None):
            seen.append(callscope_probe)
            return x

    class ProbeModel(keras.Model):
        def __init__(self):
            super().__init__()
            self._register_call_context_args("callscope_probe")
            self.probe = Probe()

        def call(self, x):
            return self.probe(x)

    model = ProbeModel()
    x = keras.ops.zeros((1, 1))
    model(x)
    seen.clear()
    try:
        model.stateless_call([], [], x, callscope_probe=1)
    except TypeError:
        return False
    return seen == [1]


# --------------------------------------------------------------------------
# Functional node baking (keras 3.15.1: layers/layer.py:893-901, 1052-1060)
# --------------------------------------------------------------------------
@functools.cache
def functional_nodes_bake_defaults():
    """Probe: does building a Functional graph store a signature default?

    In 3.15.1 `Layer.__call__` mutates the caller's kwargs dict with the resolved
    default of a registered context argument, and the Node keeps it, so
    `model(x, flag=True)` later reaches that layer as `flag=False`.
    """
    class Probe(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self._register_call_context_args("callscope_probe")

        def call(self, x, callscope_probe=False):
            return x

    inputs = keras.Input((1,))
    outputs = Probe()(inputs)
    model = keras.Model(inputs, outputs)
    return any("callscope_probe" in node.arguments.kwargs for node in graph_nodes(model))


def graph_nodes(functional):
    """Every node of a Functional graph (keras 3.15.1: ops/function.py:82)."""
    by_depth = getattr(functional, "_nodes_by_depth", None) or {}
    for nodes in by_depth.values():
        yield from nodes


def unbake_functional_defaults(model, names):
    """Removes baked signature defaults of `names` from every Functional graph.

    A node kwarg equal to the operation's `call` signature default is what 3.15.1
    stores when the user passed nothing, so it is dropped: the value then comes
    from the call context, as the user meant. A kwarg that differs from the
    default was passed on purpose and is kept.
    """
    if not names or not functional_nodes_bake_defaults():
        return
    for layer in flatten_layers(model):
        for node in graph_nodes(layer):
            kwargs = node.arguments.kwargs
            operation = node.operation
            if not kwargs or not hasattr(operation, "call"):
                continue
            params = inspect.signature(operation.call).parameters
            for name in names:
                if name in kwargs and name in params:
                    if kwargs[name] is params[name].default or (
                        isinstance(params[name].default, (bool, int, str, type(None)))
                        and kwargs[name] == params[name].default
                        and type(kwargs[name]) is type(params[name].default)
                    ):
                        del kwargs[name]


# --------------------------------------------------------------------------
# JAX purge recovery (keras 3.15.1: backend/jax/trainer.py:453-460, 1009-1037)
# --------------------------------------------------------------------------
_PURGING = ("fit", "evaluate", "predict")  # backend/jax/trainer.py:458, 614, 720


def snapshot_variable_values(model, method):
    """References to every variable's current value, before a JAX call of `method`.

    JAX `fit`/`evaluate`/`predict` purge `Variable._value` to None while their
    loop runs and restore it at the end; an exception inside the loop leaves the
    model with no weights. The `*_on_batch` methods never purge
    (`purge_model_variables=False`, backend/jax/trainer.py:784, 832, 863), and
    other backends never do: there it is `()`, with no O(#variables) walk per
    call. It also holds the loop state (`_jax_state`) left by an earlier call
    (the `*_on_batch` methods sync it but never clear it): stale, never put back.
    Checked against 3.15.1.
    """
    if keras.backend.backend() != "jax" or method not in _PURGING:
        return ()
    # Only what the call purges: predict's state holds no optimizer or metrics
    # variables (`_STATE_PARTS`), and walking the metrics is most of the walk.
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and method == "fit":
        variables += list(optimizer.variables)
    if method != "predict":
        variables += list(getattr(model, "metrics_variables", ()))
    return tuple((v, v._value) for v in variables), model.__dict__.get("_jax_state")


# The layout of a JAX step's state, by kind of step, and the `_jax_state` keys
# Keras gives its parts (3.15.1: backend/jax/trainer.py:462-477, 618-632, 724-733).
_STATE_PARTS = {
    "train": ("trainable_variables", "non_trainable_variables", "optimizer_variables",
              "metrics_variables"),
    "test": ("trainable_variables", "non_trainable_variables", "metrics_variables"),
    "predict": ("trainable_variables", "non_trainable_variables"),
}


def keep_loop_state(model, kind: str, state) -> None:
    """Makes `state`, the state a JAX step of `kind` was about to be given, the
    loop's last state, for `settle_failed_call`: a call that stops before a
    step holds its weights there alone (Keras purged the variables, and a nested
    call, such as fit's validation, may have cleared `_jax_state`)."""
    model.__dict__["_jax_state"] = dict(zip(_STATE_PARTS[kind], state))
    model.__dict__["_jax_state_synced"] = False


def _put_back_purged_values(model, snapshot):
    """Puts back the value of every variable that a failed JAX call purged, and
    drops the loop's unsynced state (`_jax_state`), so the model is usable.

    Each variable gets the loop's last state (`_jax_state`, set by this call: the
    outputs of the last step that ran, what `jax_state_sync` would have assigned),
    else the value from before the call. The steps donate their state
    (`donate_argnums=0`, backend/jax/trainer.py:277, 313, 347), so after the first
    step the values from before the call are deleted, and after a step that
    failed, the state it was given may be too: a deleted value is never put back,
    nor one of another shape or dtype, nor what is not an array (a custom step
    that returned its state in another structure). A variable the call made (it
    built the model) takes the loop's state alone. Returns what to add to the
    call's error where a variable is left with neither (else None).
    """
    if not snapshot:
        return None
    before, stale = snapshot
    latest = {}
    state = model.__dict__.get("_jax_state")
    if state and state is not stale and not model.__dict__.get("_jax_state_synced", True):
        for name, variables in _state_variables(model).items():
            for variable, value in zip(variables, state.get(name) or ()):
                latest[id(variable)] = variable, value
    # The variables the call made (a model it built, an optimizer's first `fit`)
    # have no value from before it: the loop's state alone holds theirs.
    known = {id(variable) for variable, _ in before}
    made = [(variable, None) for key, (variable, _) in latest.items() if key not in known]
    lost = []
    for variable, old in (*before, *made):
        if _live(variable._value):  # (a sync at the loop's end may assign deleted arrays)
            continue
        value = next((v for v in (latest.get(id(variable), (None, None))[1], old)
                      if _fits(v, variable)), None)
        if value is None:
            lost.append(variable.path)
        else:
            variable._value = value
    _drop_loop_state(model)
    if lost:
        return (f"callscope could not put back {len(lost)} of the model's variables "
                "after the call failed: JAX had already given their values to a step "
                "that did not finish. Reload the weights (e.g. `model.load_weights(...)`) "
                f"before using the model again. Variables without a value: {lost[:5]}")
    return None


def settle_failed_call(model, method: str, snapshot):
    """JAX: leaves `model` usable after its call of `method` raised: the values a
    purging loop took out are put back (`_put_back_purged_values`, from
    `snapshot`), and an unsynced loop state that a later `Callback.model` would
    sync over weights set since is dropped (`settle_failed_on_batch`). Returns
    what to add to the call's error where a variable is left without a value
    (else None). Other backends: nothing to do."""
    problem = _put_back_purged_values(model, snapshot)
    settle_failed_on_batch(model, method)
    return problem


def _drop_loop_state(model) -> None:
    """Drops a JAX loop's state and marks it synced: the variables hold the
    weights, so nothing is synced over them later, and a loop that goes on reads
    its state from them again (3.15.1: backend/jax/trainer.py:451, 880)."""
    model.__dict__["_jax_state"] = None
    model.__dict__["_jax_state_synced"] = True


def _state_variables(model) -> dict:
    """The variables of each part of a JAX step's state (`_STATE_PARTS`), by name."""
    optimizer = getattr(model, "optimizer", None)
    return {"trainable_variables": model.trainable_variables,
            "non_trainable_variables": model.non_trainable_variables,
            "optimizer_variables": optimizer.variables if optimizer is not None else (),
            "metrics_variables": model.metrics_variables}


def _live(value) -> bool:
    return value is not None and not (
        getattr(value, "is_deleted", None) and value.is_deleted())


def _fits(value, variable) -> bool:
    """`value` can be `variable`'s: a live array of its shape and dtype (a custom
    step's state may be anything)."""
    return (_live(value) and isinstance(getattr(value, "shape", None), tuple)
            and tuple(value.shape) == tuple(variable.shape)
            and keras.backend.standardize_dtype(value.dtype) == variable.dtype)


@functools.cache
def _jax_loops() -> dict:
    """The code objects of the JAX trainer's `fit`, `evaluate` and `predict`, to
    the kind of their steps, and of its `*_on_batch` methods, to "on_batch". The
    trainer is found as the class of `keras.Model`'s bases that defines
    `_get_jax_state` (3.15.1 names it `JAXTrainer`, 3.16's nightly `Trainer`);
    each method unwrapped from Keras's `filter_traceback`."""
    trainer = next(k for k in keras.Model.__mro__ if "_get_jax_state" in vars(k))
    return {inspect.unwrap(vars(trainer)[name]).__code__: kind for name, kind in (
        ("fit", "train"), ("evaluate", "test"), ("predict", "predict"),
        *((name, "on_batch") for name in _ON_BATCH))}


_ON_BATCH = ("train_on_batch", "test_on_batch", "predict_on_batch")


def settle_failed_on_batch(model, method: str) -> None:
    """JAX: after a `*_on_batch` call of `model` that raised, drops its loop state
    and marks it synced. Those methods mark the state unsynced before their step
    and sync it only after (3.15.1: backend/jax/trainer.py:786, 834, 865), and
    never purge: the variables hold the weights, and `_jax_state` is an earlier
    call's. Left unsynced, the next `Callback.model` synced it over the weights
    set since (`set_weights`), silently; stock Keras does so too. A step that ran
    and donated the variables' arrays before the failure keeps its state."""
    if (keras.backend.backend() != "jax" or method not in _ON_BATCH
            or model.__dict__.get("_jax_state_synced", True)):
        return
    if all(_live(variable._value) for variable in model.variables):
        _drop_loop_state(model)


def put_back_stock_loop_weights() -> None:
    """JAX: puts the weights that the loop of a plain Keras model's `fit`,
    `evaluate` or `predict` on this thread's stack took out of its variables back
    into those still empty, from the state that loop holds (its frame's `state`,
    3.15.1: backend/jax/trainer.py:453-463, 610-618, 717-723). Called where
    callscope refuses a call inside such a loop's trace (`cs.StrayValueError`, a
    capture or patch of a model called in a function it did not compile):
    Keras puts nothing back when its step fails to trace, so the refusal left the
    plain model, and the callscope model inside it, without weights for good
    ('NoneType' object is not callable), the refusal's own fix (`cs.enable` it)
    included. A callscope model's loop puts back its own (`settle_failed_call`).
    A step that failed to trace donated nothing. The loop's state is marked
    synced: a loop that goes on (the refusal caught in a callback) reads it from
    the variables again, and nothing stale is synced over weights set later. A
    plain model's `*_on_batch` call there, which purges nothing, drops the state
    it marked unsynced (`settle_failed_on_batch`)."""
    if keras.backend.backend() != "jax":
        return
    try:
        _put_back_stock_loop_weights(sys._getframe(1))
    except Exception:  # noqa: BLE001 - a Keras that changed: the refusal must still
        pass  # be what the caller sees (tests/test_runs.py checks this recovery)


def _put_back_stock_loop_weights(frame) -> None:
    kinds = _jax_loops()
    while frame is not None:
        kind = kinds.get(frame.f_code)
        model = frame.f_locals.get("self") if kind else None
        state = frame.f_locals.get("state") if kind else None
        if model is None or is_callscope(model):
            pass  # (its own call puts back its weights: `settle_failed_call`)
        elif kind == "on_batch":
            settle_failed_on_batch(model, frame.f_code.co_name)
        elif isinstance(state, tuple):
            parts, put = _state_variables(model), False
            for name, values in zip(_STATE_PARTS[kind], state):
                for variable, value in zip(parts[name], values):
                    if variable._value is None and _fits(value, variable):
                        variable._value, put = value, True
            if put:  # The variables hold the loop's state now: nothing to sync. (A
                # loop state kept unsynced, from a step of this loop, was written over
                # weights set later by the next `Callback.model`'s sync; a loop that
                # goes on reads its state from the variables again.)
                _drop_loop_state(model)
        frame = frame.f_back


def is_callscope(model) -> bool:
    """Is `model` a callscope model (`cs.Model`, `cs.enable`'s), not a plain one?
    (Its state, `_cs`, is a property of its class.)"""
    return isinstance(getattr(type(model), "_cs", None), property)


def building_model():
    """The model whose Keras `_symbolic_build` is on this thread's stack (its
    entry point builds it on KerasTensors before the loop: 3.15.1,
    trainers/trainer.py:1125, called from backend/jax/trainer.py:418, 583, 774,
    823), else None. For error messages only: it walks the stack."""
    code = inspect.unwrap(keras.Model._symbolic_build).__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None


def eval_iterator(model):
    """fit's cached validation iterator (`_eval_epoch_iterator`, 3.15.1:
    backend/*/trainer.py fit): one per model, so a call that pauses parks it."""
    return model.__dict__.get("_eval_epoch_iterator")


def set_eval_iterator(model, iterator):
    if iterator is None:
        model.__dict__.pop("_eval_epoch_iterator", None)
    else:
        model.__dict__["_eval_epoch_iterator"] = iterator


def mark_jax_state_stale(model):
    """Makes a running JAX loop read its state from the variables again before
    its next step (`_jax_state_synced`, 3.15.1: backend/jax/trainer.py:451)."""
    if keras.backend.backend() == "jax":
        model.__dict__["_jax_state_synced"] = True


def sync_jax_state(model):
    """Writes a running JAX loop's state back into the variables (public
    `jax_state_sync`, 3.15.1: backend/jax/trainer.py:880)."""
    sync = getattr(model, "jax_state_sync", None)
    if sync is not None:
        sync()


# --------------------------------------------------------------------------
# Model construction and serialization names
# --------------------------------------------------------------------------
def functional_init_arguments(args, kwargs):
    """True when `Model(...)` is called the functional way (inputs, outputs).

    Same test as keras 3.15.1 `models/model.py:functional_init_arguments`.
    """
    from keras.src.models.model import functional_init_arguments as check

    return check(args, kwargs)


def functional_class():
    """Keras's `Functional` class (keras 3.15.1: models/functional.py:27)."""
    from keras.src.models.functional import Functional

    return Functional


def serialize_as(stock_cls, cls):
    """Makes `serialize_keras_object` write `cls` exactly as it writes `stock_cls`.

    `cls` already carries `stock_cls`'s `__name__` and `__module__`. Keras writes
    a class under its `keras.*` export name if it has one (keras 3.15.1:
    api_export.py:10 `REGISTERED_OBJS_TO_NAMES`, read only by
    saving/serialization_lib.py:337 and :378), else under its registered name
    (saving/object_registration.py:179 `GLOBAL_CUSTOM_NAMES`, default `__name__`).
    Both are looked up by the exact class, so a subclass gets neither by itself.
    Only these save-side tables change: what a name loads as is untouched.
    """
    from keras.src import api_export
    from keras.src.saving import object_registration

    exported = api_export.REGISTERED_OBJS_TO_NAMES
    if stock_cls in exported:
        exported[cls] = exported[stock_cls]
    names = object_registration.GLOBAL_CUSTOM_NAMES
    if stock_cls in names:
        names[cls] = names[stock_cls]


class _LoopDepth(threading.local):
    # Thread-local, not a ContextVar: loops run synchronously, and torch.compile
    # traces an attribute read where `ContextVar.get` breaks the graph (torch 2.13).
    def __init__(self):
        self.depth = 0


_LOOP_DEPTH = _LoopDepth()
_LOOPS = ("map", "vectorized_map", "scan", "associative_scan", "while_loop", "fori_loop",
          "cond", "switch")


def loop_depth() -> int:
    """How many `keras.ops` loops or branches the running Python is inside."""
    return _LOOP_DEPTH.depth


def mark_loops() -> None:
    """Wraps the backend's `keras.ops` loops and branches once, to count how deep
    the running Python is inside them: a layer in a body looks like any other call
    otherwise (torch runs loops in Python; TF's `vectorized_map` traces its body
    in the caller's graph). (keras 3.15.1: ops/core.py calls `backend.core.<op>`
    at call time, `keras.src.backend.core` being the chosen backend's module.)"""
    from keras.src import backend

    # The module ops/core.py calls through: `backend.core` (keras 3.15.1), or
    # `backend.ops.core` (keras-nightly 3.16.0.dev2026102704).
    core = getattr(backend, "core", None) or getattr(getattr(backend, "ops", None), "core", None)
    if core is None:
        return  # (a Keras that moved it: loops go unmarked; a compat test says so)
    # And the names the backend package holds (`from .<backend>.core import *`):
    # `TimeDistributed` calls `backend.vectorized_map` (keras 3.15.1:
    # layers/rnn/time_distributed.py:138), where a time axis unknown while tracing
    # takes TF's `vectorized_map`, whose body recorded step 0 only, as an
    # ordinary point.
    for home in dict.fromkeys([core, backend]):
        for name in _LOOPS:
            loop = getattr(home, name, None)
            if loop is None or not callable(loop) or getattr(loop, "_callscope_loop", False):
                continue
            setattr(home, name, _counted(loop))
    if backend.backend() == "tensorflow":
        # TF's own `tf.vectorized_map`, which Keras's calls at call time, as does a
        # layer's own code (tensorflow 2.21.0): its `pfor` traces the body once, in
        # the caller's graph, as one iteration.
        import tensorflow as tf

        if not getattr(tf.vectorized_map, "_callscope_loop", False):
            tf.vectorized_map = _counted(tf.vectorized_map)
    # `keras.remat(f)` (keras 3.15.1: backend/common/remat.py calls
    # `backend.core.remat(f)` when it wraps f; keras-nightly 3.16.0.dev2026102704:
    # `backend.ops.remat(f)`): the body of a checkpoint counts as a loop body. JAX
    # traces it apart (its values cannot leave it), TF's `recompute_grad` runs it
    # unrecorded (a gradient of a value inside read 0), and torch runs it again in
    # the backward pass; so on every backend its layers are points of the
    # enclosing layer's loop, never silently wrong ones. So does the function
    # given to `keras.ops.custom_gradient` (keras 3.15.1: ops/core.py calls
    # `backend.core.custom_gradient(f)` when it wraps f): TF's compiled step cut
    # a gradient taken inside it to 0 (its gradient override stands between),
    # torch runs it without gradients (a gradient inside raised torch's own
    # error), and JAX traces it apart.
    for home in dict.fromkeys([core, getattr(backend, "ops", None)]):
        for name in ("remat", "custom_gradient"):
            wrap = getattr(home, name, None)
            if wrap is None or getattr(wrap, "_callscope_loop", False):
                continue

            @functools.wraps(wrap)
            def counted_body(f, _wrap=wrap):
                return _wrap(_counted(f))  # the body, wherever the backend runs it

            counted_body._callscope_loop = True
            setattr(home, name, counted_body)


def _counted(f):
    """`f`, counting one level of loop depth while it runs."""
    @functools.wraps(f)
    def counted(*args, **kwargs):
        _LOOP_DEPTH.depth += 1
        try:
            return f(*args, **kwargs)
        finally:
            _LOOP_DEPTH.depth -= 1

    counted._callscope_loop = True
    return counted


def torch_transform_level():
    """torch: the level of `torch.func` transforms (`torch.vmap`, `torch.func.grad`)
    that the running Python is inside, or None (torch 2.13.0:
    `torch._C._functorch.maybe_current_level`). Not asked under `torch.compile`,
    whose graph it would break."""
    import torch

    if torch.compiler.is_compiling():
        return None
    return torch._C._functorch.maybe_current_level()


def tf_recording_stopped() -> bool:
    """TF: is gradient recording stopped on this thread? `tf.recompute_grad` (and
    so `keras.remat`) runs its function so, and a tape then sees nothing of what it
    makes (tensorflow 2.21: python/eager/record.py `stop_recording`, the only way
    to ask)."""
    from tensorflow.python import pywrap_tfe

    return bool(pywrap_tfe.TFE_Py_TapeSetIsStopped())


def in_tf_xla_context() -> bool:
    """TF: is the graph being traced compiled by XLA? A `tf.function` with
    `jit_compile=True` (Keras's steps with `jit_compile`) traces its function
    inside an `XLAControlFlowContext`, which the graph or one it is nested in
    holds (tensorflow 2.21: python/eager/polymorphic_function/
    polymorphic_function.py `OptionalXlaContext`; python/ops/control_flow_util.py
    `GraphOrParentsInXlaContext`, which TF asks the same way). False eagerly."""
    from tensorflow.python.framework import ops as tf_ops
    from tensorflow.python.ops import control_flow_util

    return bool(control_flow_util.GraphOrParentsInXlaContext(tf_ops.get_default_graph()))


def in_torch_backward() -> bool:
    """torch: is autograd's engine running a backward pass on this thread (a
    checkpoint's recompute runs there)? (torch 2.13.0: `_current_graph_task_id`
    is -1 outside one, the only way to ask.)"""
    import torch

    return torch._C._current_graph_task_id() != -1


def torch_checkpoint(forward: bool, enclosing=None):
    """torch: the `torch.utils.checkpoint` pass this thread runs in, as `(pass,
    recompute)`. `pass` is torch's own object for one checkpointed forward pass,
    the same object in its recompute (so it lives as long as the graph that may
    recompute it). `recompute` is None in the forward pass and, in a recompute, the
    id of the backward pass it serves (one recompute each). None outside a
    checkpoint; `forward=False` answers only where a recompute may run (in a
    backward pass, or under a saved-tensors hook). `enclosing`: `(code, local)` of
    a caller that holds the answer for itself in that local (a layer call around
    this one): a walk of the stack stops there, taking it.

    (torch 2.13.0, torch/utils/checkpoint.py. Non-reentrant, the default of
    `keras.remat`: the innermost saved-tensors hooks are `_checkpoint_hook(frame)`
    in the forward pass and `_recomputation_hook(weakref(frame), gid)` in the
    recompute, and their pack hooks close over `frame`, `target_frame_ref` and
    `gid`. Reentrant: `CheckpointFunction.forward(ctx, ...)` runs the function
    under no_grad and `CheckpointFunction.backward(ctx, ...)` runs it again, with
    no hooks. Those (under no_grad, inside a non-reentrant one too), and a
    checkpoint under hooks of another kind (`save_on_cpu` opened inside its
    function), are found on the Python stack, which is walked only there.)"""
    import torch

    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    grad = torch.is_grad_enabled()
    if hooks is not None and grad:  # (else a reentrant forward pass may be inside)
        pack = inspect.unwrap(hooks[0])  # (torch._dynamo.disable wraps the recompute's)
        kind = getattr(pack, "__qualname__", "").partition(".")[0]
        if kind == "_checkpoint_hook":
            return _closed_over(pack)["frame"], None
        if kind == "_recomputation_hook":
            cells = _closed_over(pack)
            return cells["target_frame_ref"](), cells["gid"]
    elif hooks is None and torch._C._current_graph_task_id() == -1 and (grad or not forward):
        return None  # (a reentrant forward pass runs under no_grad)
    return next(torch_checkpoints_on_stack(enclosing), None)


def torch_checkpoints_on_stack(enclosing=None):
    """The `torch_checkpoint` places of every checkpoint the running Python is
    inside, innermost first, found on its stack (see `torch_checkpoint`)."""
    import sys

    import torch

    forward, backward, function, unpack = _checkpoint_code()
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if enclosing is not None and code is enclosing[0]:
            held = frame.f_locals  # (a frame still asking has the local unbound)
            if enclosing[1] in held:
                if held[enclosing[1]] is not None:
                    yield held[enclosing[1]]
                return
        if code is forward:
            yield frame.f_locals["ctx"], None
        elif code is backward:
            yield frame.f_locals["ctx"], torch._C._current_graph_task_id()
        elif code is function:  # a non-reentrant forward pass: its generator's frame
            state = frame.f_locals.get("gen")
            if state is not None and state.gi_frame is not None:
                yield state.gi_frame.f_locals["new_frame"], None
        elif code is unpack:  # a non-reentrant recompute
            found = frame.f_locals
            yield found["frame"], found["gid"]
        frame = frame.f_back


def in_reentrant_checkpoint_forward() -> bool:
    """torch: does a reentrant checkpoint's forward pass (run under no_grad) hold
    the running Python? (See `torch_checkpoint`: its places on the stack, where a
    non-reentrant pass is a `_CheckpointFrame` and a reentrant one the ctx of
    `CheckpointFunction`, torch 2.13.0.)"""
    from torch.utils.checkpoint import _CheckpointFrame

    return any(recompute is None and not isinstance(place, _CheckpointFrame)
               for place, recompute in torch_checkpoints_on_stack())


def _closed_over(function) -> dict:
    return {name: cell.cell_contents
            for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ())}


@functools.cache
def _checkpoint_code():
    from torch.utils import checkpoint

    unpack = next(c for c in checkpoint._checkpoint_hook.__init__.__code__.co_consts
                  if inspect.iscode(c) and c.co_name == "unpack_hook")
    return (checkpoint.CheckpointFunction.forward.__code__,
            checkpoint.CheckpointFunction.backward.__code__,
            inspect.unwrap(checkpoint.checkpoint).__code__, unpack)


def is_graph_model(layer) -> bool:
    """A Functional or Sequential model: its layers' names are part of its config,
    so they come back the same from `load_model` (keras 3.15.1:
    models/functional.py, models/sequential.py)."""
    from keras.src.models.functional import Functional

    return isinstance(layer, Functional | keras.Sequential)


_MADE_UP_NAME = "_callscope_made_up_name"  # the name Keras made up, on its layer


def keep_autograph_out() -> None:
    """TF's autograph converts the Python code a user's `tf.function` calls,
    module by module, unless its rules say not to; it leaves `keras` alone, and
    now callscope too. callscope's code branches on Python values only, so a
    conversion changes nothing but adds a cache of converted functions, which
    once, deep in a full test run, handed `Patches._values`'s conversion to
    `stateless_call`'s call of `active_patches` (a TypeError instead of the
    refusal the call was due). Private TF API (tensorflow 2.21.0:
    `autograph/core/config.py`, `CONVERSION_RULES`, a tuple of rules the first
    matching of which decides); left alone where it is not there."""
    if keras.backend.backend() != "tensorflow":
        return
    try:
        from tensorflow.python.autograph.core import config
    except ImportError:  # (the test `test_autograph_leaves_callscope_alone` fails)
        return
    rules = getattr(config, "CONVERSION_RULES", None)
    if isinstance(rules, tuple) and not any(
            getattr(rule, "_prefix", None) == "callscope" for rule in rules):
        config.CONVERSION_RULES = (config.DoNotConvert("callscope"), *rules)


def autograph_passes_through(*errors: type) -> None:
    """TF's autograph rebuilds an error raised inside a user's `tf.function` as
    its own type only for the built-in ones; a subclass (`cs.StrayValueError`,
    `cs.LoopPointError`) reached the user as autograph's `StagingError`, which an
    `except RuntimeError` misses. An error class with `ag_pass_through` is raised
    as it is (tensorflow 2.21.0: `autograph/impl/api.py`, `_attach_error_metadata`;
    the test `test_a_callscope_error_inside_a_tf_function_keeps_its_type` fails if
    that changes)."""
    for error in errors:
        error.ag_pass_through = True


def mark_made_up_names() -> None:
    """Marks each layer whose name Keras makes up, as it is made.

    Keras names the n-th unnamed layer of a class `<class in snake case>_<n>`
    from a session-wide counter, so an unnamed sublayer is `softmax` in one
    process and `softmax_3` after a load in another: no name for a point. The
    layer keeps the very string object in its `__dict__` (a name set later is
    another object); Keras, configs and files see the plain names. On the
    layer, not in a table: operations made per call (an eager `keras.ops.cond`
    makes one each time) grew a table without bound. (keras 3.15.1:
    ops/operation.py:22-24, `Operation.__init__(self, name=None)` makes up a
    name where none is given.) Installed when callscope is imported; layers made
    before count as named."""
    from keras.src.ops import operation

    init = operation.Operation.__init__
    if getattr(init, "_callscope_marks", False):
        return
    # Of the same signature, which `Operation.__new__` reads (both with
    # `inspect.signature` and `getfullargspec`, which `functools.wraps` would
    # set apart): a Keras whose signature differs is left alone, and
    # `tests/test_keras_compat.py` says so.
    if list(inspect.signature(init).parameters) != ["self", "name"]:
        return

    def __init__(self, name=None):
        init(self, name)
        if name is None:
            getattr(self, "__dict__", {})[_MADE_UP_NAME] = self.name

    __init__.__doc__, __init__.__qualname__ = init.__doc__, init.__qualname__

    __init__._callscope_marks = True
    operation.Operation.__init__ = __init__


def has_automatic_name(layer) -> bool:
    """Is `layer.name` one Keras made up (see `mark_made_up_names`)?"""
    return getattr(layer, "__dict__", {}).get(_MADE_UP_NAME) is layer.name


# Registries of sublayers that are not the user's attributes: Keras's own, torch's
# `nn.Module` ones (keras 3.15.1 torch layers are modules), TF's `_self_*` tracking.
_REGISTRIES = ("_layers", "_tracker", "_modules", "_parameters", "_buffers")


def attribute_names(parent, children) -> dict[int, str]:
    """The attribute under which `parent` holds each of `children`, by its id
    (`attr`, or `attr_<i>` in a list, tuple or dict), leading underscores dropped;
    none for a child it holds in none. A direct attribute wins over a container,
    and a first over a later one. One pass over `parent`'s attributes for all of
    them (naming them one by one, a model holding many in a list scanned it once
    per child), and over its containers only for children no attribute holds
    itself (a model may also hold a list of a million strings)."""
    own = vars(parent)
    # torch keeps a module's sublayers in `_modules`, keyed by attribute name.
    attributes = itertools.chain(
        ((attr, value) for attr, value in own.items()
         if attr not in _REGISTRIES and not attr.startswith("_self_")),
        own.get("_modules", {}).items())
    wanted = {id(child) for child in children}
    names: dict[int, str] = {}
    containers = []
    # (Ids of layers alone: torch.compile, tracing this, guards on the id of each
    # object it is asked for, and Keras makes some anew each call: its torch
    # `_torch_params`, a compile each `fit`.)
    for attr, value in attributes:
        if isinstance(value, keras.layers.Layer):
            if id(value) in wanted:
                names.setdefault(id(value), attr.lstrip("_") or attr)
        elif isinstance(value, list | tuple | dict):
            containers.append((attr, value))
    for attr, value in containers:
        if len(names) == len(wanted):
            break
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            if isinstance(item, keras.layers.Layer) and id(item) in wanted:
                names.setdefault(id(item), f"{attr.lstrip('_') or attr}_{key}")
    return names


def child_layers(layer):
    """The layers `layer` tracks directly, InputLayers left out (keras 3.15.1:
    layers/layer.py:1708)."""
    return [child for child in layer._flatten_layers(include_self=False, recursive=False)
            if not isinstance(child, keras.layers.InputLayer)]


def flatten_layers(model):
    """`model` and every layer under it (keras 3.15.1: layers/layer.py:1708)."""
    return model._flatten_layers(include_self=True, recursive=True)


def jax_at_top_level() -> bool:
    """Whether JAX runs no transformation now: no jit, grad, vmap or the like
    (jax 0.10.2: `trace_state_clean`, jax/_src/core.py:1561). The fast answer of
    `_backend.is_tracing_now`, asked at every layer call of a captured call,
    where its probe makes an array (about 40 µs). A JAX without it fails
    `tests/test_keras_compat.py`; until mended, the probe answers."""
    clean = getattr(_jax_core(), "trace_state_clean", None)
    return clean is not None and clean()


def is_escaped_tracer(error) -> bool:
    """JAX's error for a value that left the transformation it was made in (jax
    0.10.2: `jax.errors.UnexpectedTracerError`)."""
    import jax

    return isinstance(error, getattr(jax.errors, "UnexpectedTracerError", ()))


def runs_its_own_loop(cls) -> bool:
    """Whether `cls` is a keras_hub task that generates in a loop of its own:
    `generate` calls `make_generate_function` first, whose function (compiled, and
    kept in `generate_function`) calls the layers outside any call of the model
    (keras_hub 0.32.0: models/causal_lm.py:335, text_to_image.py:312,
    image_to_image.py:373, inpaint.py:467; the other tasks' `generate` calls one
    of these)."""
    return callable(getattr(cls, "generate", None)) and callable(
        getattr(cls, "make_generate_function", None))


def layers_held(model) -> dict:
    """`{id(layer): layer}` for `model` and every layer under it: the one answer to
    "is this layer (or model) part of that model?" (`flatten_layers` reaches each
    layer's direct children too, so they need no walk of their own)."""
    return {id(layer): layer for layer in flatten_layers(model)}


def rematerialized_layers(model) -> list:
    """`(layer, mode)` for each layer under `model` whose `call` Keras runs inside
    a checkpoint, by the rules of `rematerialized_call` (keras 3.15.1:
    ops/operation.py:103-137, layers/layer.py:1770-1801). A layer made or built
    inside a `keras.RematScope` keeps its mode (`_remat_mode`, ops/operation.py:34):
    "full" always, "list_of_layers" for the layers it names, "larger_than" where
    the output is larger (known only when called: every layer counts), and
    "activations" only its activation (inside the recording wrapper: none
    counts, but an activation that is a Layer). A scope with `mode=None` counts
    for nothing."""
    found = []
    for layer in flatten_layers(model):
        mode = getattr(layer, "_remat_mode", None)
        if mode is None or isinstance(layer, keras.layers.InputLayer):
            continue
        activation = getattr(layer, "activation", None)
        if (mode.mode in ("full", "larger_than")
                or (mode.mode == "list_of_layers" and layer.name in mode.layer_names)
                or (mode.mode == "activations"
                    and isinstance(activation, keras.layers.Layer))):
            found.append((layer, mode.mode))
    return found


# --------------------------------------------------------------------------
# JAX: callscope's copy of the stock train/test step, for intermediate grads
# (keras 3.15.1: backend/jax/trainer.py:98-196)
# --------------------------------------------------------------------------
def is_stock_step(model, kind):
    """True when `model` uses Keras's own `<kind>_step`, not a user override.

    Decided by where the method is defined, not by a class name: keras main has
    renamed the JAX trainer class (seen on keras-nightly 3.16.0.dev2026102704).
    """
    name = f"{kind}_step"
    owner = next(c for c in type(model).__mro__ if name in c.__dict__)
    return owner.__module__.split(".")[0] == "keras"


def scales_loss(optimizer) -> bool:
    """True where the loss a train step differentiates is scaled: a
    `LossScaleOptimizer` (its own `scale_loss`), or any optimizer given a
    `loss_scale_factor` (the base `scale_loss` multiplies by it; keras 3.15.1:
    optimizers/base_optimizer.py, `scale_loss`)."""
    return optimizer is not None and (
        type(optimizer).scale_loss is not keras.optimizers.Optimizer.scale_loss
        or getattr(optimizer, "loss_scale_factor", None) is not None)


def jax_stock_step(model, kind, state, data, differentiate):
    """Keras's JAX `train_step`/`test_step` (3.15.1: backend/jax/trainer.py:98-196),
    with the gradient taken by `differentiate(forward, trainable, training, scale)`,
    which returns `((loss, aux), weight_grads or None)`. `scale` is what the training
    loss is multiplied by before it is differentiated (a `LossScaleOptimizer`'s
    scale), or None where nothing scales it. The state layouts, the
    `compute_loss_and_updates` signature and its aux 4-tuple are Keras's own."""
    training = kind == "train"
    if training:
        trainable, non_trainable, optimizer_vars, metrics_vars = state
    else:
        trainable, non_trainable, metrics_vars = state
        optimizer_vars = None
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)

    def forward(trainable):
        return model.compute_loss_and_updates(
            trainable, non_trainable, metrics_vars, x, y, sample_weight,
            training=training, optimizer_variables=optimizer_vars,
        )

    scale = None
    if training and scales_loss(model.optimizer):
        # As compute_loss_and_updates scales the loss (3.15.1: trainer.py:76-77),
        # with the optimizer's variables of this step.
        mapping = list(zip(model.optimizer.variables, optimizer_vars))
        with keras.StatelessScope(state_mapping=mapping):
            scale = model.optimizer.scale_loss(keras.ops.ones((), "float32"))
    (_, aux), grads = differentiate(forward, trainable, training, scale)
    unscaled_loss, y_pred, non_trainable, metrics_vars = aux
    if training:
        trainable, optimizer_vars = model.optimizer.stateless_apply(
            optimizer_vars, grads, trainable
        )
    logs, metrics_vars = model._update_metrics_variables(
        metrics_vars, unscaled_loss, x, y, y_pred, sample_weight
    )
    if training:
        return logs, (trainable, non_trainable, optimizer_vars, metrics_vars)
    return logs, (trainable, non_trainable, metrics_vars)


# JAX: values sown inside `compute_loss_and_updates` are tracers of the
# differentiated trace; they leave it as one extra entry at the end of the
# non-trainable list of its aux 4-tuple (3.15.1: backend/jax/trainer.py:60-96),
# and are taken off the step's state before Keras sees it.
_SMUGGLED = "__callscope_smuggled__"


class AuxHook:
    """Sees the JAX trainer's `compute_loss_and_updates`, the forward pass that
    `value_and_grad` differentiates. The model class provides
    `_cs_loss_and_updates(call, *args, **kwargs) -> (loss, aux, extra or None)`."""

    def compute_loss_and_updates(self, *args, **kwargs):
        parent = super().compute_loss_and_updates
        loss, aux, extra = self._cs_loss_and_updates(parent, *args, **kwargs)
        if extra is None:
            return loss, aux
        unscaled_loss, y_pred, non_trainable, metrics = aux
        return loss, (unscaled_loss, y_pred, [*non_trainable, {_SMUGGLED: extra}], metrics)


class SyncHook:
    """Sees the JAX trainer's `jax_state_sync` (3.15.1: backend/jax/trainer.py:880),
    which writes a running loop's state back into the variables; Keras's
    `Callback.model` calls it before a callback touches the weights. The model
    class provides `_cs_syncing()`, a context manager around the sync."""

    def jax_state_sync(self):
        with self._cs_syncing():
            return super().jax_state_sync()


def unsmuggle(result):
    """`(result without the smuggled entry, the smuggled values or None)` for a
    JAX step's `(main, state)` result."""
    if not isinstance(result, tuple) or len(result) != 2:
        return result, None
    main, state = result
    if not isinstance(state, tuple) or len(state) < 2 or not isinstance(state[1], list):
        return result, None
    non_trainable = state[1]
    if non_trainable and isinstance(non_trainable[-1], dict) and _SMUGGLED in non_trainable[-1]:
        return (main, (state[0], non_trainable[:-1], *state[2:])), non_trainable[-1][_SMUGGLED]
    return result, None


def replace_non_trainable(state, replacements, place):
    """A JAX step's state (`(trainable, non_trainable, ...)`, 3.15.1:
    backend/jax/trainer.py:_get_jax_state) with `non_trainable[i]` replaced by
    `place(value, old)` for each `(i, value)`."""
    trainable, non_trainable, *rest = state
    non_trainable = list(non_trainable)
    for index, value in replacements:
        non_trainable[index] = place(value, non_trainable[index])
    return (trainable, non_trainable, *rest)


# --------------------------------------------------------------------------
# The loss hook (keras 3.15.1: trainers/trainer.py:404-423)
# --------------------------------------------------------------------------
class LossHook:
    """Sees every loss a train/test step computes, for intermediate gradients.

    Keras's default steps call the private `_compute_loss`, which wraps a user's
    `compute_loss` override, so the loss seen here is the final one; custom steps
    usually call the public `compute_loss`, hooked too (once per loss). A
    subclass's own `compute_loss` (above this class in the MRO, e.g. `3 * super()`)
    is wrapped when the class is made, so the hook sees the loss the outermost
    override returns, never the one its `super()` call returns. The model class
    provides `_cs_loss_hook(loss) -> loss`. (keras 3.15.1: trainers/trainer.py,
    `_compute_loss` calls `compute_loss`.)
    """

    _in_loss_hook = 0

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("compute_loss")
        if own is not None and not getattr(own, "_callscope_hooked", False):
            cls.compute_loss = _hooked_compute_loss(own)

    def _compute_loss(self, *args, **kwargs):
        self.__dict__["_in_loss_hook"] = self._in_loss_hook + 1
        try:
            loss = super()._compute_loss(*args, **kwargs)
        finally:
            self.__dict__["_in_loss_hook"] -= 1
        return self._cs_loss_hook(loss)

    def compute_loss(self, *args, **kwargs):
        loss = super().compute_loss(*args, **kwargs)
        return loss if self._in_loss_hook else self._cs_loss_hook(loss)


def _hooked_compute_loss(own):
    """A subclass's `compute_loss`, hooked at its outermost call only."""

    @functools.wraps(own)
    def compute_loss(self, *args, **kwargs):
        self.__dict__["_in_loss_hook"] = self._in_loss_hook + 1
        try:
            loss = own(self, *args, **kwargs)
        finally:
            self.__dict__["_in_loss_hook"] -= 1
        return loss if self._in_loss_hook else self._cs_loss_hook(loss)

    compute_loss._callscope_hooked = True
    return compute_loss
