"""Runs one distribution scenario in a fresh process and prints JSON results.

Device counts must be fixed before the backend initialises, hence the process.
Usage: python distributed_worker.py jax|tensorflow
"""

import contextlib
import json
import threading

from worker_devices import start

ENGINE = start(jax_devices=4, tf_devices=2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import callscope as cs  # noqa: E402

if ENGINE == "tensorflow":
    import tensorflow as tf

X = np.arange(32, dtype="float32").reshape(16, 2) / 10.0
Y = (X.sum(axis=1, keepdims=True) * 3.0).astype("float32")
seen = []


@cs.context_args("debugging")
class Probe(keras.layers.Layer):
    def call(self, x, debugging=None):
        seen.append((threading.current_thread().name, debugging))
        return x + 100.0 if debugging else x


def build(run_eagerly=False):
    keras.utils.set_random_seed(0)
    model = cs.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="dense"),
                           Probe(name="probe")], name="seq")
    model.register_context_args("debugging")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", run_eagerly=run_eagerly)
    return model


def run(model):
    out = {}
    out["predict_on"] = model.predict(X, debugging=True, batch_size=8, verbose=0).tolist()
    out["predict_off"] = model.predict(X, batch_size=8, verbose=0).tolist()
    out["eval_on"] = float(model.evaluate(X, Y, debugging=True, batch_size=8, verbose=0))
    hist = model.fit(X, Y, debugging=True, epochs=2, batch_size=8, verbose=0)
    out["fit_on"] = hist.history["loss"]
    hist = model.fit(X, Y, epochs=2, batch_size=8, verbose=0)
    out["fit_off"] = hist.history["loss"]
    out["weights"] = [np.asarray(keras.ops.convert_to_numpy(w)).tolist() for w in model.weights]
    with cs.capture(model, "*/dense*", reduce=("mean", "std")) as stats:
        model.predict(X, batch_size=8, verbose=0)
    with cs.capture(model, "*/dense*") as cap:
        model.predict(X, batch_size=8, verbose=0)
    out["capture_predict"] = {k: v.tolist() for k, v in cap.items()}
    out["capture_stats"] = {k: float(v) for k, v in stats.items()}
    # TF: 9 rows in batches of 4: the last batch has one row, so under two replicas
    # one replica gets none; its partials must merge as no data. (JAX's
    # DataParallel needs batches its devices divide: 12 rows in batches of 8.)
    rows, batch = (9, 4) if ENGINE == "tensorflow" else (12, 8)
    with cs.capture(model, "*/dense*", reduce=("mean", "std", "min", "max", "hist",
                                               "nan_count"), bins=4) as uneven:
        model.predict(X[:rows], batch_size=batch, verbose=0)
    out["uneven_rows"] = rows
    out["uneven_stats"] = {k: np.asarray(v).tolist() for k, v in uneven.items()}
    out["uneven_edges"] = uneven.hist_edges("seq/dense:output/hist").tolist()
    if ENGINE == "tensorflow":  # a first (and only) batch that leaves a replica no rows
        # (a key of its own, so that its step is first traced with that batch)
        with cs.capture(model, "seq/dense", reduce=("mean", "std")) as lone:
            model.predict(X[:1], batch_size=4, verbose=0)  # 1 row, 2 replicas
        out["lone_stats"] = {k: float(v) for k, v in lone.items()}
    with cs.capture(model, "*/dense*") as cap:
        model.fit(X, Y, epochs=1, batch_size=8, verbose=0, shuffle=False)
    out["capture_fit"] = {k: v.tolist() for k, v in cap.items()}
    return out


@cs.context_args("temperature")
class Scale(keras.layers.Layer):
    def call(self, x, temperature=None):
        return x if temperature is None else x * temperature


def build_scaled():
    keras.utils.set_random_seed(0)
    model = cs.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="dense"),
                           Scale(name="scale")], name="seq")
    model.register_context_args("temperature", dynamic=True)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def hidden_state(model):
    """callscope's own variables (a dynamic value's, a batch patch's row offset),
    made after functions were compiled: under a JAX distribution those functions
    fixed one output sharding per variable (they failed: "pytree structure
    error ... out_shardings"). And a layer's 0-d argument, the value itself,
    recorded once per batch, not once per replica."""
    out = {"plain": model.predict(X, batch_size=8, verbose=0).tolist()}
    model.evaluate(X, Y, batch_size=8, verbose=0)
    out["warm"] = model.predict(X, batch_size=8, temperature=2.0, verbose=0).tolist()
    out["plain_after"] = model.predict(X, batch_size=8, verbose=0).tolist()
    out["evaluate_after"] = float(model.evaluate(X, Y, batch_size=8, verbose=0))
    with cs.capture(model, "seq/scale", kinds=("input",)) as cap:
        model.predict(X, batch_size=8, temperature=3.0, verbose=0)
    out["scale_inputs"] = arrays(cap)
    if ENGINE == "jax":
        with cs.patch(model, {"seq/dense": np.ones((16, 1), "float32")}):
            out["batch_patched"] = model.predict(X, batch_size=8, verbose=0).tolist()
        out["plain_after_patch"] = model.predict(X, batch_size=8, verbose=0).tolist()
    return out


