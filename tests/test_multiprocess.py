"""Two JAX processes run one sharded model; what they capture equals one process.

The test launches both processes itself (`multiprocess_worker.py`: a local
coordinator, CPU collectives, 2 processes x 4 devices, weights sharded over a
`model` axis and the batch over `batch`). Each process streams the shards it holds
into one capture directory; reading it here, in one process, must give the arrays
of a single-device run of the same weights on the same global batches.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
from conftest import BACKEND

import callscope as cs

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="jax.distributed is JAX's")
WORKER = Path(__file__).with_name("multiprocess_worker.py")


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    out = tmp_path_factory.mktemp("multiprocess")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND")}
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), port, str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    try:
        logs = [p.communicate(timeout=110)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    seen = []
    for i in range(2):
        with open(out / f"seen.p{i}.json") as f:
            seen.append(json.load(f))
    return out, seen


@pytest.fixture(scope="module")
def one_process(two_processes):
    """The same weights and global batches on one device."""
    from multiprocess_model import DATA, build, global_order

    out, _ = two_processes
    model = build()
    with np.load(out / "weights.npz") as f:
        model.set_weights([f[f"arr_{i}"] for i in range(len(f.files))])
    x = global_order([d[0] for d in DATA])
    y = global_order([d[1] for d in DATA])
    ref = {}
    with cs.capture(model, ["*/up", "*/block"]) as cap:
        ref["predict"] = model.predict(x, batch_size=8, verbose=0)
    ref["capture_predict"] = dict(cap.items())
    ref["predict_debugging"] = model.predict(x, batch_size=8, debugging=True, verbose=0)
    with cs.capture(model, ["*/up", "*/block"], reduce=("mean", "std", "min", "max", "hist"),
                    bins=8) as stats:
        model.predict(x, batch_size=8, verbose=0)
    ref["stats"] = dict(stats.items())
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with cs.capture(model, "*/block", kinds=("output", "grad")) as cap:
        ref["loss"] = model.fit(x, y, batch_size=8, epochs=1, shuffle=False,
                                verbose=0).history["loss"]
    ref["capture_fit"] = dict(cap.items())
    ref["weights"] = model.get_weights()
    return ref


def test_two_processes_ran_one_sharded_model(two_processes):
    _, seen = two_processes
    assert [s["processes"] for s in seen] == [2, 2]
    assert [s["devices"] for s in seen] == [8, 8]
    assert [s["sharded_kernels"] for s in seen] == [2, 2]  # up and down, over `model`


def test_predict_gives_the_global_batch_on_every_process(two_processes, one_process):
    # Stock Keras 3.15.1 cannot concatenate arrays that span processes; through
    # callscope every process gets the global outputs, in order.
    _, seen = two_processes
    for s in seen:
        np.testing.assert_allclose(s["predict"], one_process["predict"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(s["predict_debugging"], one_process["predict_debugging"],
                                   rtol=1e-5, atol=1e-6)
    assert not np.allclose(seen[0]["predict_debugging"], seen[0]["predict"])


def test_streamed_shards_read_back_as_one_process_arrays(two_processes, one_process):
    out, _ = two_processes
    assert sorted(os.listdir(out / "predict")) == ["call_000", "index.json",  # one index
                                                   "owner.json"]
    files = sorted(os.listdir(out / "predict" / "call_000"))
    assert files == ["0000.p0.bin", "0000.p1.bin", "0001.p0.bin", "0001.p1.bin"], files
    cap = cs.load_capture(out / "predict")
    assert sorted(cap) == sorted(one_process["capture_predict"])
    for key, value in one_process["capture_predict"].items():
        assert cap[key].shape == value.shape == (16, 16 if key.endswith("up:output") else 6)
        np.testing.assert_allclose(cap[key], value, rtol=1e-5, atol=1e-6)
    fit = cs.load_capture(out / "fit")
    assert [c.method for c in fit.calls] == ["fit"]
    for key, value in one_process["capture_fit"].items():
        np.testing.assert_allclose(fit[key], value, rtol=1e-4, atol=1e-7)
    assert np.abs(fit["net/block:grad"]).max() > 0


def test_statistics_agree_across_processes_and_with_one(two_processes, one_process):
    _, seen = two_processes
    assert seen[0]["stats"] == seen[1]["stats"]
    for key, value in one_process["stats"].items():
        np.testing.assert_allclose(seen[0]["stats"][key], value, rtol=1e-5, atol=1e-6)
    assert sum(seen[0]["stats"]["net/block/up:output/hist"]) == 16 * 16


def test_training_matches_one_process(two_processes, one_process):
    _, seen = two_processes
    np.testing.assert_allclose(seen[0]["loss"], one_process["loss"], rtol=1e-5)
    for a, b in zip(seen[0]["weights"], one_process["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)

