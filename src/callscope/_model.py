"""The public model classes, `enable`, and the `context_args` class decorator.

`cs.Model` and `cs.Sequential` are `ContextMixin` on top of the Keras classes.
`cs.Model(inputs, outputs)` builds a `cs.Functional` instead of letting Keras
rewrite `cs.Model`'s own bases (Keras's `inject_functional_model_class` mutates the
class it is called on, which would turn every later subclass-style `cs.Model` into
a Functional). `cs.Model` is registered for serialization under the `callscope`
package, like any user class.

`cs.enable(model)` swaps an existing instance's class for a cached subclass
`(ContextMixin, type(model))` that keeps the original `__name__`, `__module__` and
serialized name, the technique `torch.nn.utils.parametrize` uses: a model saved
after `enable` loads back as its original class, without callscope.

The models `cs.Model(inputs, outputs)` and `cs.Sequential(layers)` build are of that
same enabled class for the stock `Functional`/`Sequential` (a subclass of
`cs.Functional`/`cs.Sequential`), so they save exactly as stock models do and load
anywhere; `cs.enable(keras.saving.load_model(path))` gives back the same class.
"""

from __future__ import annotations

import functools
import inspect
from typing import TypeVar

import keras

from callscope import _backend, _keras_compat, _keys, _scope
from callscope._mixin import ContextMixin, _delivered, check_not_keras_name

_Functional = _keras_compat.functional_class()
T = TypeVar("T")


@keras.saving.register_keras_serializable(package="callscope")
class Model(ContextMixin, keras.Model):
    """A drop-in `keras.Model` whose entry points take context arguments.

    Subclass it as you would `keras.Model`, or build it the functional way with
    `cs.Model(inputs, outputs)`.

    Example:

    >>> import keras, numpy as np, callscope as cs
    >>> @cs.context_args("debugging")
    ... class Net(cs.Model):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.dense = keras.layers.Dense(1, kernel_initializer="ones")
    ...     def call(self, x, debugging=None):
    ...         y = self.dense(x)
    ...         return y + 100.0 if debugging else y
    >>> net = Net()
    >>> x = np.ones((2, 3), "float32")
    >>> net.predict(x, verbose=0)[0, 0], net.predict(x, debugging=True, verbose=0)[0, 0]
    (np.float32(3.0), np.float32(103.0))
    """

    def __new__(cls, *args, **kwargs):
        if cls in (Model, Functional) and _keras_compat.functional_init_arguments(args, kwargs):
            return keras.Model.__new__(_enabled_class(_Functional), *args, **kwargs)
        return keras.Model.__new__(cls, *args, **kwargs)

    def __init__(self, *args, **kwargs):
        if _keras_compat.functional_init_arguments(args, kwargs):
            if not isinstance(self, _Functional):
                _rebase_on_functional(type(self))
            _Functional.__init__(self, *args, **kwargs)
        else:
            super().__init__(*args, **kwargs)
        _ = self._cs  # made eagerly, never first inside a compiled function


class Functional(Model, _Functional):
    """What `cs.Model(inputs, outputs)` builds: a Keras Functional with context.

    The model is of a subclass named like Keras's own `Functional`, so it saves as
    a stock Functional that loads without callscope. `cs.enable` gives a loaded
    stock Functional the same class back.

    Example:

    >>> import keras, callscope as cs
    >>> inputs = keras.Input((3,))
    >>> model = cs.Model(inputs, keras.layers.Dense(2)(inputs))
    >>> isinstance(model, cs.Functional), isinstance(model, cs.Model)
    (True, True)
    >>> type(model) is type(cs.enable(keras.Model(inputs, model.outputs)))
    True
    """


class Sequential(ContextMixin, keras.Sequential):
    """A drop-in `keras.Sequential` whose entry points take context arguments.

    `cs.Sequential(layers)` builds a model of a subclass named like Keras's own
    `Sequential`, so it saves as a stock Sequential that loads without callscope.
    `cs.enable` gives a loaded stock Sequential the same class back.

    Example:

    >>> import keras, numpy as np, callscope as cs
    >>> model = cs.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.register_context_args("debugging")
    >>> tuple(model(np.ones((1, 2)), debugging=True).shape)
    (1, 1)
    """

    def __new__(cls, *args, **kwargs):
        target = _enabled_class(keras.Sequential) if cls is Sequential else cls
        return super().__new__(target, *args, **kwargs)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _ = self._cs  # made eagerly, never first inside a compiled function