class Center(keras.layers.Layer):
    def call(self, x, mean):
        return x - mean


class Centered(cs.Model):
    """A layer's 0-d argument computed from the rows: each replica's own."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.center = Center(name="center")

    def call(self, x):
        return self.center(x, keras.ops.mean(x))


def replica_arguments():
    with cs.capture(Centered(name="net"), "net/center", kinds=("input",)) as cap:
        cap.model.predict(X, batch_size=8, verbose=0)
    return arrays(cap)


def nested_first_value():
    """The first dynamic value of a callscope model inside another: the outer
    model's functions were made with the state of before (JAX distribution)."""
    keras.utils.set_random_seed(0)
    inner = build_scaled()
    outer = cs.Sequential([keras.Input((2,)), inner], name="outer")
    outer.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    out = {"before": outer.predict(X, batch_size=8, verbose=0).tolist()}
    out["during_fit"] = fit_giving_a_first_value(outer, inner, 0.5, epochs=1)
    out["outer_after_fit"] = outer.predict(X, batch_size=8, verbose=0).tolist()
    out["inner_warm"] = inner.predict(X, batch_size=8, temperature=0.5, verbose=0).tolist()
    out["outer_after"] = outer.predict(X, batch_size=8, verbose=0).tolist()
    outer.fit(X, Y, epochs=1, batch_size=8, verbose=0)
    out["outer_after_second_fit"] = outer.predict(X, batch_size=8, verbose=0).tolist()
    return out


def fit_giving_a_first_value(fitted, model, temperature, epochs):
    """`fitted.fit` whose callback gives `model` a dynamic value: its error, if any."""
    callback = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: model.predict(
        X, temperature=temperature, verbose=0))
    try:
        fitted.fit(X, Y, epochs=epochs, batch_size=8, verbose=0, callbacks=[callback])
    except RuntimeError as e:
        return str(e)
    return None


def first_value_during_fit(model):
    """The first dynamic value given by a callback while `fit` runs."""
    before = [np.asarray(keras.ops.convert_to_numpy(w)) for w in model.weights]
    out = {"error": fit_giving_a_first_value(model, model, 2.0, epochs=2)}
    after = [np.asarray(keras.ops.convert_to_numpy(w)) for w in model.weights]
    out["trained"] = any(not np.allclose(a, b) for a, b in zip(before, after))
    out["finite"] = all(np.isfinite(a).all() for a in after)
    out["predict"] = model.predict(X, batch_size=8, temperature=2.0, verbose=0).tolist()
    out["weights"] = [a.tolist() for a in after]
    return out


def arrays(cap):
    return {k: np.asarray(v).tolist() for k, v in cap.items()}


