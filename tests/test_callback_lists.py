"""Callbacks as Keras takes them: a `CallbackList` the user built is left as it was
(and may be reused across calls and models), and `callbacks` (or any argument) may
be passed by position, as stock Keras allows."""

import threading

import keras
import numpy as np
import pytest
from conftest import numpy

import callscope as cs

rng = np.random.default_rng(0)
X = rng.normal(size=(8, 4)).astype("float32")
Y = rng.normal(size=(8, 2)).astype("float32")
JOIN_S = 20  # a regression (the gate held while callbacks run) fails instead of hanging


def _model(cls=cs.Sequential, seed=0):
    keras.utils.set_random_seed(seed)
    model = cls([keras.Input((4,)), keras.layers.Dense(3, name="d"), keras.layers.Dense(2)],
                name="seq")
    model.compile(optimizer="sgd", loss="mse")
    return model


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs, self.hooks = [], []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(dict(logs or {}))

    def on_train_begin(self, logs=None):
        self.hooks.append("train")

    def on_test_begin(self, logs=None):
        self.hooks.append("test")

    def on_predict_begin(self, logs=None):
        self.hooks.append("predict")


class EvaluateInThread(keras.callbacks.Callback):
    """Waits on another thread's `evaluate` of the same model, at each epoch's end
    (or each train batch's end): the README's "a callback may wait on another
    thread's call into the same model"."""

    def __init__(self, batches=False):
        super().__init__()
        self.finished = []
        if batches:
            self.on_train_batch_end = lambda batch, logs=None: self._wait()

    def on_epoch_end(self, epoch, logs=None):
        self._wait()

    def _wait(self):
        out = {}
        worker = threading.Thread(
            target=lambda: out.setdefault("loss", self.model.evaluate(X, Y, verbose=0)),
            daemon=True)
        worker.start()
        worker.join(JOIN_S)
        self.finished.append("loss" in out)


