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


def _run_worker(engine):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND")}
    proc = subprocess.run([sys.executable, str(WORKER), engine], capture_output=True,
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


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution is JAX's engine")
def test_jax_data_parallel_on_four_cpu_devices_matches_one_device():
    results = _run_worker("jax")
    assert results["devices"] == 4
    _assert_same_as_single_device(results)
    for key, value in results["single"]["capture_fit"].items():
        np.testing.assert_allclose(results["distributed"]["capture_fit"][key], value,
                                   rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.distribute is TensorFlow's engine")
def test_tf_mirrored_strategy_value_reaches_every_replica():
    results = _run_worker("tensorflow")
    assert results["devices"] == 2
    _assert_same_as_single_device(results)
    # Train/test capture would be averaged across replicas by Keras: refused.
    assert "num_replicas_in_sync=2" in results["distributed"]["capture_fit_error"]
    assert "capture_fit" in results["single"]
    # Each replica function is traced in its own thread; each saw the value.
    assert len(results["threads_with_value"]) >= 2, results["threads_with_value"]
