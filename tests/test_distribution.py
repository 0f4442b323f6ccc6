"""Context under Keras's own distribution engines, on several CPU devices."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import BACKEND

WORKER = Path(__file__).with_name("distributed_worker.py")
X = np.arange(32, dtype="float32").reshape(16, 2) / 10.0  # the worker's data


def _run_worker(engine, worker=WORKER):
    """The JSON a worker script printed (it sets up its own devices and backend)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND")}
    proc = subprocess.run([sys.executable, str(worker), engine], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])


def _assert_same_as_single_device(results):
    single, dist = results["single"], results["distributed"]
    np.testing.assert_allclose(dist["predict_on"], np.array(single["predict_off"]) + 100, rtol=1e-5)
    np.testing.assert_allclose(dist["predict_on"], single["predict_on"], rtol=1e-5)
    np.testing.assert_allclose(dist["predict_off"], single["predict_off"], rtol=1e-5)
    assert dist["eval_on"] == pytest.approx(single["eval_on"], rel=1e-5)
    np.testing.assert_allclose(dist["fit_on"], single["fit_on"], rtol=1e-4)
    np.testing.assert_allclose(dist["fit_off"], single["fit_off"], rtol=1e-4)
    assert dist["fit_on"][0] > 1000  # the flag reached the loss
    for a, b in zip(dist["weights"], single["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # Captures: same values, in global batch order, as on one device.
    assert dist["capture_predict"].keys() == single["capture_predict"].keys()
    for key, value in single["capture_predict"].items():
        assert np.shape(value) == (16, 1)
        np.testing.assert_allclose(dist["capture_predict"][key], value, rtol=1e-5, atol=1e-6)
    for key, value in single["capture_stats"].items():
        assert dist["capture_stats"][key] == pytest.approx(value, rel=1e-5)
    rows = single["uneven_rows"]
    dense = np.asarray(single["capture_predict"]["seq/dense:output"])[:rows]  # same weights
    assert dist["uneven_stats"]["seq/dense:output/mean"] == pytest.approx(dense.mean(),
                                                                          rel=1e-5)
    for key, value in single["uneven_stats"].items():
        np.testing.assert_allclose(dist["uneven_stats"][key], value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dist["uneven_edges"], single["uneven_edges"], rtol=1e-6)
    assert sum(dist["uneven_stats"]["seq/dense:output/hist"]) == rows
    if "lone_stats" in single:  # TF: each replica's step packs the same layout
        lone = dense[:1]
        assert dist["lone_stats"]["seq/dense:output/mean"] == pytest.approx(lone.mean(), rel=1e-5)
        assert dist["lone_stats"]["seq/dense:output/std"] == pytest.approx(lone.std(), rel=1e-4)
        for key, value in single["lone_stats"].items():
            assert dist["lone_stats"][key] == pytest.approx(value, rel=1e-5)


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution is JAX's engine")
def test_jax_data_parallel_on_four_cpu_devices_matches_one_device():
    results = _run_worker("jax")
    assert results["devices"] == 4
    _assert_same_as_single_device(results)
    _assert_hidden_state_as_on_one_device(results)
    # The first dynamic value given while fit runs: on one device it is made
    # there; under the distribution it is refused (fit's compiled step fixed its
    # output shardings), and fit stops with its weights, not without any.
    single, dist = results["single_first_in_fit"], results["distributed_first_in_fit"]
    assert single["error"] is None
    assert dist["error"].startswith("callscope needs a variable for the first value of "
                                    "`temperature` of `seq`, and under a JAX "
                                    "keras.distribution")
    assert dist["error"].endswith("Received: running_calls=1")
    assert dist["trained"] and dist["finite"]
    np.testing.assert_allclose(np.asarray(dist["predict"]).shape, (16, 1))
    # The same for a callscope model inside another: the outer model's functions
    # are made again (they failed on their output shardings), and a first value
    # given while the outer model's fit runs is refused.
    nested = results["distributed_nested"]
    assert nested["during_fit"].endswith("Received: running_calls=1")
    np.testing.assert_allclose(nested["inner_warm"],
                               np.asarray(nested["outer_after_fit"]) * 0.5, rtol=1e-5)
    np.testing.assert_allclose(nested["outer_after"], nested["outer_after_fit"], rtol=1e-5)
    assert np.isfinite(nested["outer_after_second_fit"]).all()
    for key, value in results["single"]["capture_fit"].items():
        np.testing.assert_allclose(results["distributed"]["capture_fit"][key], value,
                                   rtol=1e-4, atol=1e-6)


def _assert_hidden_state_as_on_one_device(results):
    single, dist = results["single_hidden"], results["distributed_hidden"]
    expected = np.asarray(single["plain"])
    for key in ("plain", "plain_after", "plain_after_patch"):
        if key in dist:
            np.testing.assert_allclose(dist[key], expected, rtol=1e-5)
    np.testing.assert_allclose(dist["warm"], expected * 2.0, rtol=1e-5)
    assert dist["evaluate_after"] == pytest.approx(single["evaluate_after"], rel=1e-5)
    # The value itself, one row per batch (two batches), as on one device: under
    # two TF replicas it was one row per replica.
    assert single["scale_inputs"]["seq/scale:input/temperature"] == [3.0, 3.0]
    _assert_all_close(dist["scale_inputs"], single["scale_inputs"])
    if "batch_patched" in single:
        np.testing.assert_allclose(dist["batch_patched"], single["batch_patched"], rtol=1e-5)


def _close(actual, desired, rtol=1e-5):
    np.testing.assert_allclose(np.asarray(actual, dtype=float), np.asarray(desired, dtype=float),
                               rtol=rtol, atol=1e-6)


def _assert_all_close(actual, desired, rtol=1e-5):
    assert actual.keys() == desired.keys()
    for key, value in desired.items():
        _close(actual[key], value, rtol)


def _assert_train_test_same_as_single_device(single, dist, val_loss=None):
    # evaluate, 9 rows in batches of 4: full records in global batch order. The
    # last batch has one row, so the second replica gets none.
    full, ref = dist["evaluate_full"], single["evaluate_full"]
    assert np.shape(full["seq/dense:input"]) == (9, 2)
    _close(full["seq/dense:input"], X[:9])
    _close(full["seq/dense:output"], ref["seq/dense:output"])
    # d loss / d output: Keras scales each replica's loss by 1/replicas, so an even
    # split gives the single-device gradient; in the one-row batch the replica with
    # the row differentiates half the loss of its one row: half the gradient.
    _close(full["seq/dense:grad"][:8], ref["seq/dense:grad"][:8])
    _close(full["seq/dense:grad"][8:], np.asarray(ref["seq/dense:grad"][8:]) / 2)
    # 11 rows in batches of 4: the last batch of 3 splits 2 + 1. Each replica's
    # rows get 3 / (2 * its rows) times the one-device gradient.
    grad = np.asarray(single["evaluate_split"]["seq/dense:grad"])
    _close(dist["evaluate_split"]["seq/dense:grad"],
           np.concatenate([grad[:8], grad[8:10] * 3 / 4, grad[10:] * 3 / 2]))
    # Statistics: exact merges of the replicas' partials; the empty replica's
    # partials are no data, and the NaN in the one-row batch is counted once.
    stats = dist["evaluate_stats"]
    _assert_all_close(stats, single["evaluate_stats"])
    dense = np.asarray(ref["seq/dense:output"][:8], dtype=np.float64)
    for stat, value in (("mean", dense.mean()), ("std", dense.std()), ("min", dense.min()),
                        ("max", dense.max()), ("nan_count", 1.0)):
        assert stats[f"seq/dense:output/{stat}"] == pytest.approx(value, rel=1e-5)
    assert sum(stats["seq/dense:output/hist"]) == 8
    assert stats["seq/dense:grad/nan_count"] == 1.0
    # A patch (every replica runs it) and a capture after it.
    assert dist["evaluate_patched"] == pytest.approx(single["evaluate_patched"], rel=1e-5)
    _assert_all_close(dist["patched"], single["patched"])
    # Patches that take the batch need one replica.
    assert single["batch_patch_error"] is None
    assert "replicas=2" in dist["batch_patch_error"]
    # *_on_batch: every replica runs the whole batch; the records are one replica's,
    # and the gradient is the step's (each replica's times the replicas).
    assert np.shape(dist["train_on_batch"]["seq/dense:output"]) == (12, 1)
    _assert_all_close(dist["train_on_batch"], single["train_on_batch"])
    _assert_all_close(dist["test_on_batch"], single["test_on_batch"])
    # fit: full records (even splits: gradients too).
    assert np.shape(dist["fit_full"]["seq/dense:grad"]) == (16, 1)
    _assert_all_close(dist["fit_full"], single["fit_full"], rtol=1e-4)
    # Statistics are one row per global step; validation and a callback's predict
    # are calls of their own, nested (validation's last batch has an empty replica).
    methods = [(m, nested) for m, nested, _ in dist["fit_calls"]]
    assert methods == [("fit", False), ("evaluate", True), ("predict", True),
                       ("evaluate", True), ("predict", True)]
    assert np.shape(dist["fit_calls"][0][2]["seq/dense:output/hist"]) == (4, 4)
    assert methods == [(m, nested) for m, nested, _ in single["fit_calls"]]
    for (_, _, got), (_, _, want) in zip(dist["fit_calls"], single["fit_calls"]):
        _assert_all_close(got, want, rtol=1e-4)
    _close(dist["fit_val_loss"], single["fit_val_loss"] if val_loss is None else val_loss,
           rtol=1e-4)
    _close(dist["fit_patched"], single["fit_patched"], rtol=1e-4)
    for a, b in zip(dist["weights"], single["weights"]):
        _close(a, b, rtol=1e-4)
    # 9 rows in batches of 4: the last step's second replica has no rows.
    assert np.shape(dist["fit_stats"]["seq/dense:output/mean"]) == (3,)
    _assert_all_close(dist["fit_stats"], single["fit_stats"], rtol=1e-4)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.distribute is TensorFlow's engine")
def test_tf_mirrored_strategy_matches_one_device():
    results = _run_worker("tensorflow")
    assert results["devices"] == 2
    _assert_same_as_single_device(results)
    _assert_hidden_state_as_on_one_device(results)
    # A layer's 0-d argument that each replica computed from its own rows: no value
    # is the batch's (the means of the two batches on one device), so it raises.
    single = results["single_replica_arguments"]["net/center:input/mean"]
    np.testing.assert_allclose(single, [X[:8].mean(), X[8:].mean()], rtol=1e-5)
    assert results["replica_arguments"].startswith(
        "`net/center:input/mean`: the replicas of tf.distribute passed different 0-d "
        "values for this layer argument")
    for key, value in results["single"]["capture_fit"].items():
        _close(results["distributed"]["capture_fit"][key], value, rtol=1e-4)
    # Each replica function is traced in its own thread; each saw the value.
    assert len(results["threads_with_value"]) >= 2, results["threads_with_value"]
    _assert_train_test_same_as_single_device(results["single_train_test"],
                                             results["distributed_train_test"])
    # The same run eagerly (run_eagerly=True): replica threads, no deadlock.
    eager = {"single": results["single"], "distributed": results["eager_distributed"]}
    _assert_same_as_single_device(eager)
    for key, value in results["single"]["capture_fit"].items():
        _close(results["eager_distributed"]["capture_fit"][key], value, rtol=1e-4)
    assert len(results["eager_threads_with_value"]) >= 2, results["eager_threads_with_value"]
    # The turn passed to another thread's call in a callback, and back: the
    # fit's sync-on-read metrics parked and restored, per replica.
    for how, got in results["handover"].items():
        _close(got["loss"], got["plain"], rtol=1e-5)
        assert got["predicts"] == 4 and got["predict_min"] > 99, (how, got)
    # Replicas meeting in a synchronized BatchNormalization of an inner model.
    ours, stock = results["synchronized_bn"]["callscope"], results["synchronized_bn"]["stock"]
    _close(ours["loss"], stock["loss"], rtol=1e-5)
    _close(ours["run"], stock["run"], rtol=1e-5)
    # Keras's own eager validation gives NaN where a replica's batch is empty (stock
    # Keras run the same way does too); everything callscope captured matches.
    assert np.isnan(results["stock_eager_val_loss"]).all(), results["stock_eager_val_loss"]
    _assert_train_test_same_as_single_device(results["single_train_test"],
                                             results["eager_distributed_train_test"],
                                             val_loss=results["stock_eager_val_loss"])
    # A capture around the first fit of an unbuilt model: built in the strategy's
    # scope, it trains and captures as on one device (a bare AssertionError before).
    unbuilt = results["unbuilt"]
    # The same where `cs.points` and `cs.summary` built it first.
    for how in ("distributed", "discovered"):
        _close(unbuilt[how]["loss"], unbuilt["single"]["loss"])
        for a, b in zip(unbuilt[how]["weights"], unbuilt["single"]["weights"], strict=True):
            _close(a, b)
        for part in ("capture", "stats"):
            assert unbuilt["single"][part], part
            _assert_all_close(unbuilt[how][part], unbuilt["single"][part])
    assert results["central_storage_error"].endswith(
        "Received: strategy=CentralStorageStrategy"), results.get("central_storage_error")


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.distribute is TensorFlow's engine")
@pytest.mark.parametrize("run_eagerly", [False, True])
def test_tf_mirrored_strategy_of_one_replica_takes_values_and_scopes(run_eagerly):
    # A plain `MirroredStrategy()` on a one-GPU (or CPU) machine runs its one replica
    # in a thread of its own: every value was dropped without a word, a capture or
    # patch said its point was never reached, and `run_eagerly=True` deadlocked.
    import keras
    import tensorflow as tf

    import callscope as cs

    @cs.context_args("debugging", "temp")
    class Probe(keras.layers.Layer):
        def call(self, x, debugging=None, temp=None):
            x = x if temp is None else x * temp
            return x + 100.0 if debugging else x

    x = np.arange(16, dtype="float32").reshape(8, 2) / 10
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    assert strategy.num_replicas_in_sync == 1
    with strategy.scope():
        model = cs.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="d"),
                               Probe(name="p")], name="seq")
        model.register_context_args("debugging")
        model.register_context_args("temp", dynamic=True)
        model.compile(optimizer="sgd", loss="mse", run_eagerly=run_eagerly)
    kernel, bias = model.get_weights()
    plain = x @ kernel + bias
    np.testing.assert_allclose(model.predict(x, verbose=0, debugging=True), plain + 100,
                               rtol=1e-5)
    np.testing.assert_allclose(model.predict(x, verbose=0, temp=3.0), plain * 3, rtol=1e-5)
    with cs.context(debugging=True):
        loss = model.evaluate(x, plain, verbose=0)
    np.testing.assert_allclose(loss, 100.0**2, rtol=1e-4)
    with cs.capture(model, "seq/d") as cap, cs.patch(model, {"seq/p": lambda v: v * 0}):
        np.testing.assert_array_equal(model.predict(x, batch_size=4, verbose=0), 0 * plain)
    np.testing.assert_allclose(cap["seq/d:output"], plain, rtol=1e-5)
    np.testing.assert_allclose(model.predict(x, verbose=0), plain, rtol=1e-5)  # (the default)