def train_test(model):
    """TF: captures inside fit, evaluate and *_on_batch (per replica under a
    strategy, gathered into the global batch)."""
    out = {}
    stats = ("mean", "std", "min", "max", "hist", "nan_count")
    # 9 rows in batches of 4: the last batch has one row; under two replicas the
    # second replica gets none.
    with cs.capture(model, "*/dense", kinds=("output", "input", "grad")) as cap:
        model.evaluate(X[:9], Y[:9], batch_size=4, verbose=0)
    out["evaluate_full"] = arrays(cap)
    with cs.capture(model, "*/dense", kinds=("grad",)) as cap:  # last batch: 2 + 1 rows
        model.evaluate(X[:11], Y[:11], batch_size=4, verbose=0)
    out["evaluate_split"] = arrays(cap)
    try:
        with cs.patch(model, {"seq/dense": np.zeros((16, 1), "float32")}):
            model.evaluate(X, Y, batch_size=8, verbose=0)
        out["batch_patch_error"] = None
    except ValueError as e:
        out["batch_patch_error"] = str(e)
    bad = X[:9].copy()
    bad[8, 0] = np.nan  # the one-row batch: a NaN in the replica that has data
    with cs.capture(model, "*/dense", kinds=("output", "grad"), reduce=stats, bins=4) as cap:
        model.evaluate(bad, Y[:9], batch_size=4, verbose=0)
    out["evaluate_stats"] = arrays(cap)
    with cs.patch(model, {"seq/dense": lambda v: v * 2.0}), \
            cs.capture(model, "*/probe") as cap:
        out["evaluate_patched"] = float(model.evaluate(X, Y, batch_size=8, verbose=0))
    out["patched"] = arrays(cap)
    with cs.capture(model, "*/dense", kinds=("output", "grad")) as cap:
        model.train_on_batch(X[:6], Y[:6])
        model.train_on_batch(X[6:12], Y[6:12])
    out["train_on_batch"] = arrays(cap)
    with cs.capture(model, "*/dense", kinds=("output", "grad")) as cap:
        model.test_on_batch(X[:6], Y[:6])
    out["test_on_batch"] = arrays(cap)
    # fit: full records, and statistics one row per step. Validation (5 rows in
    # batches of 4) ends with a one-row batch; a callback's predict is nested.
    probe = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: model.predict(X[:3], verbose=0))
    with cs.capture(model, "*/dense", kinds=("output", "grad")) as cap:
        model.fit(X, Y, epochs=1, batch_size=8, verbose=0, shuffle=False)
    out["fit_full"] = arrays(cap)
    with cs.capture(model, "*/dense", reduce=stats, bins=4) as cap:
        hist = model.fit(X, Y, epochs=2, batch_size=8, verbose=0, shuffle=False,
                         validation_data=(X[:5], Y[:5]), validation_batch_size=4,
                         callbacks=[probe])
    out["fit_calls"] = [[c.method, c.nested, arrays(c)] for c in cap.calls]
    out["fit_val_loss"] = hist.history["val_loss"]
    with cs.patch(model, {"seq/dense": lambda v: v * 0.5}):
        hist = model.fit(X, Y, epochs=2, batch_size=8, verbose=0, shuffle=False)
    out["fit_patched"] = hist.history["loss"]
    out["weights"] = [np.asarray(keras.ops.convert_to_numpy(w)).tolist() for w in model.weights]
    # Last: 9 rows in batches of 4. Keras's own update on the one-row batch differs
    # under two replicas (see the test), so the weights part ways after it.
    with cs.capture(model, "*/dense", reduce=stats, bins=4) as cap:
        model.fit(X[:9], Y[:9], epochs=1, batch_size=4, verbose=0, shuffle=False)
    out["fit_stats"] = arrays(cap)
    return out


def handover(strategy):
    """A callback of a mirrored fit waits for another thread's call of the same
    model: the turn passes to it and back, parking the fit's metrics, whose
    variables are sync-on-read (one part per replica, no single value)."""
    out = {}
    for eager in (False, True):
        with strategy.scope():
            plain, model = build(run_eagerly=eager), build(run_eagerly=eager)
        other = []

        def predict_elsewhere(batch, logs, model=model, other=other):
            worker = threading.Thread(  # a direct call takes the turn (predict: none)
                target=lambda: other.append(keras.ops.convert_to_numpy(
                    model(X[:4], debugging=True))))
            worker.start()
            worker.join(120)

        waits = keras.callbacks.LambdaCallback(on_train_batch_end=predict_elsewhere)
        fit = dict(epochs=2, batch_size=8, verbose=0, shuffle=False)
        out[f"eager={eager}"] = {
            "loss": model.fit(X, Y, callbacks=[waits], **fit).history["loss"],
            "plain": plain.fit(X, Y, **fit).history["loss"],
            "predicts": len(other), "predict_min": float(np.min(other))}
    return out


def synchronized_bn(strategy):
    """Run eagerly, replicas wait for each other inside a synchronized
    BatchNormalization of an inner callscope model, in fit and in a user's own
    `strategy.run`: none may hold a model's turn there."""
    def make(cls, inner_cls):
        keras.utils.set_random_seed(0)
        inner = inner_cls([keras.Input((2,)), keras.layers.Dense(4),
                           keras.layers.BatchNormalization(synchronized=True)], name="inner")
        inputs = keras.Input((2,))
        model = cls(inputs, keras.layers.Dense(1)(inner(inputs)), name="outer")
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", run_eagerly=True)
        return model

    out = {}
    for name, cls, inner_cls in (("callscope", cs.Model, cs.Sequential),
                                 ("stock", keras.Model, keras.Sequential)):
        with strategy.scope():
            model = make(cls, inner_cls)
        loss = model.fit(X, Y, epochs=2, batch_size=8, verbose=0, shuffle=False)
        data = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices(X).batch(8))
        outputs = [strategy.run(lambda x, m=model: m(x, training=True), args=(x,))
                   for x in data]
        out[name] = {"loss": loss.history["loss"], "run": [
            np.concatenate([np.asarray(p) for p in strategy.experimental_local_results(o)])
            .tolist() for o in outputs]}
    return out