def _rebase_on_functional(cls):
    """Puts `cs.Functional` where `cs.Model` is in a user subclass's bases.

    The callscope counterpart of Keras's `inject_functional_model_class`, for a
    subclass of `cs.Model` instantiated with `(inputs, outputs)`. It changes the
    user's class as Keras does for `keras.Model` subclasses, never `cs.Model`.
    """
    if cls is Model:
        return Functional
    if cls is object or not issubclass(cls, Model) or issubclass(cls, _Functional):
        return cls
    _keras_compat.rebase(cls, tuple(_rebase_on_functional(base) for base in cls.__bases__))
    return cls


@functools.cache
def _enabled_class(cls):
    """`cls` with context, named and serialized as `cls`; for the stock Functional
    and Sequential, a subclass of `cs.Functional`/`cs.Sequential`."""
    cs_class = {_Functional: Functional, keras.Sequential: Sequential}.get(cls)
    enabled = type(
        cls.__name__,
        (cs_class,) if cs_class else (ContextMixin, cls),
        {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
         "__doc__": (cs_class or cls).__doc__},
    )
    _keras_compat.serialize_as(cls, enabled)
    return enabled


# Files saved by earlier callscope versions name these classes; they load as the classes that
# now save as stock, so loading and saving again gives a file anyone can load.
keras.saving.get_custom_objects().update({
    "callscope>Functional": _enabled_class(_Functional),
    "callscope>Sequential": _enabled_class(keras.Sequential),
})


