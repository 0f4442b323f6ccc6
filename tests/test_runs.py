"""Every call is its own run: threads, nested calls, keys, failures and loading.

Each test here is one scenario that gave a silently wrong result (or a raw error)
before runs existed; each asserts values against an independent reference or the
wording of a clear error.
"""

import contextvars
import math
import re
import threading
import time

import keras
import numpy as np
import pytest
from conftest import BACKEND, numpy

import callscope as cs

rng = np.random.default_rng(0)
X = rng.normal(size=(8, 4)).astype("float32")
Y = rng.normal(size=(8, 2)).astype("float32")


def _seq(name="s"):
    keras.utils.set_random_seed(0)
    model = cs.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d")], name=name)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    return model


def _dense(model, x):
    w, b = (numpy(v) for v in model.get_layer("d").weights)
    return x @ w + b


@cs.context_args("temperature")
class Scale(keras.layers.Layer):
    def call(self, x, temperature=None):
        return x if temperature is None else x * temperature


def _scaled():
    keras.utils.set_random_seed(0)
    model = cs.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d"), Scale()],
                          name="t")
    model.register_context_args("temperature", dynamic=True)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    return model


def _predict_step(model, x):
    """`model.predict_step` called directly, as a custom loop would (JAX: statelessly)."""
    if BACKEND == "jax":
        state = ([v.value for v in model.trainable_variables],
                 [v.value for v in model.non_trainable_variables])
        return numpy(model.predict_step(state, (x,))[0])
    return numpy(model.predict_step((x,)))


