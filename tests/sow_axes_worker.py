"""Values sown with `batch_axis` (none, or not the first) on several devices, in a
fresh process (device counts are fixed before the backend starts): prints JSON of
the same captures on one device and distributed.

Usage: python sow_axes_worker.py jax|tensorflow
"""

import json

from worker_devices import start

ENGINE = start(jax_devices=4, tf_devices=4)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import callscope as cs  # noqa: E402
from models_for_tests import SowsWithoutBatchAxis  # noqa: E402

if ENGINE == "tensorflow":
    import tensorflow as tf

X = np.random.RandomState(0).randn(16, 2).astype("float32")
Y = np.random.RandomState(1).randn(16, 4).astype("float32")
SOWN = "seq/block/*"
STATS = ("mean", "min", "max", "hist", "nan_count")


def build(of_rows=False, jit_compile="auto"):
    keras.utils.set_random_seed(0)
    model = cs.Sequential([keras.Input((2,)), SowsWithoutBatchAxis(of_rows, name="block")],
                          name="seq")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=jit_compile)
    return model


def arrays(cap):
    return {key: np.asarray(value).tolist() for key, value in cap.items()}


def run(model, rows):
    out = {}
    on_batch = 8 if ENGINE == "jax" else 6  # DataParallel: rows the devices divide
    x, y = X[:rows], Y[:rows]
    with cs.capture(model, SOWN) as cap:
        model.predict(x, batch_size=8, verbose=0)
    out["predict"] = arrays(cap)
    with cs.capture(model, SOWN, reduce=STATS, hist_range=(-3.0, 3.0), bins=6) as cap:
        model.predict(x, batch_size=8, verbose=0)
    out["predict_stats"] = arrays(cap)
    with cs.capture(model, SOWN, reduce=STATS, hist_range=(-3.0, 3.0), bins=6) as cap:
        model.evaluate(x, y, batch_size=8, verbose=0)
    out["evaluate_stats"] = arrays(cap)
    # fit on 16 rows: on an uneven split Keras's own gradients differ from one device's
    with cs.capture(model, SOWN, kinds=("output", "grad")) as cap:
        model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    out["fit"] = arrays(cap)
    out["weights"] = [np.asarray(w).tolist() for w in model.get_weights()]
    with cs.capture(model, SOWN, kinds=("output", "grad"), reduce=("mean", "hist"),
                    hist_range=(-3.0, 3.0), bins=6) as cap:
        model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    out["fit_stats"] = arrays(cap)
    with cs.capture(model, SOWN, kinds=("output", "grad")) as cap:
        model.train_on_batch(x[:on_batch], y[:on_batch])
    out["train_on_batch"] = arrays(cap)
    with cs.capture(model, "seq/block/kernel_sum") as cap:
        model.predict_on_batch(x[:on_batch])
    out["predict_on_batch"] = arrays(cap)
    return out


def disagreeing(model):
    """A value computed from each replica's rows, sown as if it had no batch axis:
    its capture, or the error."""
    out = {}
    for method, call in (("predict", lambda: model.predict(X, batch_size=8, verbose=0)),
                         ("fit", lambda: model.fit(X, Y, batch_size=8, verbose=0))):
        try:
            with cs.capture(model, "seq/block/row_mean") as cap:
                call()
            out[method] = arrays(cap)
        except ValueError as e:
            out[method] = str(e)
    return out


def after(model):
    """The model's next captures, after `disagreeing`: nothing left behind, and
    training still runs."""
    with cs.capture(model, "seq/block/kernel*") as cap:
        model.predict(X, batch_size=8, verbose=0)
    with cs.capture(model, "seq/block/kernel*", kinds=("output", "grad")) as fit:
        model.fit(X, Y, batch_size=8, verbose=0, shuffle=False)
    return {"predict": arrays(cap), "fit": arrays(fit),
            "loss": float(model.train_on_batch(X, Y))}


results = {}
if ENGINE == "jax":
    rows = 16  # DataParallel splits each batch evenly over the devices
    results["single"] = run(build(), rows)
    results["single_disagreeing"] = disagreeing(build(of_rows=True))
    devices = keras.distribution.list_devices("cpu")
    results["devices"] = len(devices)
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    results["distributed"] = run(build(), rows)
    results["disagreeing"] = disagreeing(build(of_rows=True))
    keras.distribution.set_distribution(None)
else:
    rows = 14  # an uneven last batch: 6 rows on 4 replicas
    results["single"] = run(build(), rows)
    model = build(of_rows=True)
    results["single_disagreeing"] = disagreeing(model)
    results["single_after_disagreeing"] = after(model)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(4)])
    results["devices"] = strategy.num_replicas_in_sync
    with strategy.scope():
        model = build()
    results["distributed"] = run(model, rows)
    with strategy.scope():
        model = build(of_rows=True)
    results["disagreeing"] = disagreeing(model)
    results["after_disagreeing"] = after(model)
    # XLA cannot join replicas (merge_call): refused, where it was an opaque error
    # (fit, evaluate) or one part per replica (predict).
    with strategy.scope():
        model = build(jit_compile=True)
    results["xla"] = []
    for call in (lambda: model.predict(X, batch_size=8, verbose=0),
                 lambda: model.evaluate(X, Y, batch_size=8, verbose=0)):
        try:
            with cs.capture(model, SOWN):
                call()
            results["xla"].append(None)
        except ValueError as e:
            results["xla"].append(str(e))
    results["xla_after"] = model.predict(X, batch_size=8, verbose=0).tolist()
print("RESULTS " + json.dumps(results))