def _assert_close(got, expected):
    if isinstance(expected, dict):
        assert sorted(got) == sorted(expected)
        for key in expected:
            _assert_close(got[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            _assert_close(g, e)
    elif isinstance(expected, str):
        assert got == expected
    else:
        np.testing.assert_allclose(got, expected, rtol=1e-6)


def _contents(callbacks):
    return [id(c) for c in callbacks.callbacks], [type(c).__name__ for c in callbacks.callbacks]


def test_a_users_callback_list_is_unchanged_by_fit_evaluate_and_predict():
    model = _model()
    recorder = Recorder()
    callbacks = keras.callbacks.CallbackList([recorder], add_history=True, model=model)
    before = _contents(callbacks)
    history = model.fit(X, Y, epochs=2, batch_size=4, verbose=0, callbacks=callbacks,
                        validation_data=(X, Y))
    assert _contents(callbacks) == before
    model.evaluate(X, Y, verbose=0, callbacks=callbacks)
    model.predict(X, verbose=0, callbacks=callbacks)
    assert _contents(callbacks) == before
    assert not callbacks.params  # stock Keras sets no params on a list it is given
    # The list did its job: its History is what fit returned, its callbacks ran.
    assert history is callbacks.callbacks[1]
    assert len(history.history["val_loss"]) == 2
    assert [sorted(e) for e in recorder.epochs] == [["loss", "val_loss"]] * 2
    assert recorder.hooks == ["train", "test", "test", "test", "predict"]


def test_a_users_callback_list_is_unchanged_after_a_callback_raises_in_fit():
    class Fails(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            raise RuntimeError("callback failed")

    model = _model()
    waiter = EvaluateInThread()
    callbacks = keras.callbacks.CallbackList([Fails()], add_history=True, model=model)
    before = _contents(callbacks)
    with pytest.raises(RuntimeError, match="callback failed"):
        model.fit(X, Y, epochs=1, verbose=0, callbacks=callbacks)
    assert _contents(callbacks) == before
    # Nothing is left held: the list, without the failing callback, works again.
    callbacks.callbacks[0] = waiter
    waiter.set_model(model)
    model.fit(X, Y, epochs=1, verbose=0, callbacks=callbacks)
    assert waiter.finished == [True]


def test_one_callback_list_reused_across_models_and_fits_releases_each_models_gate():
    a, b = _model(seed=0), _model(seed=1)
    waiter = EvaluateInThread()
    callbacks = keras.callbacks.CallbackList([waiter], add_history=True, model=a)
    a.fit(X, Y, epochs=1, verbose=0, callbacks=callbacks)
    callbacks.set_model(b)
    b.fit(X, Y, epochs=1, verbose=0, callbacks=callbacks)
    assert waiter.finished == [True, True]
    # A callback added to the list later runs with the gate open too.
    late = EvaluateInThread()
    callbacks.callbacks.append(late)
    callbacks.set_model(b)
    b.fit(X, Y, epochs=1, verbose=0, callbacks=callbacks)
    assert waiter.finished == [True] * 3 and late.finished == [True]


def test_a_callback_list_with_batch_hooks_releases_the_gate_around_them():
    model = _model()
    waiter = EvaluateInThread(batches=True)
    callbacks = keras.callbacks.CallbackList([waiter], add_history=True, model=model)
    model.fit(X, Y, epochs=1, batch_size=4, verbose=0, callbacks=callbacks)
    assert waiter.finished == [True, True, True]  # two batches, one epoch
    assert _contents(callbacks)[1] == ["EvaluateInThread", "History"]


def test_positional_arguments_give_what_stock_keras_gives():
    results = {}
    for cls in (keras.Sequential, cs.Sequential):
        model = _model(cls)
        recorder = Recorder()
        history = model.fit(X, Y, 4, 2, 0, [recorder], 0.0, (X, Y), False)
        evaluated = model.evaluate(X, Y, 4, 0, None, None, [recorder], True)
        predicted = model.predict(X, 4, 0, None, [recorder])
        on_batch = model.train_on_batch(X, Y, None, None, True)
        tested = model.test_on_batch(X, Y, None, True)
        results[cls] = (history.history, evaluated, predicted, on_batch, tested,
                        recorder.epochs, recorder.hooks)
    stock, ours = results[keras.Sequential], results[cs.Sequential]
    _assert_close(ours, stock)
    assert ours[-1] == ["train", "test", "test", "test", "predict"]


def test_positional_callback_list_and_context_values_by_keyword():
    @cs.context_args("scale")
    class Scale(keras.layers.Layer):
        def call(self, x, scale=None):
            return x if scale is None else x * scale

    keras.utils.set_random_seed(0)
    model = cs.Sequential([keras.Input((4,)), keras.layers.Dense(2), Scale()])
    model.register_context_args("scale")
    model.compile(optimizer="sgd", loss="mse")
    callbacks = keras.callbacks.CallbackList([EvaluateInThread()], add_history=True,
                                             model=model)
    before = _contents(callbacks)
    model.fit(X, Y, 4, 1, 0, callbacks, scale=2.0)
    np.testing.assert_allclose(model.predict(X, 8, 0, None, None, scale=2.0),
                               2.0 * numpy(model(X)), rtol=1e-5, atol=1e-6)
    assert _contents(callbacks) == before
    assert callbacks.callbacks[0].finished == [True]
    with pytest.raises(TypeError, match="multiple values for argument 'x'"):
        model.fit(X, Y, x=X)


def test_log_true_with_a_users_callback_list(capsys):
    logged = {}
    for kind in ("list", "CallbackList"):
        model = _model()
        recorder = Recorder()
        callbacks = [recorder]
        if kind == "CallbackList":
            callbacks = keras.callbacks.CallbackList(callbacks, add_history=True, model=model)
            before = _contents(callbacks)
        with cs.capture(model, "seq/d", reduce="mean", log=True):
            history = model.fit(X, Y, epochs=2, batch_size=4, verbose=0, callbacks=callbacks)
        logged[kind] = (history.history, recorder.epochs)
    assert _contents(callbacks) == before
    assert history is callbacks.callbacks[1]
    key = "seq/d:output/mean"
    assert len(logged["CallbackList"][0][key]) == 2
    assert all(key in logs for logs in logged["CallbackList"][1])
    _assert_close(logged["CallbackList"], logged["list"])
    assert capsys.readouterr().out == ""  # the user's list has no progress bar


def test_positional_arguments_through_an_override_that_passes_them_on():
    # `def fit(self, *args, **kwargs): return super().fit(*args, **kwargs)` (as
    # keras_hub writes it) binds as Keras's own fit: callbacks by position worked
    # for neither before.
    class PassesOn(keras.Sequential):
        def fit(self, *args, **kwargs):
            return super().fit(*args, **kwargs)

    stock, model = _model(keras.Sequential), cs.enable(_model(PassesOn))
    want = stock.fit(X, Y, 4, 2, 0, [Recorder()], shuffle=False).history
    recorder = Recorder()
    got = model.fit(X, Y, 4, 2, 0, [recorder], shuffle=False).history
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
    assert recorder.hooks == ["train"] and len(recorder.epochs) == 2
