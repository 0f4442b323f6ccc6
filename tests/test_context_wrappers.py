"""A `@cs.context_args` layer gets its value inside Keras's wrappers and loops.

`keras.layers.TimeDistributed` calls its inner layer's `call`, not `__call__`
(keras 3.15.1), so Keras's call context never delivered the value: the layer ran
with its default, silently, in predict, fit, evaluate and direct calls. RNN cells
(`keras.layers.RNN`, `Bidirectional`) and layers in an `ops.scan`/`fori_loop`
body are called through `__call__` and always got it; they are checked here too.
Each model is compared with the same model built with an undecorated layer that
always does what the value asks (no context argument involved at all).
"""

import keras
import numpy as np
import pytest
from conftest import numpy
from models_for_tests import ScalesWhenDebugging
from test_compiled_keys import _builds

import callscope as cs

T, F = 3, 4
X = np.random.default_rng(0).normal(size=(6, T, F)).astype("float32")
Y = np.random.default_rng(1).normal(size=(6, 1)).astype("float32")


@keras.saving.register_keras_serializable(package="test_context_wrappers")
class _Dense3(keras.layers.Layer):
    """A Dense(3), halved when `debugging` is true or `halve` is set."""

    def __init__(self, halve=False, **kwargs):
        super().__init__(**kwargs)
        self.halve = halve
        self.dense = keras.layers.Dense(3)

    def build(self, input_shape):
        self.dense.build(input_shape)

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], 3)

    def call(self, x, debugging=None):
        h = self.dense(x)
        return h * 0.5 if debugging or self.halve else h

    def get_config(self):
        return {**super().get_config(), "halve": self.halve}


@keras.saving.register_keras_serializable(package="test_context_wrappers")
@cs.context_args("debugging")
class Halves(_Dense3):
    pass


@keras.saving.register_keras_serializable(package="test_context_wrappers")
class _Cell(keras.layers.Layer):
    """h' = tanh(x W + h), halved when `debugging` is true or `halve` is set."""

    def __init__(self, halve=False, **kwargs):
        super().__init__(**kwargs)
        self.halve = halve
        self.state_size = self.output_size = 3

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 3), name="kernel")

    def call(self, inputs, states, debugging=None):
        h = keras.ops.tanh(keras.ops.matmul(inputs, self.kernel) + states[0])
        h = h * 0.5 if debugging or self.halve else h
        return h, [h]

    def get_config(self):
        return {**super().get_config(), "halve": self.halve}


@keras.saving.register_keras_serializable(package="test_context_wrappers")
@cs.context_args("debugging")
class HalvingCell(_Cell):
    pass


@keras.saving.register_keras_serializable(package="test_context_wrappers")
class _LSTMCell(keras.layers.LSTMCell):
    """An LSTMCell whose output is halved when `debugging` is true or `halve` is set."""

    def __init__(self, units, halve=False, **kwargs):
        super().__init__(units, **kwargs)
        self.halve = halve

    def call(self, inputs, states, training=False, debugging=None):
        output, states = super().call(inputs, states, training=training)
        return (output * 0.5 if debugging or self.halve else output), states

    def get_config(self):
        return {**super().get_config(), "halve": self.halve}


@keras.saving.register_keras_serializable(package="test_context_wrappers")
@cs.context_args("debugging")
class HalvingLSTMCell(_LSTMCell):
    pass


class _Looped(keras.layers.Layer):
    """Runs `inner` on each time step inside `ops.scan` or `ops.fori_loop`."""

    def __init__(self, inner, loop, **kwargs):
        super().__init__(**kwargs)
        self.inner, self.loop = inner, loop

    def build(self, input_shape):
        self.inner.build(input_shape[:1] + input_shape[2:])

    def compute_output_shape(self, input_shape):
        return (input_shape[0], 3)

    def call(self, x):
        steps = keras.ops.transpose(x, (1, 0, 2))
        if self.loop == "scan":
            def step(total, x_t):
                return total + self.inner(x_t), None

            total, _ = keras.ops.scan(step, keras.ops.zeros_like(steps[0, :, :3]), steps)
            return total
        return keras.ops.fori_loop(0, T, lambda i, total: total + self.inner(steps[i]),
                                   keras.ops.zeros_like(steps[0, :, :3]))


