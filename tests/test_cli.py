"""The `callscope` command, run for real in a subprocess on this backend."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
from conftest import BACKEND

SCRIPT = Path(sys.executable).with_name("callscope")


def run(*args, cwd=None):
    env = {**os.environ, "KERAS_BACKEND": BACKEND}
    return subprocess.run([str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=600)


@pytest.fixture
def saved(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="relu",
                                                                    name="hidden"),
                              keras.layers.Dense(2, name="out")], name="seq")
    path = tmp_path / "model.keras"
    model.save(path)
    x = np.random.default_rng(0).normal(size=(40, 4)).astype("float32")
    np.save(tmp_path / "x.npy", x)
    return model, path, x


def test_demo_writes_plots_summary_and_csv(tmp_path):
    out = tmp_path / "report"
    proc = run("demo", "--out", out, "--epochs", 1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("activations.png", "histograms.png", "gradients.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
        assert str(out / name) in proc.stdout
    assert "demo_net/block_0 (Block)" in (out / "summary.txt").read_text()
    assert "sow pre_act" in (out / "summary.txt").read_text()
    with (out / "statistics.csv").open() as f:
        rows = list(csv.DictReader(f))
    keys = {r["key"] for r in rows}
    assert "demo_net/block_3:grad/rms" in keys and "demo_net/block_0:output/frac_zero" in keys


def test_inspect_statistics_match_numpy_and_json_parses(saved, tmp_path):
    model, path, x = saved
    hidden = np.maximum(x @ model.get_layer("hidden").get_weights()[0]
                        + model.get_layer("hidden").get_weights()[1], 0)
    proc = run("inspect", path, "--data", tmp_path / "x.npy", "--json", "--batch-size", 16)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = json.loads(proc.stdout)
    assert stats["seq/hidden:output/mean"] == pytest.approx(hidden.mean(), rel=1e-5)
    assert stats["seq/hidden:output/std"] == pytest.approx(hidden.std(), rel=1e-4)
    assert stats["seq/hidden:output/frac_zero"] == pytest.approx((hidden == 0).mean())
    # A loaded model's points are named from the call tree, as in-process: "seq/hidden".
    proc = run("inspect", path, "--data", tmp_path / "x.npy", "--select", "seq/hidden")
    assert proc.returncode == 0
    assert "seq/hidden (Dense)" in proc.stdout and "seq/hidden:output" in proc.stdout


def test_inspect_out_streams_captures_and_never_overwrites(saved, tmp_path):
    _, path, x = saved
    out = tmp_path / "out"
    args = ("inspect", path, "--data", tmp_path / "x.npy", "--out", out)
    assert run(*args).returncode == 0
    assert (out / "captures" / "index.json").exists() and (out / "histograms.png").exists()
    again = run(*args)
    assert again.returncode == 1 and "--overwrite" in again.stderr
    assert run(*args, "--overwrite").returncode == 0


def _one_line_error(proc, code, *needles):
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("callscope: error")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_inspect_input_errors_are_one_line_with_exit_1(saved, tmp_path):
    _, path, x = saved
    _one_line_error(run("inspect", tmp_path / "nope.keras", "--data", tmp_path / "x.npy"), 1,
                    "no such model file", "nope.keras")
    junk = tmp_path / "junk.keras"
    junk.write_text("not a model")
    _one_line_error(run("inspect", junk, "--data", tmp_path / "x.npy"), 1,
                    "junk.keras", "not a loadable Keras model")
    np.save(tmp_path / "wide.npy", np.ones((3, 5), "float32"))
    _one_line_error(run("inspect", path, "--data", tmp_path / "wide.npy"), 1,
                    "(5,)", "(4,)", "wide.npy")
    _one_line_error(run("inspect", path, "--data", tmp_path / "missing.npy"), 1,
                    "no such data file")


def test_usage_errors_exit_2(saved, tmp_path):
    _, path, _ = saved
    proc = run("inspect", path, "--data", tmp_path / "x.npy", "--reduce", "median")
    assert proc.returncode == 2 and "--reduce" in proc.stderr and "Traceback" not in proc.stderr
    assert run("frobnicate").returncode == 2


def test_untrusted_lambda_needs_unsafe(tmp_path):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Lambda(lambda t: t * 2.0)],
                             name="lam")
    path = tmp_path / "lambda.keras"
    model.save(path)
    np.save(tmp_path / "x.npy", np.ones((2, 4), "float32"))
    _one_line_error(run("inspect", path, "--data", tmp_path / "x.npy"), 1, "--unsafe")
    proc = run("inspect", path, "--data", tmp_path / "x.npy", "--unsafe", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["lam/lambda:output/mean"] == pytest.approx(2.0)
