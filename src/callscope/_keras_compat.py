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

import keras

CHECKED_AGAINST = "3.15.1"

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
) + (
    ((keras.Model, "_update_metrics_variables"),)  # backend/jax/trainer.py:98
    if keras.backend.backend() == "jax" else ()
)


def has_private_attribute(cls, name):
    """True if `cls` or a fresh instance of it has `name` (for the tests)."""
    if hasattr(cls, name):
        return True
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
# Variables owned by the model but kept out of its saved weights
# (keras 3.15.1: Layer._tracker, Layer._non_trainable_variables)
# --------------------------------------------------------------------------
def track_hidden_variable(model, variable):
    """Adds a non-trainable variable to `model`'s own variables.

    JAX only threads variables listed by the model through its compiled steps
    (`_get_jax_state`); an untracked variable is baked in as a constant. The
    tracker is locked after `build`, hence the unlock. Checked against 3.15.1.
    """
    tracker = model._tracker
    was_locked = tracker.locked
    tracker.unlock()
    try:
        tracker.add_to_store("non_trainable_variables", variable)
    finally:
        if was_locked:
            tracker.lock()


@contextlib.contextmanager
def without_variables(model, variables):
    """Temporarily removes `variables` from `model`'s own variable list.

    Used around `save_own_variables`/`load_own_variables` so that callscope's
    dynamic-context variables never reach a `.keras` file: a model saved after
    `cs.enable` must load back into the plain Keras class. Checked against 3.15.1.
    """
    own = model._non_trainable_variables
    kept = [v for v in own if all(v is not h for h in variables)]
    removed = len(own) != len(kept)
    if removed:
        saved = list(own)
        own[:] = kept
    try:
        yield
    finally:
        if removed:
            own[:] = saved


# --------------------------------------------------------------------------
# JAX: stateless_call propagation (keras 3.15.1: layers/layer.py:1089-1200)
# --------------------------------------------------------------------------
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


@functools.cache
def stateless_call_propagates():
    """Probe: does `stateless_call` pass a context argument to nested layers?

    False on keras 3.15.1 (the polyfill above is then used), True on keras main
    after #23364.
    """
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
def snapshot_variable_values(model):
    """References to every variable's current value, before a JAX run.

    JAX `fit` purges `Variable._value` to None and only restores it once the
    first step has returned; an exception while tracing that step leaves the
    model with no weights. Checked against 3.15.1.
    """
    if keras.backend.backend() != "jax":
        return ()
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        variables += list(optimizer.variables)
    return tuple((v, v._value) for v in variables)


def restore_purged_values(snapshot):
    """Puts back the value of every variable that a failed JAX run purged."""
    for variable, value in snapshot:
        if variable._value is None and value is not None:
            variable._value = value


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


def copy_registered_name(source_cls, target_cls):
    """Serializes `target_cls` under `source_cls`'s registered name.

    `cs.enable` swaps an instance's class for a subclass; Keras's serializer
    looks the class up in `GLOBAL_CUSTOM_NAMES` (keras 3.15.1:
    saving/object_registration.py:179), so a user's registered class must keep
    its `package>Name` there, or the saved file would not load back.
    """
    from keras.src.saving import object_registration

    names = object_registration.GLOBAL_CUSTOM_NAMES
    if source_cls in names:
        names[target_cls] = names[source_cls]


def flatten_layers(model):
    """`model` and every layer under it (keras 3.15.1: layers/layer.py:1708)."""
    return model._flatten_layers(include_self=True, recursive=True)


# --------------------------------------------------------------------------
# JAX: callscope's copy of the stock train/test step, for intermediate grads
# (keras 3.15.1: backend/jax/trainer.py:98-196)
# --------------------------------------------------------------------------
def is_stock_jax_step(model, kind):
    """True when `model` uses Keras's own `<kind>_step`, not a user override.

    Decided by where the method is defined, not by a class name: keras main has
    renamed the JAX trainer class (seen on keras-nightly 3.16.0.dev2026102704).
    """
    name = f"{kind}_step"
    owner = next(c for c in type(model).__mro__ if name in c.__dict__)
    return owner.__module__.split(".")[0] == "keras"


def update_jax_metrics(model, metrics_vars, unscaled_loss, x, y, y_pred, sample_weight):
    """The JAX trainer's metric update (`_update_metrics_variables`, 3.15.1:
    backend/jax/trainer.py:98-120): loss tracker and compiled metrics, statelessly."""
    return model._update_metrics_variables(
        metrics_vars, unscaled_loss, x, y, y_pred, sample_weight
    )


# --------------------------------------------------------------------------
# The loss hook (keras 3.15.1: trainers/trainer.py:404-423)
# --------------------------------------------------------------------------
class LossHook:
    """Sees every loss a train/test step computes, for intermediate gradients.

    Keras's default steps call the private `_compute_loss`, which wraps a user's
    `compute_loss` override, so the loss seen here is the final one; custom steps
    usually call the public `compute_loss`, hooked too (once per loss). The model
    class provides `_cs_loss_hook(loss) -> loss`.
    """

    _in_loss_hook = 0

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