def _wrapper(kind, decorated):
    """The wrapper layer under test, around the decorated layer (or the reference
    layer that always halves)."""
    cell = (lambda: HalvingCell()) if decorated else (lambda: _Cell(halve=True))
    if kind == "time_distributed":  # (the reference's Dense acts on the last axis, as here)
        return keras.layers.TimeDistributed(Halves()) if decorated else _Dense3(halve=True)
    if kind == "rnn":
        return keras.layers.RNN(cell())
    if kind == "lstm_cell":
        return keras.layers.RNN(HalvingLSTMCell(3) if decorated else _LSTMCell(3, halve=True))
    if kind == "bidirectional":
        return keras.layers.Bidirectional(keras.layers.RNN(cell()))
    return _Looped(Halves() if decorated else _Dense3(halve=True), kind)


def _models(kind, time_steps=T):
    """`(model, reference)`: the model with the decorated layer, registering
    `debugging`, and the same one (same weights) with the layer that always halves."""
    built = []
    for decorated in (True, False):
        keras.utils.set_random_seed(0)
        layers = [keras.Input((time_steps, F)), _wrapper(kind, decorated)]
        if kind == "time_distributed":
            layers.append(keras.layers.GlobalAveragePooling1D())
        model = cs.Sequential([*layers, keras.layers.Dense(1)], name="net")
        model.compile(optimizer="sgd", loss="mse")
        built.append(model)
    model, reference = built
    model.register_context_args("debugging")
    reference.set_weights(model.get_weights())
    return model, reference


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


KINDS = ["time_distributed", "rnn", "lstm_cell", "bidirectional", "scan", "fori_loop"]


def _with(how, call):
    """`call(**kwargs)` with debugging=True passed as an argument or set in a scope."""
    if how == "argument":
        return call(debugging=True)
    with cs.context(debugging=True):
        return call()


