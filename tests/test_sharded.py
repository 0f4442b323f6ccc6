"""ModelParallel on 8 CPU devices gives what one device gives (`sharded_worker.py`).

Weights are sharded over a `model` axis and the batch over `batch` (a 2 x 4 mesh),
for a subclassed model and a keras_hub Gemma backbone built from a tiny config.
Context, full captures, statistics, gradients and patches must match a
single-device run of the same weights.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution is JAX's")
WORKER = Path(__file__).with_name("sharded_worker.py")


@pytest.fixture(scope="module")
def results():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND")}
    proc = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])


def _close(a, b, what, rtol=1e-4, atol=1e-5):
    if isinstance(b, dict):
        assert sorted(a) == sorted(b), what
        for key in b:
            _close(a[key], b[key], f"{what}[{key}]", rtol, atol)
    elif what.endswith("weights"):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{what}[{i}]", rtol, atol)
    else:
        np.testing.assert_allclose(np.asarray(a, "float64"), np.asarray(b, "float64"),
                                   rtol=rtol, atol=atol, err_msg=what)


@pytest.mark.parametrize("name", ["net", "gemma"])
def test_model_parallel_matches_one_device(results, name):
    case = results[name]
    single, sharded = case["single"], case["sharded"]
    assert case["sharded_kernels"] >= 2  # the layout map really split kernels
    for what in ("predict", "capture", "stats", "patched", "loss", "grads", "weights"):
        _close(sharded[what], single[what], f"{name} {what}")
    assert len(single["capture"]) >= 1 and all(
        np.asarray(v).shape[0] == 16 for v in single["capture"].values())
    assert not np.allclose(single["patched"], single["predict"])  # the patch did something
    grads = [np.abs(np.asarray(v)).max() for k, v in single["grads"].items() if k.endswith(":grad")]
    assert grads and min(grads) > 0
    # Captured batches land on the host as the call runs: no device keeps them.
    assert sharded["held_on_device"] == 0 and sharded["on_host"]


def test_context_reaches_sharded_layers(results):
    single, sharded = results["net"]["single"], results["net"]["sharded"]
    _close(sharded["predict_debugging"], single["predict_debugging"], "debugging")
    np.testing.assert_allclose(np.asarray(sharded["predict_debugging"]),
                               np.asarray(single["predict_debugging"]), rtol=1e-4)
    assert not np.allclose(sharded["predict_debugging"], sharded["predict"])


def test_statistics_cover_every_row_once(results):
    stats = results["gemma"]["sharded"]["stats"]
    hist = stats["gemma/decoder_block_0:output/hist"]
    assert sum(hist) == 16 * 12 * 32
    assert stats["gemma/decoder_block_0:output/nan_count"] == 0