def enable(model: T) -> T:
    """Gives an existing Keras model every callscope feature, in place.

    Works on stock Sequential and Functional models, subclassed models and models
    loaded from `.keras` files. Returns the same object. A model saved afterwards
    loads back as its original class, without callscope.

    Args:
        model: a `keras.Model` instance.

    Example:

    >>> import keras, numpy as np, callscope as cs
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model = cs.enable(model)
    >>> model.register_context_args("debugging")
    >>> type(model).__name__, isinstance(model, cs.ContextMixin)
    ('Sequential', True)
    >>> model.predict(np.ones((1, 2)), debugging=True, verbose=0).shape
    (1, 1)
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`cs.enable()` expects a `keras.Model` instance (Sequential, Functional "
            "or subclassed). For a layer, use `@cs.context_args(...)` on its class. "
            f"Received: model={type(model).__name__}"
        )
    if not isinstance(model, ContextMixin):
        _keras_compat.swap_class(model, _enabled_class(type(model)))
    _ = model._cs  # made eagerly, never first inside a compiled function
    return model


def context_args(*names: str):
    """Class decorator: declares the context arguments a Layer or Model takes.

    A decorated layer receives each name as a keyword argument of `call` (give it
    a default of `None`) from any enclosing model that registered the name, at any
    depth; layers in between need no plumbing. On a `cs.Model` subclass the names
    are also registered on the model, so every entry point takes them.

    Args:
        *names: keyword names, e.g. `"debugging"`.

    Example:

    >>> import keras, numpy as np, callscope as cs
    >>> @cs.context_args("debugging")
    ... class AddOne(keras.layers.Layer):
    ...     def call(self, x, debugging=None):
    ...         return x + 1.0 if debugging else x
    >>> model = cs.Sequential([keras.Input((1,)), AddOne()])
    >>> model.register_context_args("debugging")
    >>> model.predict(np.zeros((1, 1)), debugging=True, verbose=0)
    array([[1.]], dtype=float32)
    """
    for name in names:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(
                "`@cs.context_args` takes keyword names as strings. "
                f"Received: {name!r}"
            )
        if name == "training":  # (as `register_context_args`)
            raise ValueError(
                "`training` is already propagated by Keras and cannot be declared as a "
                "context argument: take `training=None` in `call`. Received: "
                "name='training'"
            )
        check_not_keras_name(name, "declared")

    def decorate(cls):
        if not (isinstance(cls, type) and issubclass(cls, keras.layers.Layer)):
            raise TypeError(
                "`@cs.context_args` decorates a Keras Layer or Model class. "
                f"Received: {cls!r}"
            )
        inherited = getattr(cls, "_callscope_context_args", ())
        cls._callscope_context_args = tuple(dict.fromkeys((*inherited, *names)))
        original_init = cls.__init__

        @functools.wraps(original_init)
        def __init__(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            declared = type(self)._callscope_context_args
            if isinstance(self, ContextMixin):
                self.register_context_args(*declared)
            else:
                _keras_compat.register_call_context_args(self, declared)
                _fills_passed(type(self))  # (a subclass's own `call`, once per class)

        # Keras reads the constructor's argspec to build `get_config`
        # (ops/operation.py), and getfullargspec ignores `__wrapped__`.
        __init__.__signature__ = inspect.signature(original_init)
        cls.__init__ = __init__
        if not issubclass(cls, ContextMixin):  # (a callscope model resolves its own)
            cls.__call__ = _checks_passed(cls.__call__)
            _fills_passed(cls)
        return cls

    return decorate


def _checks_passed(original_call):
    """A decorated layer's `__call__`: a name the caller's scope sets reaches it
    from an enclosing callscope model, or the call raises (`_scope.unpassed_values`)."""
    if getattr(original_call, "_checks_passed", False):  # decorated twice (a subclass)
        return original_call

    @functools.wraps(original_call)
    def __call__(self, *args, **kwargs):
        declared = type(self)._callscope_context_args
        if _scope.has_values():
            _add_keyed_values(self, [n for n in declared if n not in kwargs], args, kwargs)
        # The value this layer takes (pinned, or its default) is its own, not its
        # siblings'.
        with _keras_compat.restored_call_context(declared):
            return original_call(self, *args, **kwargs)

    __call__._checks_passed = True
    return __call__


def _fills_passed(cls) -> None:
    """Wraps `cls.call` so that a declared name a direct call of it lacks gets the
    value `Layer.__call__` would have given. `keras.layers.TimeDistributed` calls
    its inner layer's `call`, not `__call__` (keras 3.15.1:
    layers/rnn/time_distributed.py:126), as does `Layer.stateless_call`: the layer
    ran with its default, silently. The enclosing model's value is still in Keras's
    call context (or, for a checkpoint's recompute, the frame the model's step
    keys on), so it costs no compiled function; a name Keras passed (in `kwargs`,
    or positionally) is left alone. With no value set, a call costs one lookup."""
    original = cls.call
    if getattr(original, "_fills_passed", False):
        return
    parameters = list(inspect.signature(original).parameters.values())[1:]  # (no self)
    # name -> how many positional arguments pass it (never, for a keyword-only one)
    places = {p.name: i if p.kind is p.POSITIONAL_OR_KEYWORD else float("inf")
              for i, p in enumerate(parameters)
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    @functools.wraps(original)
    def call(self, *args, **kwargs):
        if _scope.has_values():  # (a callscope model's call or step sets its names)
            missing = []
            for name in type(self)._callscope_context_args:
                if name in kwargs or places.get(name, -1) < len(args):
                    continue
                value = _keras_compat.call_context_value(name)
                if value is None:
                    missing.append(name)
                else:
                    kwargs[name] = value
            _add_keyed_values(self, missing, args, kwargs)
        return original(self, *args, **kwargs)

    call._fills_passed = True
    cls.call = call


def _add_keyed_values(layer, names, args, kwargs) -> None:
    """Adds to `kwargs` the values of `names` that no enclosing layer passed but a
    callscope model's call or step keys on (a checkpoint's recompute, a custom step
    calling the layer); raises where only the caller's scope sets one. A call for
    the output's shape only (a model's build, even under a scope) needs none."""
    if names and not _keras_compat.in_symbolic_scope() and (
            not _backend.is_symbolic(keras.tree.flatten(args))):
        for name, value in _scope.unpassed_values(layer, names).items():
            static = isinstance(value, (*_keys.STATIC_TYPES, tuple))
            kwargs[name] = _delivered(value, dynamic=not static)