class Unbuilt(cs.Model):
    """A subclassed model with no Input: built by its first call."""

    def __init__(self):
        super().__init__(name="unbuilt")
        self.hidden = keras.layers.Dense(3, name="hidden")
        self.head = keras.layers.Dense(1, name="head")

    def call(self, x):
        return self.head(self.hidden(x))


def unbuilt_captured_fit(scope, discover=False):
    """A capture around the first call of an unbuilt model (or, `discover`,
    `cs.points` and `cs.summary` before it): callscope builds it (to find its
    points) in the strategy's scope, as Keras would (built outside, its variables
    were plain, and the distributed update raised AssertionError)."""
    keras.utils.set_random_seed(0)
    with scope:
        model = Unbuilt()
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    if discover:
        assert "unbuilt/hidden" in cs.points(model, X[:2])
        cs.summary(model, X[:2], print_fn=lambda line: None)
    with cs.capture(model, "*/hidden") as cap, \
            cs.capture(model, "*/hidden", reduce=("mean", "std")) as stats:
        loss = model.fit(X, Y, epochs=1, batch_size=8, verbose=0, shuffle=False)
    return {"loss": loss.history["loss"], "capture": arrays(cap), "stats": arrays(stats),
            "weights": [np.asarray(keras.ops.convert_to_numpy(w)).tolist()
                        for w in model.weights]}


results = {"single": run(build()), "single_hidden": hidden_state(build_scaled()),
           "single_first_in_fit": first_value_during_fit(build_scaled())}
if ENGINE == "jax":
    devices = keras.distribution.list_devices("cpu")
    results["devices"] = len(devices)
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    results["distributed"] = run(build())
    results["distributed_hidden"] = hidden_state(build_scaled())
    results["distributed_first_in_fit"] = first_value_during_fit(build_scaled())
    results["distributed_nested"] = nested_first_value()
    keras.distribution.set_distribution(None)
else:
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    results["devices"] = strategy.num_replicas_in_sync
    seen.clear()
    with strategy.scope():
        model = build()
    results["distributed"] = run(model)
    results["threads_with_value"] = sorted({t for t, v in seen if v is True})
    results["single_train_test"] = train_test(build())
    with strategy.scope():
        model = build()
    results["distributed_train_test"] = train_test(model)
    # Run eagerly, each replica's step runs in a thread of its own, which sees no
    # contextvars, while the caller waits holding the model's turn (this hung).
    seen.clear()
    with strategy.scope():
        model = build(run_eagerly=True)
    results["eager_distributed"] = run(model)
    results["eager_threads_with_value"] = sorted({t for t, v in seen if v is True})
    with strategy.scope():
        model = build(run_eagerly=True)
    results["eager_distributed_train_test"] = train_test(model)
    with strategy.scope():
        model = build_scaled()
    results["distributed_hidden"] = hidden_state(model)
    results["single_replica_arguments"] = replica_arguments()
    with strategy.scope():
        try:
            results["replica_arguments"] = replica_arguments()
        except ValueError as e:
            results["replica_arguments"] = str(e)
    results["handover"] = handover(strategy)
    results["unbuilt"] = {"single": unbuilt_captured_fit(contextlib.nullcontext()),
                          "distributed": unbuilt_captured_fit(strategy.scope()),
                          "discovered": unbuilt_captured_fit(strategy.scope(), True)}
    results["synchronized_bn"] = synchronized_bn(strategy)
    with strategy.scope():  # stock Keras, the same validation run eagerly
        keras.utils.set_random_seed(0)
        stock = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        stock.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", run_eagerly=True)
    results["stock_eager_val_loss"] = stock.fit(
        X, Y, epochs=2, batch_size=8, verbose=0, validation_data=(X[:5], Y[:5]),
        validation_batch_size=4).history["val_loss"]
    # Other strategies with several replicas: train/test capture is refused.
    central = tf.distribute.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"])
    with central.scope():
        model = build()
    try:
        with cs.capture(model, "*/dense"):
            model.fit(X, Y, epochs=1, batch_size=8, verbose=0)
    except ValueError as e:
        results["central_storage_error"] = str(e)
print("RESULTS " + json.dumps(results))