@pytest.mark.parametrize("how", ["argument", "scope"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_wrapped_declared_layer_gets_the_value_in_every_entry_point(kind, how):
    model, reference = _models(kind)
    want = reference.predict(X, verbose=0)
    plain = model.predict(X, verbose=0)
    assert not np.allclose(plain, want, rtol=1e-3)  # the value changes the output
    _close(_with(how, lambda **kw: model.predict(X, verbose=0, **kw)), want)
    _close(numpy(_with(how, lambda **kw: model(X, **kw))), want)
    np.testing.assert_allclose(_with(how, lambda **kw: model.evaluate(X, Y, verbose=0, **kw)),
                               reference.evaluate(X, Y, verbose=0), rtol=1e-5)
    np.testing.assert_allclose(model.predict(X, verbose=0), plain, rtol=1e-6)  # and back

    _with(how, lambda **kw: model.fit(X, Y, epochs=2, batch_size=3, shuffle=False,
                                      verbose=0, **kw))
    reference.fit(X, Y, epochs=2, batch_size=3, shuffle=False, verbose=0)
    for got, expected in zip(model.get_weights(), reference.get_weights()):
        _close(got, expected)


def test_time_distributed_takes_one_compiled_function_per_value():
    model, reference = _models("time_distributed")
    builds = _builds(model)
    want, plain = reference.predict(X, verbose=0), model.predict(X, verbose=0)
    for _ in range(3):
        _close(model.predict(X, debugging=True, verbose=0), want)
        with cs.context(debugging=True):
            _close(model.predict(X, verbose=0), want)
            model.evaluate(X, Y, verbose=0)
        np.testing.assert_allclose(model.predict(X, verbose=0), plain, rtol=1e-6)
    assert builds == {"predict": 2, "test": 1, "train": 0}


def test_time_distributed_without_a_static_time_axis():
    # Keras maps the inner call over a time axis it does not know (vectorized_map).
    model, reference = _models("time_distributed", time_steps=None)
    want = reference.predict(X, verbose=0)
    _close(model.predict(X, debugging=True, verbose=0), want)
    with cs.context(debugging=True):
        _close(numpy(model(X)), want)


@cs.context_args("scale")
class Scales(keras.layers.Layer):
    def call(self, x, scale=None):
        return x if scale is None else x * scale


def test_time_distributed_gets_a_dynamic_value():
    model = cs.Sequential([keras.Input((T, F)), keras.layers.TimeDistributed(Scales())])
    model.register_context_args("scale", dynamic=True)
    builds = _builds(model)
    for scale in (2.0, 3.0, 0.5):
        np.testing.assert_allclose(model.predict(X, scale=scale, verbose=0), X * scale,
                                   rtol=1e-6)
        with cs.context(scale=scale):
            np.testing.assert_allclose(numpy(model(X)), X * scale, rtol=1e-6)
    assert builds["predict"] == 1


class _OverridesCall(Halves):
    """A subclass with its own `call`, not decorated itself."""

    def call(self, x, debugging=None):
        return super().call(x, debugging=debugging) + (1.0 if debugging else 0.0)


def test_a_subclass_own_call_gets_the_value_too():
    model = cs.Sequential([keras.Input((T, F)),
                           keras.layers.TimeDistributed(_OverridesCall(name="o"))])
    model.register_context_args("debugging")
    inner = model.layers[0].layer
    want = numpy(inner(X, debugging=True))
    _close(model.predict(X, debugging=True, verbose=0), want)
    with cs.context(debugging=True):
        _close(numpy(model(X)), want)


class _PassesItPositionally(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = Halves()

    def build(self, input_shape):
        self.inner.build(input_shape)

    def call(self, x):
        return self.inner.call(x, False)  # the caller's own value wins


def test_a_value_the_caller_passes_positionally_is_kept():
    model = cs.Sequential([keras.Input((F,)), _PassesItPositionally()])
    model.register_context_args("debugging")
    inner = model.layers[0].inner
    np.testing.assert_allclose(numpy(model(X[:, 0], debugging=True)), numpy(inner(X[:, 0])),
                               rtol=1e-6)


def test_time_distributed_in_a_stock_model_raises_under_a_scope():
    # No callscope model passes the value: the layer would run with its default.
    def stock():  # a fresh one per call: a function compiled before the scope runs no Python
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((T, F)),
                                 keras.layers.TimeDistributed(Halves(name="h"))])

    message = (r"`debugging` is set in the caller's scope \(True\), but `h` \(which declares "
               r"it with `@cs.context_args`\) is called without it.*Received: debugging=True")
    with cs.context(debugging=True):
        with pytest.raises(RuntimeError, match=message):
            stock().predict(X, verbose=0)
        with pytest.raises(RuntimeError, match=message):
            stock()(X)
    model = stock()
    _close(model.predict(X, verbose=0), numpy(model.layers[0].layer(X)))


class _Rematerialized(keras.layers.Layer):
    """Runs `inner` in a checkpoint (`keras.remat`): torch and TF recompute it in
    the backward pass, outside the model's call."""

    def __init__(self, inner, **kwargs):
        super().__init__(**kwargs)
        self.inner = inner

    def build(self, input_shape):
        self.inner.build(input_shape)

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], 3)

    def call(self, x):
        return keras.remat(lambda t: self.inner(t))(x)