def _in_threads(*targets):
    errors = []

    def wrap(target):
        def run():
            try:
                target()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
        return run

    threads = [threading.Thread(target=wrap(t), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


# --------------------------------------------------------------------------
# Threads
# --------------------------------------------------------------------------
def test_a_patch_in_one_thread_does_not_reach_another_thread():
    model = _seq()
    reference = _dense(model, X)
    opened, done = threading.Event(), threading.Event()
    seen = {}

    def patcher():
        with cs.patch(model, {"s/d": keras.ops.zeros_like}):
            seen["patched"] = model.predict(X, verbose=0)
            opened.set()
            done.wait(60)

    def plain():
        opened.wait(60)
        seen["plain"] = model.predict(X, verbose=0)
        done.set()

    _in_threads(patcher, plain)
    np.testing.assert_allclose(seen["patched"], 0.0)
    np.testing.assert_allclose(seen["plain"], reference, rtol=1e-5, atol=1e-6)


def test_a_capture_in_one_thread_records_only_that_threads_calls():
    model = _seq()
    opened, done = threading.Event(), threading.Event()
    caps = {}

    def capturer():
        with cs.capture(model, "s/d") as cap:
            model.predict(X[:3], verbose=0)
            opened.set()
            done.wait(60)
        caps["cap"] = cap

    def other():
        opened.wait(60)
        model.predict(X, verbose=0)
        done.set()

    _in_threads(capturer, other)
    np.testing.assert_allclose(caps["cap"]["s/d:output"], _dense(model, X[:3]), rtol=1e-5,
                               atol=1e-6)


def test_two_threads_with_different_dynamic_values_each_see_their_own():
    model = _scaled()
    base = _dense(model, X)
    results = {}

    def caller(t):
        def run():
            outs = [model.predict(X, temperature=t, verbose=0) for _ in range(5)]
            results[t] = outs
        return run

    _in_threads(caller(1.0), caller(100.0))
    for t, outs in results.items():
        for out in outs:
            np.testing.assert_allclose(out, base * t, rtol=1e-5, atol=1e-4)


def _times(h, values):
    return h * values["s"]


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_a_patched_predict_and_a_patched_evaluate_in_two_threads_both_finish(run_eagerly):
    # A TF or torch predict step held the dynamic-input lock and took the gate in
    # the model's own call; an evaluate holding the gate waited for that lock:
    # both hung. Dynamic context values take the same lock.
    model = _scaled()
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", run_eagerly=run_eagerly)
    base = _dense(model, X)
    results = {"predict": [], "evaluate": []}

    def predictor():
        for _ in range(6):
            with cs.patch(model, {"t/d": _times}, values={"s": 2.0}):
                results["predict"].append(
                    model.predict(X, batch_size=2, temperature=5.0, verbose=0))

    def evaluator():
        for _ in range(6):
            with cs.patch(model, {"t/d": _times}, values={"s": 3.0}):
                results["evaluate"].append(
                    model.evaluate(X, Y, batch_size=2, temperature=7.0, verbose=0))

    _in_threads(predictor, evaluator)
    for out in results["predict"]:
        np.testing.assert_allclose(out, base * 10.0, rtol=1e-5, atol=1e-4)
    for loss in results["evaluate"]:
        assert loss == pytest.approx(float(np.mean((base * 21.0 - Y) ** 2)), rel=1e-5)


def test_a_worker_thread_does_not_inherit_the_scope_unless_copied():
    seen = {}
    with cs.context(mode="a"):
        worker = threading.Thread(target=lambda: seen.setdefault("plain", cs.current("mode")))
        worker.start()
        worker.join()
        ctx = contextvars.copy_context()
        worker = threading.Thread(target=lambda: ctx.run(
            lambda: seen.setdefault("copied", cs.current("mode"))))
        worker.start()
        worker.join()
    assert seen == {"plain": None, "copied": "a"}


def test_a_pool_worker_run_in_a_copied_context_keeps_nothing_of_it_after_its_call():
    """A thread's first call in a copied context (the README's way to give a
    worker the scopes) kept that context's open scopes in the thread's pinned
    state for the worker's life: the capture, its host buffers and the model
    outlived the scope and every reference to them."""
    import concurrent.futures
    import gc
    import weakref

    model = _seq()
    pool = concurrent.futures.ThreadPoolExecutor(1)  # one long-lived worker
    try:
        with pytest.warns(UserWarning, match="no call inside it looked up"), \
                cs.context(mode="a"), cs.capture(model, "s/d") as cap:  # (`s` reads no mode)
            pool.submit(contextvars.copy_context().run, model.predict, X, verbose=0).result()
        np.testing.assert_allclose(cap["s/d:output"], _dense(model, X), rtol=1e-5, atol=1e-6)
        dead = weakref.ref(model), weakref.ref(cap)
        del model, cap
        gc.collect()
        assert [ref() for ref in dead] == [None, None]
        # The worker sees no scope of its first call's context in a later one.
        assert pool.submit(cs.current, "mode").result() is None
    finally:
        pool.shutdown()


@pytest.mark.parametrize("lambda_callback", [False, True])  # its hooks: the instance's
def test_a_callback_that_waits_on_another_threads_predict_does_not_deadlock(lambda_callback):
    model = _seq()
    reference = _dense(model, X)
    got = []

    def wait_for_predict(batch, logs=None):
        worker = threading.Thread(target=lambda: got.append(model.predict(X, verbose=0)))
        worker.start()
        worker.join(60)
        assert not worker.is_alive(), "the worker's predict deadlocked"

    class Waits(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            wait_for_predict(batch, logs)

    if lambda_callback:
        def Waits():  # noqa: N802
            return keras.callbacks.LambdaCallback(on_train_batch_end=wait_for_predict)

    def fit():
        with cs.capture(model, "s/d", reduce="mean") as cap:
            model.fit(X, Y, batch_size=4, epochs=1, verbose=0, callbacks=[Waits()])
        assert [c.method for c in cap.calls] == ["fit"]  # the worker's call is not in it
        assert cap["s/d:output/mean"].shape == (2,)

    _in_threads(fit)
    assert len(got) == 2
    for out in got:
        np.testing.assert_allclose(out, reference, rtol=1e-5, atol=1e-6)


def test_concurrent_stock_style_predicts_all_succeed():
    # Stock Keras on JAX fails here ('NoneType' object is not callable): its loop
    # purges the variables. callscope serialises JAX calls; TF and torch overlap.
    model = _seq()
    reference = _dense(model, X)
    outs = []
    _in_threads(*[lambda: outs.append(model.predict(X, batch_size=2, verbose=0))] * 4)
    assert len(outs) == 4
    for out in outs:
        np.testing.assert_allclose(out, reference, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------
# Nested calls and kinds of call
# --------------------------------------------------------------------------
def test_validation_inside_fit_is_a_call_of_its_own():
    model = _seq()
    with cs.capture(model, "s/d") as cap:
        model.fit(X, Y, batch_size=4, epochs=2, validation_data=(X[:2], Y[:2]), verbose=0,
                  shuffle=False)
    assert set(cap) == {"s/d:output"}  # never `s/d@0`/`s/d@1`
    np.testing.assert_allclose(cap["s/d:output"], np.concatenate([_dense(model, X)] * 2),
                               rtol=1e-5, atol=1e-6)
    methods = [(c.method, c.nested) for c in cap.calls]
    assert methods == [("fit", False), ("evaluate", True), ("evaluate", True)]
    np.testing.assert_allclose(cap.calls[1]["s/d:output"], _dense(model, X[:2]), rtol=1e-5,
                               atol=1e-6)
    # A later evaluate in a fresh capture reuses no doubly wrapped trace.
    with cs.capture(model, "s/d") as fresh:
        model.evaluate(X, Y, batch_size=4, verbose=0)
    assert set(fresh) == {"s/d:output"}


def test_a_callbacks_predict_is_a_nested_call_of_its_own():
    model = _seq()

    inner = []

    class Predicts(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.predict(X[:3], verbose=0)
            # A capture opened here never saw the fit: the predicts it records are
            # its own top-level calls, and the outer capture sees them nested.
            with cs.capture(self.model, "s/d") as here:
                self.model.predict(X[:3], verbose=0)
                self.model.predict(X[3:5], verbose=0)
            inner.append(here)

    with cs.capture(model, "s/d") as cap:
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[Predicts()])
    assert [(c.method, c.nested) for c in cap.calls] == [("fit", False)] + [("predict", True)] * 3
    assert set(cap) == {"s/d:output"}
    assert cap["s/d:output"].shape == (8, 2)
    np.testing.assert_allclose(cap.calls[1]["s/d:output"], _dense(model, X[:3]), rtol=1e-5,
                               atol=1e-6)
    (here,) = inner
    assert [(c.method, c.nested) for c in here.calls] == [("predict", False)] * 2
    np.testing.assert_allclose(here["s/d:output"], _dense(model, X[:5]), rtol=1e-5, atol=1e-6)


def test_a_callbacks_predict_under_a_gradient_capture_records_no_gradients():
    # A gradient capture around fit, and a callback that predicts (or calls the
    # model): the nested calls have no loss, so they record the capture's other
    # kinds, as validation does, rather than end the fit after its first epoch.
    model = _seq()
    seen = []

    class Predicts(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.predict(X[:3], verbose=0)
            self.model(X[3:5])
            # A capture of its own around the predict still has no loss there.
            with pytest.raises(ValueError, match=r"needs a loss.*Received: kinds=\('grad',\) "
                                                 r"in predict"):
                with cs.capture(self.model, "s/d"), \
                        cs.capture(self.model, "s/d", kinds=("grad",)):
                    self.model.predict(X[:3], verbose=0)
            seen.append(epoch)

    with cs.capture(model, "s/d", kinds=("output", "grad")) as cap, \
            cs.capture(model, "s/d", kinds=("grad",)) as grads:
        model.fit(X, Y, batch_size=8, epochs=2, verbose=0, callbacks=[Predicts()],
                  shuffle=False)
    assert seen == [0, 1]
    out = _dense(model, X)  # SGD(0.0): the weights never change
    np.testing.assert_allclose(cap["s/d:output"], np.concatenate([out] * 2), rtol=1e-5,
                               atol=1e-6)
    dmse = 2 * (out - Y) / Y.size  # d mean((out - y)**2) / d out
    for capture in (cap, grads):
        np.testing.assert_allclose(capture["s/d:grad"], np.concatenate([dmse] * 2),
                                   rtol=1e-4, atol=1e-7)
    assert [(c.method, c.nested) for c in cap.calls] == [
        ("fit", False), ("predict", True), ("__call__", True),
        ("predict", True), ("__call__", True)]
    np.testing.assert_allclose(cap.calls[1]["s/d:output"], _dense(model, X[:3]), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(cap.calls[2]["s/d:output"], _dense(model, X[3:5]), rtol=1e-5,
                               atol=1e-6)
    assert all(set(c) == {"s/d:output"} for c in cap.calls[1:])
    assert all(not len(c) for c in grads.calls[1:])
    # At the top level, a predict under a gradient capture is still refused.
    with pytest.raises(ValueError, match="needs a loss.*`predict` has none"):
        with cs.capture(model, "s/d", kinds=("grad",)):
            model.predict(X, verbose=0)


def test_a_held_models_predict_in_a_callback_is_nested_in_the_fit_that_holds_it():
    # The capture is of a model held by the one that fits: the callback's calls
    # of the held model are nested in that fit too (they ended it under a
    # gradient capture, and were top-level calls that mixed with its rows).
    inner = _seq("inner")
    x = keras.Input((4,))
    outer = cs.Model(x, inner(x), name="outer")
    outer.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")

    class Predicts(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            inner.predict(X[:3], verbose=0)
            inner(X[3:5])

    with cs.capture(inner, "inner/d", kinds=("output", "grad")) as cap:
        outer.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[Predicts()],
                  shuffle=False)
    assert [(c.method, c.nested) for c in cap.calls] == [
        ("fit", False), ("predict", True), ("__call__", True)]
    out = _dense(inner, X)
    np.testing.assert_allclose(cap["inner/d:output"], out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cap["inner/d:grad"], 2 * (out - Y) / Y.size, rtol=1e-4,
                               atol=1e-7)
    np.testing.assert_allclose(cap.calls[1]["inner/d:output"], out[:3], rtol=1e-5, atol=1e-6)
    assert set(cap.calls[2]) == {"inner/d:output"}


def test_calls_of_different_kinds_are_never_merged():
    model = _seq()
    with cs.capture(model, "s/d", reduce="mean") as cap:
        model.predict(X, batch_size=2, verbose=0)
        model.train_on_batch(X[:4], Y[:4])
    with pytest.raises(ValueError, match=r"different kinds \(predict, train_on_batch\)"):
        cap["s/d:output/mean"]
    predict, train = cap.calls
    assert predict.method == "predict" and train.method == "train_on_batch"
    np.testing.assert_allclose(predict["s/d:output/mean"], _dense(model, X).mean(), rtol=1e-5)
    np.testing.assert_allclose(train["s/d:output/mean"], [_dense(model, X[:4]).mean()],
                               rtol=1e-5)


def test_calls_of_one_kind_concatenate():
    model = _seq()
    with cs.capture(model, "s/d") as cap:
        model.predict(X[:3], verbose=0)
        model.predict(X[3:], verbose=0)
    np.testing.assert_allclose(cap["s/d:output"], _dense(model, X), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------
# Keys
# --------------------------------------------------------------------------
@cs.context_args("mode")
class Mode(keras.layers.Layer):
    def call(self, x, mode=None):
        return x * 0.0 + (1.0 if type(mode) is bool else 2.0 if type(mode) is int else 3.0)


def test_static_values_are_keyed_by_type():
    model = cs.Sequential([keras.Input((1,)), Mode()])
    model.register_context_args("mode")
    x = np.zeros((2, 1), "float32")
    assert model.predict(x, mode=True, verbose=0)[0, 0] == 1.0
    assert model.predict(x, mode=1, verbose=0)[0, 0] == 2.0
    assert model.predict(x, mode=1.0, verbose=0)[0, 0] == 3.0
    assert model.predict(x, mode=True, verbose=0)[0, 0] == 1.0


def test_nan_as_a_static_value_is_refused():
    model = cs.Sequential([keras.Input((1,)), Mode()])
    model.register_context_args("mode")
    with pytest.raises(ValueError, match=r"NaN cannot select a compiled function.*mode=nan"):
        model.predict(np.zeros((1, 1)), mode=math.nan, verbose=0)


# --------------------------------------------------------------------------
# Values outside the key
# --------------------------------------------------------------------------
@cs.context_args("debugging")
class Hundred(keras.layers.Layer):
    def call(self, x, debugging=None):
        return x + 100.0 if debugging else x


def _inner():
    inner = cs.Sequential([keras.Input((1,)), Hundred()], name="inner")
    inner.register_context_args("debugging")
    return inner


@pytest.mark.parametrize("method", ["predict", "evaluate", "fit"])
@pytest.mark.parametrize("outer_kind", ["keras", "cs_other_name"])
def test_a_value_outside_the_outer_key_is_an_error_never_frozen(outer_kind, method):
    # The outer model has weights (a Dense after the inner model): on JAX, the
    # refusal inside a plain model's loop left them taken out of the variables,
    # and the model, the fix the error names included, failed ('NoneType' object
    # is not callable).
    inner = _inner()
    head = keras.layers.Dense(1, kernel_initializer="ones", bias_initializer="zeros")
    if outer_kind == "keras":
        outer = keras.Sequential([keras.Input((1,)), inner, head])
    else:
        outer = cs.Sequential([keras.Input((1,)), inner, head])
        outer.register_context_args("mode")
    outer.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    x = np.zeros((2, 1), "float32")

    def call():
        if method == "predict":
            return outer.predict(x, verbose=0)
        logs = getattr(outer, method)(x, x + 100.0, verbose=0)
        loss = logs if method == "evaluate" else logs.history["loss"][0]
        return np.sqrt(loss)  # |output - 100|: 0 with the value, 100 without

    with_value, without = (0.0, 100.0) if method != "predict" else (100.0, 0.0)
    with cs.context(debugging=True):
        if BACKEND == "torch" and outer_kind == "keras":
            # Keras's torch steps run eagerly: the inner model reads the value per
            # call, and nothing is compiled that could freeze it.
            np.testing.assert_allclose(call(), with_value)
        else:
            with pytest.raises(Exception, match="register_context_args\\('debugging'\\)"):
                call()
    np.testing.assert_allclose(call(), without)  # nothing frozen, nothing lost
    np.testing.assert_array_equal(outer.get_weights()[0], np.ones((1, 1)))
    # The fix the error names works.
    outer = cs.enable(outer)
    outer.register_context_args("debugging")
    with cs.context(debugging=True):
        np.testing.assert_allclose(call(), with_value)
    np.testing.assert_allclose(call(), without)


@pytest.mark.parametrize("scope", ["capture", "patch"])
@pytest.mark.parametrize("method", ["predict", "evaluate", "fit"])
def test_a_scope_refused_in_a_plain_outer_models_loop_leaves_its_weights(scope, method):
    # On JAX the refusal came while the plain model's loop held its weights out
    # of the variables: both models then failed ('NoneType' object is not callable).
    x = np.random.default_rng(0).normal(size=(4, 5)).astype("float32")
    inner_in = keras.Input((5,))
    inner = keras.Model(inner_in, keras.layers.Dense(3, name="d")(inner_in), name="enc")
    outer_in = keras.Input((5,))
    outer = keras.Model(outer_in, keras.layers.Dense(2, name="head")(inner(outer_in)),
                        name="outer")
    outer.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    before = numpy(outer(x))  # (not predict: its trace, cached, would skip the scope)
    cs.enable(inner)
    opened = (cs.capture(inner, "*") if scope == "capture"
              else cs.patch(inner, {"enc/d": lambda v: v}))
    call = {"predict": lambda: outer.predict(x, verbose=0),
            "evaluate": lambda: outer.evaluate(x, before, verbose=0),
            "fit": lambda: outer.fit(x, before, verbose=0)}[method]
    with opened:
        if BACKEND == "torch":  # (Keras's torch steps run eagerly: nothing refused)
            call()
        else:
            with pytest.raises(RuntimeError, match="cannot record or intervene inside a "
                                                   "function it did not compile"):
                call()
    np.testing.assert_allclose(outer.predict(x, verbose=0), before, rtol=1e-6)
    np.testing.assert_allclose(numpy(outer(x)), before, rtol=1e-5, atol=1e-6)
    assert inner.predict(x, verbose=0).shape == (4, 3)


@pytest.mark.skipif(BACKEND == "torch", reason="Keras's torch steps run eagerly: no refusal")
def test_a_refusal_at_a_later_step_of_a_plain_models_call_leaves_nothing_to_sync():
    # The refusal came at predict's second step (its first ran a cached trace):
    # on JAX the loop's state of that first step stayed on the model, unsynced,
    # and the next `Callback.model` synced it over the weights set since: the fit
    # trained from the old weights, silently.
    x = np.random.default_rng(0).normal(size=(12, 5)).astype("float32")
    y = np.random.default_rng(1).normal(size=(12, 2)).astype("float32")

    def make():
        keras.utils.set_random_seed(6)
        inner_in = keras.Input((5,))
        inner = keras.Model(inner_in, keras.layers.Dense(4)(inner_in), name="enc")
        outer_in = keras.Input((5,))
        outer = keras.Model(outer_in, keras.layers.Dense(2)(inner(outer_in)))
        outer.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return outer, inner

    class Touches(keras.callbacks.Callback):  # (reading self.model syncs on JAX)
        def on_train_begin(self, logs=None):
            assert self.model.name

    # The same for a *_on_batch call refused at its second shape: its first left
    # its state behind, and the refused one marked it unsynced.
    calls = {"predict": lambda n: outer.predict(x[:n], batch_size=4, verbose=0),
             "predict_on_batch": lambda n: outer.predict_on_batch(x[:n]),
             "test_on_batch": lambda n: outer.test_on_batch(x[:n], y[:n]),
             "train_on_batch": lambda n: outer.train_on_batch(x[:n], y[:n])}
    for method, call in calls.items():
        outer, inner = make()
        call(4 if method != "predict" else 12)  # (its batch-of-4 step, traced)
        cs.enable(inner)
        with cs.capture(inner, "*"):
            with pytest.raises(RuntimeError, match="cannot record or intervene inside"):
                call(6 if method == "predict" else 2)  # (a 2-row step traces)
        new = [w + 1.0 for w in outer.get_weights()]
        outer.set_weights(new)
        twin, _ = make()
        twin.set_weights(new)
        for model in (outer, twin):
            model.fit(x, y, batch_size=4, shuffle=False, verbose=0, callbacks=[Touches()])
        for got, want in zip(outer.get_weights(), twin.get_weights()):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=method)


def _user_compiled(fn):
    if BACKEND == "jax":
        import jax

        return jax.jit(fn)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(fn)
    import torch

    return torch.compile(fn, backend="eager")


def test_capture_and_patch_inside_a_users_compiled_function_raise():
    model = _seq()
    compiled = _user_compiled(lambda x: model(x))
    x = keras.ops.convert_to_tensor(X)
    with cs.capture(model, "s/d"):
        with pytest.raises(Exception, match="cs.capture cannot record or intervene inside a "
                                            "function it did not compile"):
            compiled(x)
    with cs.patch(model, {"s/d": keras.ops.zeros_like}):
        with pytest.raises(Exception, match="cs.patch cannot record or intervene"):
            compiled(x)
    np.testing.assert_allclose(numpy(compiled(x)), _dense(model, X), rtol=1e-5, atol=1e-6)


class _Decodes(cs.Model):
    """A model with a method that calls its layers itself, as keras_hub's
    `CausalLM.generate` (`call_with_cache`) does."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = keras.layers.Dense(4, name="block")
        self.head = keras.layers.Dense(2, name="head")

    def call(self, x):
        return self.head(self.block(x))

    def decode(net, x):  # (a method's first argument, by another name than self)
        return net.head(net.block(x))


@pytest.mark.parametrize("scope", ["capture", "patch"])
def test_layers_a_method_calls_outside_any_call_of_the_model_are_refused(scope):
    # They recorded nothing and took no patch, silently (keras_hub's `generate`).
    model = _Decodes(name="net")
    model(X)  # built; no capture or patch has installed the wrappers yet
    opened = {"capture": lambda: cs.capture(model, "net/*"),
              "patch": lambda: cs.patch(model, {"net/block": keras.ops.zeros_like})}[scope]
    what = {"capture": "A `cs.capture`", "patch": "A `cs.patch`"}[scope]
    with pytest.raises(RuntimeError, match=what + r" of `net` is open, and its layer `block` "
                       r"ran in `decode` of `net`, outside any call of the model, where "
                       r"nothing is recorded or patched \(keras_hub's `generate`.* Received: "
                       r"`block` called in `net.decode`"):
        with opened():
            model.decode(X)
    # A layer called on its own, or by another model that shares it, is no call
    # of the model: nothing to record or patch, and no error.
    shares = keras.Sequential([model.block])

    class Holds(keras.Model):  # a stock model holding it, calling its layer too
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def call(this, x):
            return this.inner.head(this.inner.block(x)) + this.inner(x)

    holds = Holds(model)

    def embed(net, x):  # a function that takes the model first: no method of it
        return net.block(x)

    with opened():
        alone = numpy(model.head(np.ones((8, 4), "float32")))
        shared = numpy(shares(X))
        held = numpy(holds(X))
        embedded = numpy(embed(model, X))
    np.testing.assert_allclose(alone, numpy(model.head(np.ones((8, 4), "float32"))), rtol=1e-6)
    np.testing.assert_allclose(shared, numpy(model.block(X)), rtol=1e-6)
    np.testing.assert_allclose(embedded, numpy(model.block(X)), rtol=1e-6)
    if scope == "capture":  # nothing patched: both halves are the model's output
        np.testing.assert_allclose(held, 2 * numpy(model(X)), rtol=1e-6)
    with opened() as inside:  # a call of the model inside the scope is one
        out = numpy(model(X))
    if scope == "capture":
        np.testing.assert_allclose(inside["net/head:output"], out, rtol=1e-6)
    else:
        np.testing.assert_allclose(out, np.broadcast_to(numpy(model.head.bias), (8, 2)),
                                   rtol=1e-6)
    np.testing.assert_allclose(numpy(model.decode(X)), numpy(model(X)), rtol=1e-6)


@pytest.mark.parametrize("scope", ["capture", "patch"])
def test_layers_a_method_calls_in_a_callback_of_a_call_are_refused(scope):
    # A call in progress in the thread let them by: a callback's `generate` during
    # `fit` recorded nothing and took no patch, silently.
    model = _Decodes(name="net")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    x, y = np.ones((8, 4), "float32"), np.ones((8, 2), "float32")
    seen = []

    class Decodes(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(numpy(self.model.head(x)))  # a layer on its own: no call
            self.model.decode(x)

    opened = {"capture": lambda: cs.capture(model, "net/*"),
              "patch": lambda: cs.patch(model, {"net/block": lambda h: h * 0.5})}[scope]
    what = {"capture": "A `cs.capture`", "patch": "A `cs.patch`"}[scope]
    with pytest.raises(RuntimeError, match=what + r" of `net` is open, and its layer `block` "
                       r"ran in `decode` of `net`, outside any call"):
        with opened():
            model.fit(x, y, batch_size=4, verbose=0, callbacks=[Decodes()])
    assert len(seen) == 1
    np.testing.assert_allclose(seen[0], numpy(model.head(x)), rtol=1e-6)


@pytest.mark.skipif(BACKEND == "torch", reason="jax.jit and tf.function")
def test_a_callbacks_own_compiled_call_between_steps_is_refused_as_outside_a_call():
    # Between steps a run of the model is in progress but not stepping: a trace of
    # the model in a callback was let by as the run's own, then blamed on the
    # model's `call` as a method outside any call.
    model = _seq()
    if BACKEND == "jax":
        import jax

        compile_ = jax.jit
    else:
        import tensorflow as tf

        compile_ = tf.function

    class Compiles(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            compile_(lambda v: self.model(v))(X)

    with pytest.raises(RuntimeError, match=r"cs.capture cannot record or intervene inside a "
                       r"function it did not compile"):
        with cs.capture(model, "s/d"):
            model.fit(X, np.zeros((len(X), 2), "float32"), verbose=0, callbacks=[Compiles()])


def test_a_direct_stateless_call_is_a_run_with_the_weights_it_was_given():
    # Keras's `stateless_call` never calls `__call__`: it was silently not
    # captured or patched.
    model = _seq()
    w, b = (numpy(v) for v in model.get_layer("d").weights)
    given = [keras.ops.convert_to_tensor(2.0 * w), keras.ops.convert_to_tensor(b - 1.0)]
    x = keras.ops.convert_to_tensor(X)
    reference = X @ (2.0 * w) + (b - 1.0)
    with cs.capture(model, "s/d", kinds=("input", "output")) as cap, \
            cs.capture(model, "s/d", reduce=("mean", "hist")) as stats:
        out, _ = model.stateless_call(given, [], x)
    np.testing.assert_allclose(numpy(out), reference, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cap["s/d:output"], reference, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cap["s/d:input"], X)
    assert stats["s/d:output/mean"] == pytest.approx(reference.mean(), rel=1e-5)
    edges = stats.hist_edges("s/d:output/hist")  # its range is the given weights' output
    np.testing.assert_allclose(edges[[0, -1]], [reference.min(), reference.max()], rtol=1e-5)
    assert stats["s/d:output/hist"].sum() == reference.size
    with cs.patch(model, {"s/d": lambda h: h * 0.0 + 3.0}):
        out, _ = model.stateless_call(given, [], x)
    np.testing.assert_allclose(numpy(out), 3.0)
    np.testing.assert_allclose(numpy(model.stateless_call(given, [], x)[0]), reference,
                               rtol=1e-5, atol=1e-6)  # the patch is gone
    np.testing.assert_allclose(model.get_layer("d").weights[0], w)  # and the weights kept
    compiled = _user_compiled(lambda t: model.stateless_call(given, [], t)[0])
    with cs.capture(model, "s/d"):
        with pytest.raises(Exception, match="cs.capture cannot record or intervene inside"):
            compiled(x)
    np.testing.assert_allclose(numpy(compiled(x)), reference, rtol=1e-5, atol=1e-6)


class _Scaled(cs.Model):
    def __init__(self):
        super().__init__(name="scaled")
        self.d = keras.layers.Dense(2, name="d")

    def call(self, x, scale=1.0, training=False):
        h = cs.sow(self, "h", self.d(x) * scale)
        return keras.layers.Dropout(0.5, seed=1)(h, training=training) if training else h


def test_a_direct_calls_histogram_range_comes_from_the_call_with_its_arguments():
    # The range was found from `model(x)` without the call's other arguments:
    # values past it piled into the end bins.
    keras.utils.set_random_seed(0)
    model = _Scaled()
    model(X)
    weights = [v.value for v in model.trainable_variables]
    for call in (lambda: model(X, scale=5.0),
                 lambda: model(X, scale=5.0, training=True),
                 lambda: model.stateless_call(weights, [], X, scale=5.0)[0]):
        with cs.capture(model, "scaled/h", reduce=("hist", "min", "max"), bins=4) as cap:
            call()
        lo, hi = float(cap["scaled/h:output/min"]), float(cap["scaled/h:output/max"])
        np.testing.assert_allclose(cap.hist_edges("scaled/h:output/hist"),
                                   np.linspace(lo, hi, 5), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose([lo, hi], [5.0 * _dense(model, X).min(),
                                              5.0 * _dense(model, X).max()], rtol=1e-5)
        assert cap["scaled/h:output/hist"].sum() == 2 * len(X)
    # And with the call's patches: the values the call sees are patched ones.
    model.compile(loss="mse")
    reference = _dense(model, X)
    for factor, call in ((500.0, lambda: model(X, scale=5.0)),
                         (100.0, lambda: model.predict(X, verbose=0))):
        with cs.patch(model, {"scaled/d": lambda h: 100.0 * h}), \
                cs.capture(model, "scaled/h", reduce=("hist", "min", "max"), bins=4) as cap:
            call()
        lo, hi = float(cap["scaled/h:output/min"]), float(cap["scaled/h:output/max"])
        np.testing.assert_allclose([lo, hi], factor * np.array([reference.min(),
                                                                reference.max()]), rtol=1e-5)
        np.testing.assert_allclose(cap.hist_edges("scaled/h:output/hist"),
                                   np.linspace(lo, hi, 5), rtol=1e-5, atol=1e-5)


def test_a_scope_value_read_inside_a_users_compiled_function_raises():
    inner = _inner()
    compiled = _user_compiled(lambda x: inner(x))
    x = keras.ops.zeros((2, 1))
    with cs.context(debugging=True):
        try:
            # torch.compile may run the model's Python eagerly (a graph break):
            # then the value is read per call, which is right too.
            np.testing.assert_allclose(numpy(compiled(x)), 100.0)
            assert BACKEND == "torch"
        except Exception as error:  # noqa: BLE001
            assert "read inside a compiled function" in str(error)
    np.testing.assert_allclose(numpy(compiled(x)), 0.0)  # never frozen
    # Passed explicitly inside the user's function, it is the user's own constant.
    explicit = _user_compiled(lambda x: inner(x, debugging=True))
    np.testing.assert_allclose(numpy(explicit(x)), 100.0)


# --------------------------------------------------------------------------
# Failures, bounds, weights, loading
# --------------------------------------------------------------------------
@cs.context_args("debugging")
class Fails(keras.layers.Layer):
    def call(self, x, debugging=None):
        if debugging:
            raise RuntimeError("boom")
        return x


@pytest.mark.parametrize("method", ["predict", "evaluate", "fit", "predict_on_batch",
                                    "test_on_batch", "train_on_batch"])
def test_a_failure_leaves_the_model_usable(method):
    keras.utils.set_random_seed(0)
    model = cs.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d"), Fails()],
                          name="s")
    model.register_context_args("debugging")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    reference = _dense(model, X)
    args = {"predict": (X,), "predict_on_batch": (X,)}.get(method, (X, Y))
    extra = {"verbose": 0} if method in ("predict", "evaluate", "fit") else {}
    with pytest.raises(Exception, match="boom"):
        with cs.capture(model, "s/d"):
            getattr(model, method)(*args, debugging=True, **extra)
    np.testing.assert_allclose(model.predict(X, verbose=0), reference, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(numpy(model(X)), reference, rtol=1e-5, atol=1e-6)


def test_a_bound_of_one_with_a_nested_key_does_not_crash():
    model = _seq()
    model.register_context_args("mode")
    model.context_cache_size = 1
    got = []

    class Predicts(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            got.append(self.model.predict(X, mode="other", verbose=0))

    model.fit(X, Y, mode="train", epochs=2, verbose=0, callbacks=[Predicts()])
    assert len(got) == 2
    np.testing.assert_allclose(got[-1], _dense(model, X), rtol=1e-5, atol=1e-6)


def test_dynamic_values_are_never_weights():
    model = _scaled()
    twin = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2), Scale()])
    n = len(model.get_weights())
    model.predict(X, temperature=2.0, verbose=0)
    assert len(model.get_weights()) == n == len(twin.get_weights())
    assert len(model.weights) == len(twin.weights)
    assert len(model.non_trainable_weights) == len(twin.non_trainable_weights) == 0
    twin.set_weights(model.get_weights())
    model.set_weights(twin.get_weights())
    np.testing.assert_allclose(model.predict(X, temperature=3.0, verbose=0),
                               3.0 * _dense(model, X), rtol=1e-5)


class CustomCompile(cs.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d = keras.layers.Dense(2, name="d")

    def call(self, x):
        return self.d(x)

    def compile(self, lr=0.1):
        super().compile(optimizer=keras.optimizers.SGD(lr), loss="mse")


def test_a_user_compile_signature_loads_as_stock_does(tmp_path):
    keras.saving.get_custom_objects()["CustomCompile"] = CustomCompile
    try:
        model = CustomCompile()
        model.compile(lr=0.5)
        model(X)
        path = str(tmp_path / "m.keras")
        model.save(path)
        with pytest.warns(UserWarning, match="compile"):
            loaded = keras.saving.load_model(path)
        np.testing.assert_allclose(numpy(loaded(X)), numpy(model(X)), rtol=1e-6)
    finally:
        keras.saving.get_custom_objects().pop("CustomCompile", None)


# --------------------------------------------------------------------------
# Unbaking sees the real call
# --------------------------------------------------------------------------
@cs.context_args("foo_mode")
class AddOne(keras.layers.Layer):
    def call(self, x, foo_mode=False):  # a False default is what Keras 3.15 bakes
        return x + 1.0 if foo_mode else x


def test_unbaking_after_a_first_call_under_capture():
    inputs = keras.Input((1,))
    model = cs.Model(inputs, AddOne(name="add")(inputs))
    model.register_context_args("foo_mode")
    x = np.zeros((2, 1), "float32")
    with cs.capture(model, "*"):
        model(x)  # the first call of all, under a capture
    np.testing.assert_allclose(model.predict(x, foo_mode=True, verbose=0), 1.0)
    np.testing.assert_allclose(numpy(model(x, foo_mode=True)), 1.0)
    np.testing.assert_allclose(model.predict(x, verbose=0), 0.0)


def test_a_pinned_kwarg_behaves_as_stock():
    inputs = keras.Input((1,))
    stock = keras.Model(inputs, AddOne()(inputs, foo_mode=True))
    inputs = keras.Input((1,))
    model = cs.Model(inputs, AddOne()(inputs, foo_mode=True))
    model.register_context_args("foo_mode")
    x = np.zeros((2, 1), "float32")
    expected = numpy(stock(x))
    np.testing.assert_allclose(expected, 1.0)
    np.testing.assert_allclose(model.predict(x, verbose=0), expected)
    np.testing.assert_allclose(model.predict(x, foo_mode=False, verbose=0), expected)


@cs.context_args("mode")
class Tag(keras.layers.Layer):
    """Outputs the value it got: 0 for None, 1 for True, 2 for False."""

    def call(self, x, mode=None):
        return x * 0.0 + {None: 0.0, True: 1.0, False: 2.0}[mode]


@cs.context_args("mode")
class TagOn(Tag):
    def call(self, x, mode=True):  # a non-None default: the layer's own
        return super().call(x, mode)


class PinsFirst(cs.Model):
    """Passes a value to its first sublayers by hand; the ones after get the call's."""

    def __init__(self):
        super().__init__()
        self.pinned, self.after = Tag(), Tag()
        self.inner = cs.Sequential([Tag()])
        self.inner.register_context_args("mode")
        self.defaulted, self.last = TagOn(), Tag()
        self.register_context_args("mode")

    def call(self, x):
        return [self.pinned(x, mode=True), self.inner(x, mode=True), self.defaulted(x),
                self.after(x), self.last(x)]


def _tags(outputs):
    return [float(np.unique(numpy(o))[0]) for o in outputs]


def test_a_value_a_layer_takes_stays_with_that_layer():
    """Keras's `Layer.__call__` keeps a nested layer's value in the call context the
    whole call shares: its siblings inherited a pinned value or a default."""
    inputs = keras.Input((3,))
    free, pinned = Tag(name="free")(inputs), Tag(name="pinned")(inputs, mode=True)
    functional = cs.Model(inputs, [free, pinned])  # the pinned node runs first
    functional.register_context_args("mode")
    subclassed = PinsFirst()
    x = np.ones((2, 3), "float32")
    # (What each output got, with the call's value False, and with none.)
    for model, given, unset in ((functional, [2.0, 1.0], [0.0, 1.0]),
                                (subclassed, [1.0, 1.0, 2.0, 2.0, 2.0],
                                 [1.0, 1.0, 1.0, 0.0, 0.0])):
        assert _tags(model(x, mode=False)) == given
        assert _tags(model(x)) == unset
        assert _tags(model.predict(x, mode=False, verbose=0)) == given
        with cs.context(mode=False):
            assert _tags(model.predict(x, verbose=0)) == given
        assert _tags(model.predict(x, verbose=0)) == unset


# --------------------------------------------------------------------------
# Stress: 4 threads x 50 calls
# --------------------------------------------------------------------------
@cs.context_args("mode")
class Shift(keras.layers.Layer):
    def call(self, x, mode=None):
        return x + {None: 0.0, "a": 1.0, "b": 2.0}[mode]


def test_stress_four_threads_mixed_values_captures_and_patches():
    keras.utils.set_random_seed(0)
    model = cs.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d"), Shift(),
                           Scale(name="scale")], name="s")
    model.register_context_args("mode")
    model.register_context_args("temperature", dynamic=True)
    base = _dense(model, X)
    spans = []  # (thread, start, end) of each call

    def expected(mode, temperature, patched):
        h = np.zeros_like(base) if patched else base
        h = h + {None: 0.0, "a": 1.0, "b": 2.0}[mode]
        return h * temperature

    def worker(index):
        def run():
            r = np.random.default_rng(index)
            for i in range(50):
                mode = [None, "a", "b"][r.integers(3)]
                temperature = float(r.integers(1, 4))
                patched = bool(r.integers(2))
                start = time.perf_counter()
                patches = {"s/d": keras.ops.zeros_like} if patched else None
                scope = cs.patch(model, patches) if patched else _nothing()
                with scope, cs.capture(model, "s/d") as cap:
                    out = model.predict(X, mode=mode, temperature=temperature, verbose=0,
                                        batch_size=4)
                spans.append((index, start, time.perf_counter()))
                np.testing.assert_allclose(out, expected(mode, temperature, patched),
                                           rtol=1e-5, atol=1e-4, err_msg=f"{index}:{i}")
                np.testing.assert_allclose(cap["s/d:output"],
                                           np.zeros_like(base) if patched else base,
                                           rtol=1e-5, atol=1e-5)
        return run

    _in_threads(*[worker(i) for i in range(4)])
    assert len(spans) == 200
    if BACKEND != "jax":  # JAX serialises calls on a model; TF and torch overlap
        overlaps = sum(1 for a in spans for b in spans
                       if a[0] != b[0] and a[1] < b[2] and b[1] < a[2])
        assert overlaps > 0


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def test_asyncio_tasks_each_see_their_own_scope():
    import asyncio

    async def task(mode):
        with cs.context(mode=mode):
            await asyncio.sleep(0.01)
            return cs.current("mode")

    async def main():
        return await asyncio.gather(task("a"), task("b"))

    assert asyncio.run(main()) == ["a", "b"]
    assert cs.current("mode") is None


@pytest.mark.parametrize("scope", ["context", "capture", "patch"])
def test_a_scope_exited_in_another_thread_stays_open_for_the_right_exit(scope):
    # The exit raised Python's bare ValueError ("created in a different Context"),
    # and a generator's scope (context, patch) was over then: it stayed open in the
    # thread that entered it for good, and the right exit did nothing.
    model = _seq()
    opened = {"context": lambda: cs.context(mode="a"),
              "capture": lambda: cs.capture(model, "s/d"),
              "patch": lambda: cs.patch(model, {"s/d": lambda v: v * 0.0 + 7.0})}[scope]()
    what = {"context": r"`cs.context\(mode='a'\)`", "capture": "A `cs.capture`",
            "patch": r"`cs.patch` of \['s/d'\]"}[scope]
    errors = []

    def exit_here():
        try:
            opened.__exit__(None, None, None)
        except RuntimeError as error:
            errors.append(str(error))

    opened.__enter__()
    worker = threading.Thread(target=exit_here, name="worker")
    worker.start()
    worker.join()
    assert len(errors) == 1
    assert re.fullmatch(what + r" was exited in another thread or asyncio task .* It stays "
                        r"open where it was entered: exit it there .*Received: entered in "
                        r"thread 'MainThread', exited in thread 'worker'", errors[0])
    # Still open here, and it applies:
    out = model.predict(X, verbose=0)
    if scope == "context":
        assert cs.current("mode") == "a"
    if scope == "patch":
        np.testing.assert_array_equal(out, np.full((8, 2), 7.0))
    opened.__exit__(None, None, None)  # the right exit closes it
    assert cs.current("mode") is None
    np.testing.assert_allclose(model.predict(X, verbose=0), numpy(model(X)), rtol=1e-6)
    if scope == "capture":
        np.testing.assert_allclose(opened["s/d:output"], out, rtol=1e-6)
    with pytest.raises(RuntimeError, match=what + r" is not open: it was exited already"):
        opened.__exit__(None, None, None)


def test_a_context_decorates_a_function_each_call_in_a_scope_of_its_own():
    @cs.context(mode="b")
    def mode():
        return cs.current("mode")

    assert (mode(), mode(), cs.current("mode")) == ("b", "b", None)


def test_a_saved_file_holds_no_dynamic_value(tmp_path):
    model = _scaled()
    model.predict(X, temperature=2.0, verbose=0)
    path = str(tmp_path / "t.keras")
    model.save(path)
    twin = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2), Scale()])
    twin.load_weights(path)  # raises if the file held one array more
    np.testing.assert_allclose(numpy(twin(X)), _dense(model, X), rtol=1e-5, atol=1e-6)


def test_values_reach_callbacks_and_nested_calls_inherit_them():
    model = _seq()
    model.register_context_args("mode")
    seen = []

    class Reads(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(cs.current("mode"))

    model.fit(X, Y, mode="x", epochs=1, verbose=0, callbacks=[Reads()],
              validation_data=(X, Y))
    model.fit(X, Y, epochs=1, verbose=0, callbacks=[Reads()])
    assert seen == ["x", None]


# --------------------------------------------------------------------------
# Found by review
# --------------------------------------------------------------------------
def test_two_threads_evaluating_one_model_get_their_own_metrics():
    model = _seq()
    targets = {"a": np.zeros((8, 2), "float32"), "b": np.full((8, 2), 100.0, "float32")}
    reference = {k: model.evaluate(X, y, batch_size=2, verbose=0) for k, y in targets.items()}
    got = {"a": [], "b": []}

    def caller(k):
        return lambda: got[k].extend(model.evaluate(X, targets[k], batch_size=2, verbose=0)
                                     for _ in range(4))

    _in_threads(caller("a"), caller("b"))
    for k, values in got.items():
        np.testing.assert_allclose(values, [reference[k]] * 4, rtol=1e-5)


@pytest.mark.parametrize("other", ["evaluate", "fit"])
def test_a_fit_paused_before_its_first_step_keeps_its_metrics_from_the_others(other):
    # A fresh model: the other thread's first step makes the compiled metrics (on
    # TF), so the paused fit found more metric variables than it parked; nothing
    # was put back, and its epoch's loss and mae went on from the other's totals.
    keras.utils.set_random_seed(0)
    model = cs.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d")])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", metrics=["mae"])
    far = Y + 100.0

    class LetsTheOtherRunFirst(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):  # (after fit reset its metrics)
            call = (lambda: model.evaluate(X, far, batch_size=4, verbose=0)) \
                if other == "evaluate" else (
                lambda: model.fit(X, far, batch_size=4, epochs=1, verbose=0))
            worker = threading.Thread(target=call, daemon=True)
            worker.start()
            worker.join(60)
            assert not worker.is_alive()

    got = []
    _in_threads(lambda: got.append(model.fit(
        X, Y, batch_size=4, epochs=1, verbose=0, callbacks=[LetsTheOtherRunFirst()])))
    loss, mae = model.evaluate(X, Y, batch_size=4, verbose=0)  # learning rate 0
    assert got[0].history["loss"] == [pytest.approx(loss, rel=1e-5)]
    assert got[0].history["mae"] == [pytest.approx(mae, rel=1e-5)]


def test_a_calls_values_reach_the_calls_its_callbacks_make_unless_given_their_own():
    @cs.context_args("debugging", "mode")
    class Marks(keras.layers.Layer):
        def call(self, x, debugging=None, mode=None):
            return x * (2.0 if debugging else 1.0) + (10.0 if mode == "b" else 0.0)

    model = cs.Sequential([keras.Input((1,)), Marks(), keras.layers.Dense(
        1, kernel_initializer="ones", bias_initializer="zeros")])
    model.register_context_args("debugging", "mode")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    x, got = np.ones((4, 1), "float32"), []

    class Nested(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            for values in ({}, {"mode": "b"}, {"debugging": False}):
                got.append(float(self.model.predict(x, verbose=0, **values)[0, 0]))

    model.fit(x, x, debugging=True, epochs=1, verbose=0, callbacks=[Nested()])
    assert got == [2.0, 12.0, 1.0]
    assert float(model.predict(x, verbose=0)[0, 0]) == 1.0  # and after it, the defaults


def test_a_nested_call_never_sees_another_calls_dynamic_value():
    model = _scaled()
    reference = model.evaluate(X, Y, temperature=2.0, verbose=0)
    seen = []

    class Other(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.model.predict(X[:2], temperature=5.0, verbose=0)

        def on_test_begin(self, logs=None):
            seen.append(float(numpy(cs.current("temperature"))))

    history = model.fit(X, Y, temperature=2.0, batch_size=4, epochs=1, verbose=0,
                        validation_data=(X, Y), callbacks=[Other()])
    assert history.history["val_loss"][0] == pytest.approx(reference, rel=1e-5)
    assert seen == [2.0]


def test_a_data_worker_may_call_another_model_during_fit():
    teacher, student = _seq("teacher"), _seq("student")

    class Data(keras.utils.PyDataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            x = X[i * 4:(i + 1) * 4]
            return x, np.asarray(numpy(teacher(x)))

    done = []
    _in_threads(lambda: done.append(
        student.fit(Data(workers=2, use_multiprocessing=False), epochs=1, verbose=0)))
    assert done


@cs.context_args("mode")
class Refuses(keras.layers.Layer):
    def call(self, x, mode=None):
        if mode == "bad":
            raise RuntimeError("bad mode")
        return x


def test_a_call_failing_while_another_runs_leaves_the_weights():
    keras.utils.set_random_seed(0)
    model = cs.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d"), Refuses()],
                          name="s")
    model.register_context_args("mode")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    reference = _dense(model, X)
    started = threading.Event()

    class Slow(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            started.set()
            time.sleep(0.05)

    def failing():
        started.wait(60)
        with pytest.raises(RuntimeError, match="bad mode"):
            model.predict(X, mode="bad", verbose=0)

    _in_threads(lambda: model.fit(X, Y, batch_size=1, epochs=1, verbose=0, callbacks=[Slow()]),
                failing)
    np.testing.assert_allclose(model.predict(X, verbose=0), reference, rtol=1e-5, atol=1e-6)


def test_patches_and_captures_of_an_inner_model_apply_through_the_outer():
    inner = cs.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d")], name="inner")
    outer = cs.Sequential([keras.Input((4,)), inner], name="outer")
    w, b = (numpy(v) for v in inner.get_layer("d").weights)
    with cs.patch(inner, {"inner/d": keras.ops.zeros_like}):
        np.testing.assert_allclose(outer.predict(X, verbose=0), 0.0)
    with cs.capture(inner, "inner/d") as cap:
        outer.predict(X, verbose=0)
    np.testing.assert_allclose(cap["inner/d:output"], X @ w + b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outer.predict(X, verbose=0), X @ w + b, rtol=1e-5, atol=1e-6)


class Reads(keras.layers.Layer):
    def call(self, x):
        return x + cs.current("shift", default=0.0)


def test_a_name_read_in_a_trace_is_refused_later_whatever_the_order():
    model = cs.Sequential([keras.Input((2,)), Reads()])
    x = np.zeros((2, 2), "float32")
    np.testing.assert_allclose(model.predict(x, verbose=0), 0.0)
    with cs.context(shift=5.0):
        with pytest.raises(cs_errors(), match=r"register_context_args\('shift'\).*shift=5"):
            model.predict(x, verbose=0)
    np.testing.assert_allclose(model.predict(x, verbose=0), 0.0)


def cs_errors():
    from callscope._scope import StrayValueError

    return StrayValueError


def test_a_direct_step_call_uses_the_callers_scope():
    model = cs.Sequential([keras.Input((4,)), keras.layers.Dense(2), Shift()])
    model.register_context_args("mode")

    def step():
        return _predict_step(model, X)

    base = step()
    model.predict(X, verbose=0)
    with cs.context(mode="a"):
        np.testing.assert_allclose(step(), base + 1.0, rtol=1e-5)
    np.testing.assert_allclose(step(), base, rtol=1e-5)


def test_fits_and_predicts_from_three_threads_on_one_model():
    # SGD(0) keeps the weights, so every predict must equal the reference, however
    # the calls interleave; on JAX each handover moves the loop state correctly.
    model = _seq()
    reference = _dense(model, X)
    outs = []

    class Pause(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            time.sleep(0.002)

    def fits():
        for _ in range(3):
            model.fit(X, Y, batch_size=2, epochs=1, verbose=0, callbacks=[Pause()])

    def predicts():
        for _ in range(5):
            outs.append(model.predict(X, batch_size=2, verbose=0))

    _in_threads(fits, fits, predicts)
    assert len(outs) == 5
    for out in outs:
        np.testing.assert_allclose(out, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("other", ["predict", "evaluate"])
def test_a_callback_that_reads_the_model_then_waits_on_another_thread(other):
    model = _seq()
    reference = {"predict": _dense(model, X),
                 "evaluate": model.evaluate(X, Y, batch_size=4, verbose=0)}
    got = []

    class ReadsThenWaits(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            weights = self.model.get_weights()  # touches the weights first
            assert len(weights) == 2
            call = (lambda: self.model.predict(X, verbose=0)) if other == "predict" else (
                lambda: self.model.evaluate(X, Y, batch_size=4, verbose=0))
            worker = threading.Thread(target=lambda: got.append(call()), daemon=True)
            worker.start()
            worker.join(60)
            assert not worker.is_alive(), f"the worker's {other} deadlocked"

    _in_threads(lambda: model.fit(X, Y, batch_size=4, epochs=2, verbose=0,
                                  callbacks=[ReadsThenWaits()]))
    assert len(got) == 2
    for value in got:
        np.testing.assert_allclose(value, reference[other], rtol=1e-5, atol=1e-6)


def test_cs_current_inside_a_users_compiled_function_is_never_frozen():
    if BACKEND == "torch":
        pytest.skip("torch.compile runs this Python eagerly (a graph break): nothing freezes")
    model = cs.Sequential([keras.Input((2,)), Reads()])
    compiled = _user_compiled(lambda x: model(x))
    x = keras.ops.zeros((2, 2))
    with cs.context(shift=5.0):
        with pytest.raises(Exception, match="read inside a compiled function"):
            compiled(x)
    np.testing.assert_allclose(numpy(compiled(x)), 0.0)
    with cs.context(shift=5.0):  # traced before the scope: still refused, never ignored
        with pytest.raises(Exception, match="read inside a compiled function"):
            _user_compiled(lambda x: model(x) * 1.0)(x)


def test_a_step_called_from_a_callback_under_a_capture_is_a_plain_step():
    model = _seq()
    got = []

    class Steps(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            got.append(_predict_step(model, X))

    with cs.capture(model, "s/d") as cap:
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[Steps()])
    np.testing.assert_allclose(got[0], _dense(model, X), rtol=1e-5, atol=1e-6)
    assert cap["s/d:output"].shape == (8, 2)


def test_a_dynamic_value_passed_to_a_direct_call_reaches_layers_as_a_tensor():
    seen = []

    @cs.context_args("temperature")
    class Check(keras.layers.Layer):
        def call(self, x, temperature=None):
            if temperature is None:
                return x
            seen.append(keras.ops.is_tensor(temperature))
            return x * temperature

    model = cs.Sequential([keras.Input((2,)), Check()])
    model.register_context_args("temperature", dynamic=True)
    np.testing.assert_allclose(numpy(model(np.ones((1, 2), "float32"), temperature=2.0)), 2.0)
    assert seen and all(seen)


def test_two_threads_fitting_with_validation_each_validate_their_own_data():
    model = _seq()
    X2, Y2 = X[::-1].copy() * 2.0, Y[::-1].copy()
    reference = {
        "a": model.fit(X, Y, batch_size=2, epochs=2, verbose=0, validation_data=(X2, Y2)),
        "b": model.fit(X2, Y2, batch_size=2, epochs=2, verbose=0, validation_data=(X, Y)),
    }
    got = {}

    class Pause(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            time.sleep(0.002)

        def on_test_batch_end(self, batch, logs=None):
            time.sleep(0.002)

    def fits(k, data, validation):
        return lambda: got.setdefault(k, model.fit(
            *data, batch_size=2, epochs=2, verbose=0, validation_data=validation,
            callbacks=[Pause()]))

    _in_threads(fits("a", (X, Y), (X2, Y2)), fits("b", (X2, Y2), (X, Y)))
    for k in ("a", "b"):
        np.testing.assert_allclose(got[k].history["val_loss"],
                                   reference[k].history["val_loss"], rtol=1e-5)


def test_a_callback_raising_while_another_thread_evaluates():
    model = _seq()
    XB = (X * np.arange(1, 9, dtype="float32")[:, None]).astype("float32")
    reference = model.evaluate(XB, Y, batch_size=1, verbose=0)
    a_in, b_in = threading.Event(), threading.Event()
    got = []

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            a_in.set()
            b_in.wait(10)
            time.sleep(0.03)
            raise RuntimeError("boom")

    class Slow(keras.callbacks.Callback):
        def on_test_batch_end(self, batch, logs=None):
            if batch >= 1:
                b_in.set()
            time.sleep(0.01)

    def fails():
        with pytest.raises(RuntimeError, match="boom"):
            model.fit(X, Y, batch_size=2, epochs=1, verbose=0, callbacks=[Boom()])

    def evaluates():
        a_in.wait(10)
        got.append(model.evaluate(XB, Y, batch_size=1, verbose=0, callbacks=[Slow()]))

    _in_threads(fails, evaluates)
    assert got == [pytest.approx(reference, rel=1e-5)]
    assert model.evaluate(XB, Y, batch_size=1, verbose=0) == pytest.approx(reference, rel=1e-5)
    np.testing.assert_allclose(model.predict(X, verbose=0), _dense(model, X), rtol=1e-5,
                               atol=1e-6)


def test_a_gate_whose_switch_raises_is_not_left_held():
    # The turn's hand-over (parking the other call's state) may fail; the call
    # that tried never started, so the gate must be free for the paused one.
    from callscope._run import Gate

    fails = [True]

    def switch(previous, current):
        if fails and fails.pop():
            raise RuntimeError("parking failed")

    gate = Gate(switch)
    gate.enter()
    gate.open()  # paused, as in a callback
    errors = []

    def other():
        try:
            gate.enter()
        except RuntimeError as error:
            errors.append(str(error))

    worker = threading.Thread(target=other)
    worker.start()
    worker.join(10)
    assert errors == ["parking failed"]
    assert not gate._lock.locked()  # else the paused call's `close` waits forever
    gate.close()
    assert not gate.is_open_for()


# What a call made while making a batch for a `fit` of the same model does, by
# backend: "refused", or "runs" (it would wait for nothing). Before, each
# "refused" waited for ever (the fit's step held what the call waits for: its
# turn, or on TF the dynamic values while the step pulls its batch).
_FEEDING = {
    "jax": {("predict", "pydataset"): "refused", ("evaluate", "pydataset"): "refused",
            ("call", "pydataset"): "refused"},
    "tensorflow": {(how, source): "refused" for how in ("predict", "evaluate", "call")
                   for source in ("pydataset", "generator")},
    "torch": {("predict", "pydataset"): "runs", ("evaluate", "pydataset"): "refused",
              ("call", "pydataset"): "refused", ("predict", "generator"): "runs",
              ("evaluate", "generator"): "runs", ("call", "generator"): "runs"},
}


@pytest.mark.parametrize(("how", "source"), sorted(_FEEDING[BACKEND]))
def test_a_call_made_by_the_input_pipeline_of_its_own_fit_is_refused_not_hung(how, source):
    # (A JAX generator runs in fit's own thread, between Keras's purge of the
    # weights and the step: stock Keras fails there alike, not callscope's.)
    model = _scaled()
    x = np.concatenate([X, X])
    made = []

    def use(batch):
        if how == "predict":
            made.append((batch, model.predict(batch, temperature=0.5, verbose=0)))
        elif how == "evaluate":
            made.append((batch, model.evaluate(batch, batch[:, :2], verbose=0)))
        else:
            made.append((batch, numpy(model(batch))))

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            batch = x[i * 4:(i + 1) * 4]
            use(batch)
            return batch, batch[:, :2]

    def generator():
        for i in range(4):
            batch = x[i * 4:(i + 1) * 4]
            use(batch)
            yield batch, batch[:, :2]

    data = (Batches(workers=2, use_multiprocessing=False) if source == "pydataset"
            else generator())
    outcome = []

    def fit():
        try:
            model.fit(data, temperature=2.0, steps_per_epoch=4, shuffle=False, verbose=0)
            outcome.append("runs")
        except Exception as error:  # noqa: BLE001 - asserted below
            outcome.append(error)

    _in_threads(fit)
    if _FEEDING[BACKEND][how, source] == "runs":
        assert outcome == ["runs"] and len(made) >= 4  # (a pipeline may read ahead)
        if how == "predict":  # each with its own value, never the fit's 2.0
            for batch, out in made:
                np.testing.assert_allclose(out, _dense(model, batch) * 0.5, rtol=1e-5)
    else:
        method = {"call": "__call__"}.get(how, how)
        source = "`Batches`" if source == "pydataset" else "generator `generator`"
        assert re.search(rf"`t.{method}` was called while making a batch of the {source}, "
                         r"which a `fit` of `t` in another thread reads: .* so this call "
                         r"would wait for ever for that one, and it for this batch.* "
                         r"Received: `t.", str(outcome[0])), outcome[0]
    # Nothing held or left behind: the model runs, in this thread and another.
    np.testing.assert_allclose(model.predict(X, temperature=3.0, verbose=0),
                               _dense(model, X) * 3.0, rtol=1e-5)
    _in_threads(lambda: model.evaluate(X, Y, verbose=0))


def test_a_pipeline_feeding_another_models_fit_waits_its_turn_as_before():
    # The refusal above took any pipeline for the one feeding the running call: a
    # student's PyDataset computing targets with a teacher that another thread
    # fits was refused on every backend (it waits for its turn, and runs).
    teacher, student = _scaled(), _seq("student")
    x = np.concatenate([X] * 4)
    made = []

    def deep(batch, depth):  # (a pipeline deep in the user's code: no frame limit)
        return deep(batch, depth - 1) if depth else numpy(teacher(batch))

    class Targets(keras.utils.PyDataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            batch = x[i * 4:(i + 1) * 4]
            made.append((batch, deep(batch, 80)))
            return batch, made[-1][1]

    class Plain(keras.utils.PyDataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return x[i * 4:(i + 1) * 4], x[i * 4:(i + 1) * 4, :2]

    _in_threads(lambda: teacher.fit(Plain(workers=2, use_multiprocessing=False),
                                    temperature=2.0, epochs=3, verbose=0),
                lambda: student.fit(Targets(workers=2, use_multiprocessing=False),
                                    epochs=3, verbose=0))
    assert len(made) >= 24
    for batch, targets in made:  # SGD(0): the teacher's weights never move
        np.testing.assert_allclose(targets, _dense(teacher, batch), rtol=1e-5)
    # And one that feeds this model's own fit, that deep, is refused.
    outcome = []

    class Feeds(Targets):
        def __getitem__(self, i):
            deep(x[:4], 80)
            return x[:4], x[:4, :2]

    def fit():
        try:
            teacher.fit(Feeds(workers=2, use_multiprocessing=False), verbose=0)
        except Exception as error:  # noqa: BLE001 - asserted below
            outcome.append(error)

    _in_threads(fit)
    assert "was called while making a batch of the `Feeds`" in str(outcome[0]), outcome


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TF's steps pull their batch")
def test_a_pipeline_call_waiting_for_a_batch_patchs_step_lock_is_refused_not_hung():
    # A patch that takes the batch holds the step's lock as dynamic values do;
    # the refusal did not count it, and the generator's predict hung.
    model = _scaled()
    outcome = []

    def generator():  # (Keras reads the first two in the call's own thread)
        for i in range(4):
            batch = X[i * 2:(i + 1) * 2]
            model.predict(batch, temperature=0.5, verbose=0)
            yield batch, Y[i * 2:(i + 1) * 2]

    def evaluate():
        try:
            with cs.patch(model, {"t/d": lambda value, batch: value}):
                model.evaluate(generator(), steps=4, verbose=0)
            outcome.append("runs")
        except Exception as error:  # noqa: BLE001 - asserted below
            outcome.append(error)

    _in_threads(evaluate)
    assert "was called while making a batch of the generator `generator`, which a " \
           "`evaluate` of `t` in another thread reads" in str(outcome[0]), outcome
