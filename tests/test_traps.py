"""The Keras 3.15.1 traps from DESIGN §5, each pinned by a test."""

import keras
import numpy as np
import pytest
from conftest import BACKEND, numpy
from models_for_tests import ScalesWhenDebugging

import callscope as cs

X = np.arange(8, dtype="float32").reshape(4, 2)
Y = X.sum(axis=1, keepdims=True)


class DefaultFalse(keras.layers.Layer):
    """Registered the seed's way, with a `False` signature default."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._register_call_context_args("foo_mode")

    def call(self, x, foo_mode=False):
        return x + 1.0 if foo_mode else x


def test_signature_default_in_a_functional_graph_still_honours_the_value():
    inputs = keras.Input((2,))
    model = cs.Model(inputs, DefaultFalse()(inputs))
    model.register_context_args("foo_mode")
    np.testing.assert_allclose(numpy(model(X, foo_mode=True)), X + 1)
    np.testing.assert_allclose(model.predict(X, foo_mode=True, verbose=0), X + 1)
    np.testing.assert_allclose(model.predict(X, verbose=0), X)


def test_a_baked_default_is_removed_when_the_first_use_is_the_users_own_compiled_call():
    # It was removed on the first eager use only: inside a first `jax.jit`,
    # `tf.function` or `torch.compile`, `foo_mode=True` gave X (the baked False).
    inputs = keras.Input((2,))
    model = cs.Model(inputs, DefaultFalse()(inputs))
    model.register_context_args("foo_mode")
    backend = keras.backend.backend()
    if backend == "jax":
        import jax
        compiled, x = jax.jit(lambda x: model(x, foo_mode=True)), X
    elif backend == "tensorflow":
        import tensorflow as tf
        compiled, x = tf.function(lambda x: model(x, foo_mode=True)), X
    else:
        import torch
        compiled, x = torch.compile(lambda x: model(x, foo_mode=True)), torch.as_tensor(X)
    np.testing.assert_allclose(numpy(compiled(x)), X + 1)
    np.testing.assert_allclose(model.predict(X, verbose=0), X)


def test_explicit_construction_kwarg_differing_from_default_is_kept():
    inputs = keras.Input((2,))
    model = cs.Model(inputs, DefaultFalse()(inputs, foo_mode=True))
    model.register_context_args("foo_mode")
    np.testing.assert_allclose(model.predict(X, verbose=0), X + 1)


class FailWhenDebugging(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1)
        self._register_call_context_args("debugging")

    def call(self, x, debugging=None):
        if debugging:
            raise RuntimeError("layer refused to run in debugging mode")
        return self.dense(x)


def test_exception_mid_fit_leaves_weights_and_no_context_behind():
    model = cs.Sequential([keras.Input((2,)), FailWhenDebugging()])
    model.register_context_args("debugging")
    model.compile(optimizer="sgd", loss="mse")
    before = [numpy(v) for v in model.weights]
    with pytest.raises(RuntimeError, match="refused"):
        model.fit(X, Y, debugging=True, epochs=1, verbose=0)
    # JAX purges every variable before the first step; they are back.
    after = [numpy(v) for v in model.weights]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    assert cs.current("debugging") is None
    from callscope import _scope

    assert _scope.run_of(model) is None
    history = model.fit(X, Y, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    np.testing.assert_allclose(model.predict(X, verbose=0).shape, (4, 1))


class RaiseAtBatchEnd(keras.callbacks.Callback):
    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def _end(self, batch, logs=None):
        if batch == self.batch:
            raise RuntimeError("the callback failed")

    on_train_batch_end = on_test_batch_end = on_predict_batch_end = _end


def _two_dense():
    keras.utils.set_random_seed(0)
    model = cs.Sequential([keras.Input((2,)), keras.layers.Dense(3, name="hidden"),
                           keras.layers.Dense(1, name="out")], name="m")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


@pytest.mark.parametrize("capture", [False, True])
@pytest.mark.parametrize("method", ["fit", "evaluate", "predict"])
def test_a_callback_failing_after_some_steps_leaves_the_last_steps_weights(method, capture):
    # JAX's steps donate their state: after the first, the values from before the
    # call are gone, and only the loop's last state holds the weights.
    x = np.random.default_rng(1).normal(size=(16, 2)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model, twin = _two_dense(), _two_dense()
    if method == "fit":  # three steps ran (batches 0-2) before the failure
        for start in range(0, 12, 4):
            twin.train_on_batch(x[start:start + 4], y[start:start + 4])
    calls = {"fit": lambda cb: model.fit(x, y, batch_size=4, shuffle=False, verbose=0,
                                         callbacks=cb),
             "evaluate": lambda cb: model.evaluate(x, y, batch_size=4, verbose=0, callbacks=cb),
             "predict": lambda cb: model.predict(x, batch_size=4, verbose=0, callbacks=cb)}
    with pytest.raises(RuntimeError, match="the callback failed"):
        if capture:
            with cs.capture(model, "m/hidden"):
                calls[method]([RaiseAtBatchEnd(2)])
        else:
            calls[method]([RaiseAtBatchEnd(2)])
    for got, want in zip(model.weights, twin.weights):
        np.testing.assert_allclose(numpy(got), numpy(want), rtol=1e-6, err_msg=got.path)
    np.testing.assert_allclose(model.predict(x, verbose=0), twin.predict(x, verbose=0),
                               rtol=1e-6)
    model.fit(x, y, batch_size=4, verbose=0)  # and it trains on


def test_a_call_failing_in_its_first_trace_keeps_weights_set_since_the_last_call():
    # `train_on_batch` leaves its loop state behind (synced, never cleared); a
    # predict that fails before its first step must not put that old state back.
    model = _two_dense()
    x = np.ones((4, 2), "float32")
    model.train_on_batch(x, x[:, :1])
    sevens = [np.full(w.shape, 7.0, "float32") for w in model.get_weights()]
    model.set_weights(sevens)
    with pytest.raises(ValueError):
        model.predict(np.ones((4, 5), "float32"), verbose=0)  # the wrong width
    for got, want in zip(model.get_weights(), sevens):
        np.testing.assert_array_equal(got, want)
    hidden = 2 * 7.0 + 7.0  # each of 3 units: two inputs of 1 times 7, plus 7
    np.testing.assert_allclose(model.predict(x, verbose=0), np.full((4, 1), 3 * hidden * 7 + 7),
                               rtol=1e-6)


class SlipsInItsStep(cs.Model):
    """A JAX predict_step that fails in its first step by returning its state in
    another structure (Keras's check raises after the step ran)."""

    def __init__(self, dynamic):
        super().__init__()
        self.dense = keras.layers.Dense(1, kernel_initializer="ones")
        if dynamic:
            self.register_context_args("temp", dynamic=True)

    def call(self, x):
        return self.dense(x)

    def predict_step(self, state, data):
        trainable, non_trainable = state
        x = data[0] if isinstance(data, tuple) else data
        y, non_trainable = self.stateless_call(trainable, non_trainable, x)
        return y, (trainable, non_trainable)  # (the slip: non_trainable alone)


@pytest.mark.skipif(BACKEND != "jax", reason="only JAX's loop takes the weights out")
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("built", [True, False], ids=["built", "built_by_the_call"])
def test_a_step_that_fails_leaves_the_weights_of_a_model_the_call_built(dynamic, built):
    # JAX: a model that predict itself built had no value from before the call,
    # so its purged weights stayed None ('NoneType' object is not callable); with
    # a dynamic name, the state the step returned in another structure (a list
    # where an array goes) was put back, and raised AttributeError over the
    # step's own error.
    x = np.ones((8, 3), "float32")
    model = SlipsInItsStep(dynamic)
    values = {"temp": 2.0} if dynamic else {}
    if built:
        model(x[:1], **values)
    with pytest.raises(ValueError, match="`non_trainable_variables` must be a list"):
        model.predict(x, batch_size=4, verbose=0, **values)
    np.testing.assert_array_equal(numpy(model(x[:2], **values)), np.full((2, 1), 3.0))
    np.testing.assert_array_equal(model.get_weights()[0], np.ones((3, 1)))


class TouchesTheModel(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        assert self.model.name  # (reading self.model syncs the loop state on JAX)


@pytest.mark.parametrize("method", ["train_on_batch", "test_on_batch", "predict_on_batch"])
def test_weights_set_after_a_failed_on_batch_call_are_the_ones_fit_trains(method):
    # JAX: a failed *_on_batch call left the earlier call's loop state unsynced
    # (stock Keras does too), and fit's first Callback.model synced it over the
    # weights set since: fit trained from the old weights, silently.
    x = np.random.default_rng(0).normal(size=(12, 2)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model, twin = _two_dense(), _two_dense()
    args = (lambda rows: (rows,)) if method == "predict_on_batch" else (
        lambda rows: (rows, y[:len(rows)]))
    getattr(model, method)(*args(x[:4]))
    with pytest.raises(Exception):  # noqa: B017 - (each backend's own error)
        getattr(model, method)(*args(np.ones((4, 7), "float32")))  # (the wrong width)
    new = [w + 1.0 for w in model.get_weights()]
    for each in (model, twin):
        each.set_weights(new)
        each.fit(x, y, batch_size=4, shuffle=False, verbose=0, callbacks=[TouchesTheModel()])
    for got, want in zip(model.get_weights(), twin.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@keras.saving.register_keras_serializable(package="callscope_tests")
class CustomCompile(cs.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)

    def compile(self, *args, **kwargs):
        self.compiled_by_user = True
        return super().compile(*args, **kwargs)


def test_overriding_compile_does_not_break_loading(tmp_path):
    model = CustomCompile()
    model.compile(optimizer="adam", loss="mse")
    model.fit(X, Y, epochs=1, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.compiled and loaded.compiled_by_user
    assert loaded.evaluate(X, Y, verbose=0) == pytest.approx(model.evaluate(X, Y, verbose=0))


def test_validation_inside_fit_reenters_evaluate_with_the_same_value():
    calls = []

    class Spy(cs.Sequential):
        def evaluate(self, *args, **kwargs):
            calls.append(cs.current("debugging"))
            return super().evaluate(*args, **kwargs)

    model = Spy([keras.Input((2,)), keras.layers.Dense(1)])
    model.register_context_args("debugging")
    model.compile(optimizer="sgd", loss="mse")
    model.fit(X, Y, debugging=True, epochs=2, verbose=0, validation_data=(X, Y))
    assert calls == [True, True]
    model.fit(X, Y, epochs=1, verbose=0, validation_data=(X, Y))
    assert calls == [True, True, None]


def test_probes_report_the_keras_behaviour():
    from callscope import _keras_compat

    # keras 3.15.x drops context args in stateless_call and bakes defaults;
    # keras main fixed both. Either way the probes must give a bool.
    assert isinstance(_keras_compat.stateless_call_propagates(), bool)
    assert isinstance(_keras_compat.functional_nodes_bake_defaults(), bool)
    if keras.__version__.startswith("3.15."):
        assert not _keras_compat.stateless_call_propagates()
        assert _keras_compat.functional_nodes_bake_defaults()


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TF's autograph")
def test_a_callscope_error_inside_a_tf_function_keeps_its_type():
    # Autograph rebuilds only built-in errors: a StrayValueError (or LoopPointError)
    # raised in a user's `tf.function` reached the user as a StagingError, which
    # `except RuntimeError` misses (`_keras_compat.autograph_passes_through`).
    import tensorflow as tf

    model = cs.Sequential([keras.Input((2,)), ScalesWhenDebugging()])
    model.register_context_args("debugging")

    @tf.function
    def run(x):
        return model(x)

    with cs.context(debugging=True):
        with pytest.raises(cs.StrayValueError, match="Context argument `debugging` is set"):
            run(np.ones((1, 2), "float32"))