@pytest.mark.parametrize("how", ["argument", "scope"])
def test_a_recomputed_time_distributed_layer_gets_the_models_value(how):
    def trained(decorated):
        keras.utils.set_random_seed(0)
        inner = (_Rematerialized(keras.layers.TimeDistributed(Halves())) if decorated
                 else _Dense3(halve=True))
        model = cs.Sequential([keras.Input((T, F)), inner,
                               keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
        model.register_context_args("debugging")
        model.compile(optimizer="sgd", loss="mse")
        fit = lambda **kw: model.fit(X, Y, epochs=2, batch_size=3, shuffle=False,  # noqa: E731
                                     verbose=0, **kw)
        _with(how, fit) if decorated else fit()
        return model.get_weights()

    for got, want in zip(trained(True), trained(False)):
        _close(got, want)


class _Holds(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = Halves()

    def call(self, x):
        return self.inner(x)


@pytest.mark.parametrize("wrapper", ["time_distributed", "layer"])
def test_a_model_built_inside_a_scope_gets_the_value(wrapper):
    # Building runs the layers for their shapes only (Keras's compute_output_spec):
    # no value is needed there. JAX and TF raised for a declared sublayer held by a
    # custom layer, and TimeDistributed ran with the default afterwards.
    with cs.context(debugging=True):
        distributed = wrapper == "time_distributed"
        inner = keras.layers.TimeDistributed(Halves()) if distributed else _Holds()
        model = cs.Sequential([keras.Input((T, F)), inner])
        model.register_context_args("debugging")
        halves = model.layers[0].layer if distributed else model.layers[0].inner
        want = numpy(halves.dense(X)) * 0.5
        _close(model.predict(X, verbose=0), want)
        _close(numpy(model(X)), want)
    _close(model.predict(X, verbose=0), want * 2.0)


class OpensAroundALayer(cs.Model):
    """Opens a scope inside its own call, around a declaring layer; on TF and
    torch, in its test step too."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3, kernel_initializer="ones")
        self.halves = ScalesWhenDebugging(0.5)

    def call(self, x, halve=True):
        if not halve:
            return self.halves(self.dense(x))
        with cs.context(debugging=True):
            return self.halves(self.dense(x))

    if keras.backend.backend() != "jax":  # (JAX's steps are stateless: traced, as `call`)
        def test_step(self, data):
            x, y = data
            with cs.context(debugging=True):  # (torch runs it eagerly)
                out = self(x, halve=False)
            return {"total": keras.ops.sum(out)}


def test_a_scope_opened_inside_a_call_reaches_its_layers_on_every_backend():
    # Delivered where the call was traced (JAX's and TF's compiled steps), but
    # refused where it ran eagerly (a direct call; every torch step).
    model = OpensAroundALayer()
    flat = X.reshape(-1, F)
    want = 0.5 * np.repeat(flat.sum(axis=1, keepdims=True), 3, axis=1)
    np.testing.assert_allclose(numpy(model(flat)), want, rtol=1e-5)
    np.testing.assert_allclose(model.predict(flat, verbose=0), want, rtol=1e-5)
    if keras.backend.backend() != "jax":
        model.compile(loss="mse")
        logs = model.evaluate(flat, want, verbose=0, return_dict=True)
        np.testing.assert_allclose(logs["total"], want.sum(), rtol=1e-5)
    # Opened around the call, or between its steps, it is still refused.
    with cs.context(debugging=True), pytest.raises(cs.StrayValueError, match="`debugging`"):
        model(flat, halve=False)


@pytest.mark.skipif(keras.backend.backend() == "torch", reason="torch.compile checks again")
def test_a_scope_opened_inside_a_call_is_not_frozen_into_a_users_compiled_function():
    # Keyed where it was opened eagerly, its value was traced into the user's
    # `jax.jit` / `tf.function` inside the call, and reused for the next value.
    inner = ScalesWhenDebugging(0.5)
    if keras.backend.backend() == "jax":
        import jax

        compiled = jax.jit(lambda x: inner(x))
    else:
        import tensorflow as tf

        compiled = tf.function(lambda x: inner(x))

    class Opens(keras.layers.Layer):
        def call(self, x, flag=True):
            with cs.context(debugging=flag):
                return compiled(x)

    with pytest.raises(cs.StrayValueError, match="`debugging`.*`cs.context` opened in an "
                       "eager call, around a function traced there"):
        Opens()(keras.ops.ones((2, 2)))
