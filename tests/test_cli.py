"""The `callscope` command, run for real in a subprocess on this backend (what
one bad input gives runs its `main` in this process: `run_here`)."""

import contextlib
import csv
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest
from conftest import BACKEND

import callscope as cs

SCRIPT = Path(sys.executable).with_name("callscope")


def _env(extra=None):
    """This process's environment (PYTHONPATH included, so the script imports the
    callscope these tests import) on this backend, plus `extra`."""
    return {**os.environ, "KERAS_BACKEND": BACKEND, **(extra or {})}


def run(*args, cwd=None, env=None):
    return subprocess.run([str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          env=_env(env), cwd=cwd, timeout=600)


def run_here(*args):
    """The command's `main` in this process (the same code as the script, without
    a new interpreter importing every backend, ~4 s a run): for what one input
    gives, where `run` covers the script itself."""
    from callscope import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main([str(a) for a in args])
        except SystemExit as exit_:  # argparse's usage errors
            code = exit_.code
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


# TensorFlow's C++ runtime logs to stderr when it is imported, which `import callscope`
# does before any of the command's code runs: quiet it to count callscope's own lines.
QUIET_TF = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_ENABLE_ONEDNN_OPTS": "0"}


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
    # A loaded model's points are named from the call tree, as in-process: "seq/hidden"
    # (the same command's main in this process: the script ran above).
    proc = run_here("inspect", path, "--data", tmp_path / "x.npy", "--select", "seq/hidden")
    assert proc.returncode == 0
    assert "seq/hidden (Dense)" in proc.stdout and "seq/hidden:output" in proc.stdout


def test_inspect_out_streams_captures_and_never_overwrites(saved, tmp_path):
    _, path, x = saved
    out = tmp_path / "out"
    args = ("inspect", path, "--data", tmp_path / "x.npy", "--out", out)
    assert run(*args).returncode == 0
    assert (out / "captures" / "index.json").exists() and (out / "histograms.png").exists()
    # The refusal and the overwrite are the same command's main in this process (the
    # script wrote `out` above).
    again = run_here(*args)
    assert again.returncode == 1 and "--overwrite" in again.stderr
    assert run_here(*args, "--overwrite").returncode == 0


def _one_line_error(proc, code, *needles):
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("callscope: error")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_inspect_input_errors_are_one_line_with_exit_1(saved, tmp_path):
    _, path, x = saved
    _one_line_error(run_here("inspect", tmp_path / "nope.keras", "--data",
                             tmp_path / "x.npy"), 1, "no such model file", "nope.keras")
    junk = tmp_path / "junk.keras"
    junk.write_text("not a model")
    _one_line_error(run_here("inspect", junk, "--data", tmp_path / "x.npy"), 1,
                    "junk.keras", "not a loadable Keras model")
    np.save(tmp_path / "wide.npy", np.ones((3, 5), "float32"))
    _one_line_error(run_here("inspect", path, "--data", tmp_path / "wide.npy"), 1,
                    "(5,)", "(4,)", "wide.npy")
    _one_line_error(run_here("inspect", path, "--data", tmp_path / "missing.npy"), 1,
                    "no such data file")


def test_a_failed_inspect_leaves_out_as_it_was(saved, tmp_path):
    # --overwrite empties --out only once the statistics are computed: a bad
    # --select deleted what it held before.
    _, path, _ = saved
    out = tmp_path / "keep"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    args = ("inspect", path, "--data", tmp_path / "x.npy", "--out", out, "--overwrite")
    _one_line_error(run_here(*args, "--select", "seq/nope"), 1, "seq/nope")
    assert os.listdir(out) == ["notes.txt"] and (out / "notes.txt").read_text() == "precious"
    mode = out.stat().st_mode
    assert run_here(*args).returncode == 0
    assert (out / "captures" / "index.json").exists() and not (out / "notes.txt").exists()
    assert out.stat().st_mode == mode  # the directory itself is kept
    # A link to a directory, and the working directory itself, are written in place.
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    args = ("inspect", path, "--data", tmp_path / "x.npy")
    assert run_here(*args, "--out", tmp_path / "link").returncode == 0
    assert (target / "summary.txt").exists() and (tmp_path / "link").is_symlink()
    here = tmp_path / "here"
    here.mkdir()
    cwd = os.getcwd()
    try:
        os.chdir(here)
        assert run_here(*args, "--out", ".").returncode == 0
    finally:
        os.chdir(cwd)
    assert (here / "captures" / "index.json").exists()


def test_inspect_bad_paths_and_files_are_one_line_errors(saved, tmp_path):
    _, path, x = saved
    data = tmp_path / "x.npy"
    _one_line_error(run_here("inspect", path, "--data", data, "--out", data), 1,
                    "is a file")
    _one_line_error(run_here("inspect", path, "--data", data, "--out", data, "--overwrite"),
                    1, "is a file")
    _one_line_error(run_here("inspect", path, "--data", data, "--out", "/proc/nope/out"), 1,
                    "cannot write --out")
    np.savez(tmp_path / "objects.npz", x=np.array([{"a": 1}] * 3, dtype=object))
    _one_line_error(run_here("inspect", path, "--data", tmp_path / "objects.npz"), 1,
                    "objects.npz", "cannot be read")
    garbage = tmp_path / "garbage.keras"
    garbage.write_bytes(bytes(range(256)) * 4)
    _one_line_error(run_here("inspect", garbage, "--data", data), 1,
                    "garbage.keras", "zip archive")
    np.save(tmp_path / "words.npy", np.array([["a", "b", "c", "d"]] * 3))
    proc = run_here("inspect", path, "--data", tmp_path / "words.npy")
    _one_line_error(proc, 1, "words.npy")
    assert "Exception encountered" not in proc.stderr, proc.stderr
    _one_line_error(run_here("demo", "--out", data), 1, "is a file")
    # A model file given as the data was "holds arrays ['metadata.json', ...], but
    # none is named x"; a subclassed model, whose class the command cannot import,
    # "is not a Keras model file".
    _one_line_error(run_here("inspect", path, "--data", path), 1,
                    "is a Keras model file (.keras), not an .npz of arrays")
    registered = keras.saving.register_keras_serializable(package="callscope_cli_test")

    class Subclassed(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    sub = registered(Subclassed)(name="sub")
    sub(x)
    sub.save(tmp_path / "sub.keras")
    del keras.saving.get_custom_objects()["callscope_cli_test>Subclassed"]  # (not importable)
    _one_line_error(run_here("inspect", tmp_path / "sub.keras", "--data", data), 1,
                    "holds a custom object `Subclassed` whose code this command cannot "
                    "import", "inspect it in your own script")
    # A stock model compiled with a custom loss inspects (it is loaded uncompiled).
    stock = keras.Sequential([keras.Input((x.shape[1],)), keras.layers.Dense(2, name="d")],
                             name="stock")

    def my_loss(y, p):
        return keras.ops.mean(y - p)

    stock.compile(optimizer="sgd", loss=registered(my_loss))
    stock.save(tmp_path / "custom_loss.keras")
    del keras.saving.get_custom_objects()["callscope_cli_test>my_loss"]
    proc = run_here("inspect", tmp_path / "custom_loss.keras", "--data", data, "--json")
    assert proc.returncode == 0, proc.stderr
    kernel, bias = stock.get_weights()
    np.testing.assert_allclose(json.loads(proc.stdout)["stock/d:output/mean"],
                               np.mean(np.load(data) @ kernel + bias), rtol=1e-5)
    from callscope import cli

    keras_error = ("Exception encountered when calling Functional.call().\n\n"
                   "\x1b[1mthe cause\x1b[0m\n\nArguments received by Functional.call():")
    assert cli._first_line(keras_error) == "the cause"


def test_inspect_keeps_its_inputs_and_every_digit_and_says_failures_in_one_line(
        saved, tmp_path, monkeypatch):
    # --out . --overwrite where the model and data sat deleted them; the CSV kept 6
    # digits (a count of 1234567 read 1.23457e+06); an error of the model's own (not
    # a ValueError) was a traceback; `--out ""` was ignored; a 0-d array was
    # "empty"; a text file named .npy was "pickled data".
    model, path, x = saved
    work = tmp_path / "work"
    work.mkdir()
    (work / "m.keras").write_bytes(path.read_bytes())
    np.save(work / "x.npy", x)
    for given in ("m.keras", "x.npy"):
        other = tmp_path / ("x.npy" if given == "m.keras" else "model.keras")
        args = (work / "m.keras", "--data", tmp_path / "x.npy") if given == "m.keras" \
            else (path, "--data", work / "x.npy")
        _one_line_error(run_here("inspect", *args, "--out", work, "--overwrite"), 1,
                        "holds", given, "would delete")
        assert sorted(os.listdir(work)) == ["m.keras", "x.npy"] and other.exists()
    _one_line_error(run_here("inspect", path, "--data", tmp_path / "x.npy", "--out", ""), 1,
                    "empty path")
    np.save(tmp_path / "scalar.npy", np.float32(3.0))
    _one_line_error(run_here("inspect", path, "--data", tmp_path / "scalar.npy"), 1,
                    "single value", "0-d")
    (tmp_path / "text.npy").write_text("1,2,3,4\n")
    _one_line_error(run_here("inspect", path, "--data", tmp_path / "text.npy"), 1,
                    "text.npy", "does not start as one")
    ids = cs.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(5, 2)])
    ids.save(tmp_path / "ids.keras")
    np.save(tmp_path / "ids.npy", np.array([[1, 7, 2]], "int32"))  # 7: out of range
    proc = run_here("inspect", tmp_path / "ids.keras", "--data", tmp_path / "ids.npy")
    if BACKEND == "jax":  # JAX's gather fills NaN instead (stock JAX): no error to give
        assert proc.returncode == 0, proc.stderr[-2000:]
    else:
        _one_line_error(proc, 1, "the model failed on", "ids.npy")
    out = tmp_path / "out"
    proc = run_here("inspect", path, "--data", tmp_path / "x.npy", "--out", out, "--json",
                    "--reduce", "mean,std,min,hist")
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = json.loads(proc.stdout)
    with (out / "statistics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {r["key"] for r in rows} == set(printed)
    for row in rows:
        if row["key"].endswith("/hist"):
            assert row["value"].split() == [str(int(c)) for c in printed[row["key"]]]
        else:  # every digit: reads back as the same float64
            assert float(row["value"]) == printed[row["key"]], row
    from callscope import report

    with pytest.raises(ValueError, match=r"Nothing to plot: no key .* is `<point>:grad/rms`"):
        report.plot_grad_norms({"m/a:output/mean": np.zeros(3)}, tmp_path / "g.png")
    # Without matplotlib (an install without the plot extra), --out says so before
    # any work, where the model was blamed after --out was half written.
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    _one_line_error(run_here("inspect", path, "--data", tmp_path / "x.npy", "--out",
                             tmp_path / "plots"), 1, "matplotlib", "callscope[plot]")
    assert not (tmp_path / "plots").exists()


def test_inspect_json_is_strict_with_null_for_no_finite_value(saved, tmp_path):
    _, path, x = saved
    np.save(tmp_path / "inf.npy", np.full((8, 4), np.inf, "float32"))
    proc = run_here("inspect", path, "--data", tmp_path / "inf.npy", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    stats = json.loads(proc.stdout, parse_constant=refuse)
    # (`out` is NaN or ±inf everywhere: the relu before it gives inf and NaN, or
    # inf and 0 on TF, whose relu maps NaN to 0.)
    assert stats["seq/out:output/mean"] is None
    assert stats["seq/out:output/frac_zero"] is None


def usage(*args):
    return run(*args, env=QUIET_TF)


# TensorFlow's C++ logging (absl) prints at import, before any callscope code runs,
# and TF_CPP_MIN_LOG_LEVEL does not silence all of it (the full `tensorflow` build's
# CUDA probe): those lines are TensorFlow's, not callscope's.
TF_LOG = re.compile(r"^([IWEF]\d{4} \d\d:\d\d:\d\d|WARNING: All log messages before absl)")


def _usage_error(proc, *needles):
    """Exit code 2 and exactly one line of callscope's on stderr (no usage block, no
    traceback)."""
    lines = [line for line in proc.stderr.splitlines() if not TF_LOG.match(line)]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert len(lines) == 1 and lines[0].strip() and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("callscope: error: ") and lines[0].endswith("--help)"), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_usage_errors_are_one_line_with_exit_2(saved, tmp_path):
    _, path, _ = saved
    data = tmp_path / "x.npy"
    # The script itself, twice (each run imports every backend); the rest in-process.
    _usage_error(usage("inspect", path, "--data", data, "--reduce", "median"), "--reduce",
                 "'median'")
    line = _usage_error(run_here("frobnicate"), "(see callscope --help)")
    assert line.startswith("callscope: error: argument command: invalid choice: 'frobnicate'")
    assert _usage_error(run_here("inspect", path)) == (
        "callscope: error: the following arguments are required: --data "
        "(see callscope inspect --help)")
    _usage_error(run_here("inspect", path, "--data", data, "--batch-size", "many"),
                 "--batch-size", "expected a positive integer, got 'many'")
    _usage_error(run_here("inspect", path, "--data", data, "--kinds", "grad"), "--kinds")
    _usage_error(run_here(), "required: command")
    helped = usage("inspect", "--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: callscope inspect")
    assert "--data" in helped.stdout
    assert not [line for line in helped.stderr.splitlines() if not TF_LOG.match(line)]


def test_the_script_runs_this_checkout():
    # The script's interpreter, in the environment `run` gives it, imports the
    # callscope these tests import (not another checkout's editable install).
    python = SCRIPT.read_text().splitlines()[0].removeprefix("#!")
    proc = subprocess.run([python, "-c", "import callscope; print(callscope.__file__)"],
                          capture_output=True, text=True, timeout=600, env=_env())
    assert Path(proc.stdout.strip()).resolve() == Path(cs.__file__).resolve()


def test_python_dash_m_runs_the_command():
    # `python -m callscope` is the same command as the script: its prog, its exit codes.
    def module(*args):
        return subprocess.run([sys.executable, "-m", "callscope", *args], capture_output=True,
                              text=True, timeout=600, env=_env())

    helped = module("inspect", "--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: callscope inspect")
    _usage_error(module(), "required: command")


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


# --------------------------------------------------------------------------
# Models with several inputs, RNNs, quantized models
# --------------------------------------------------------------------------
STATS = ("mean", "std", "min", "max", "frac_zero")


def _in_process(path, data, batch_size, **load):
    """What an in-process capture of the saved model gives on the same data."""
    loaded = cs.enable(keras.saving.load_model(path, **load))
    with cs.capture(loaded, "*", reduce=STATS) as cap:
        loaded.predict(data, batch_size=batch_size, verbose=0)
    return {key: float(cap[key]) for key in cap}


def _assert_same_as_in_process(cli, in_process):
    assert sorted(cli) == sorted(in_process)
    for key, value in in_process.items():
        assert cli[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.fixture(params=["list", "dict"])
def two_inputs(request, tmp_path):
    """`two`: inputs `left` (3 features) and `right` (2), as a list or a dict of inputs."""
    left, right = keras.Input((3,), name="left"), keras.Input((2,), name="right")
    hidden = keras.layers.Dense(4, activation="relu", name="hidden")(
        keras.layers.Concatenate(name="cat")([left, right]))
    inputs = [left, right] if request.param == "list" else {"left": left, "right": right}
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(hidden), name="two")
    path = tmp_path / "two.keras"
    model.save(path)
    rng = np.random.default_rng(1)
    arrays = {"left": rng.normal(size=(40, 3)).astype("float32"),
              "right": rng.normal(size=(40, 2)).astype("float32")}
    np.savez(tmp_path / "data.npz", right=arrays["right"], left=arrays["left"])  # any order
    data = [arrays["left"], arrays["right"]] if request.param == "list" else arrays
    return model, path, arrays, data


def test_inspect_takes_one_array_per_input_from_npz(two_inputs, tmp_path):
    model, path, arrays, data = two_inputs
    proc = run("inspect", path, "--data", tmp_path / "data.npz", "--json",
               "--batch-size", 16)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = json.loads(proc.stdout)
    kernel, bias = model.get_layer("hidden").get_weights()
    joined = np.concatenate([arrays["left"], arrays["right"]], axis=1)
    hidden = np.maximum(joined @ kernel + bias, 0)
    assert stats["two/hidden:output/mean"] == pytest.approx(hidden.mean(), rel=1e-5)
    assert stats["two/hidden:output/std"] == pytest.approx(hidden.std(), rel=1e-4)
    assert stats["two/hidden:output/max"] == pytest.approx(hidden.max(), rel=1e-5)
    assert stats["two/hidden:output/frac_zero"] == pytest.approx((hidden == 0).mean())
    assert stats["two/cat:output/mean"] == pytest.approx(joined.mean(), rel=1e-5)
    _assert_same_as_in_process(stats, _in_process(path, data, 16))
    assert {key.partition(":")[0] for key in stats} == {"two", "two/cat", "two/hidden",
                                                         "two/out"}


def test_inspect_data_errors_name_the_inputs(two_inputs, tmp_path):
    _, path, arrays, _ = two_inputs
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, a=arrays["left"], b=arrays["right"])
    _one_line_error(run_here("inspect", path, "--data", wrong), 1)
    assert run_here("inspect", path, "--data", wrong).stderr.strip().splitlines()[-1] == (
        f"callscope: error: {wrong} holds arrays ['a', 'b'], but the model takes inputs "
        "['left', 'right']: save one array per input, named after it "
        "(np.savez(path, left=..., right=...))")
    one = tmp_path / "one.npy"
    np.save(one, arrays["left"])
    _one_line_error(run_here("inspect", path, "--data", one), 1,
                    f"{one} holds one array, but the model takes inputs ['left', 'right']")
    short = tmp_path / "short.npz"
    np.savez(short, left=arrays["left"], right=arrays["right"][:7])
    _one_line_error(run_here("inspect", path, "--data", short), 1,
                    f"the arrays in {short} have different numbers of rows (left has 40, "
                    "right has 7); every input needs one row per example")
    wide = tmp_path / "wide.npz"
    np.savez(wide, left=arrays["left"], right=np.ones((40, 5), "float32"))
    _one_line_error(run_here("inspect", path, "--data", wide), 1,
                    f"array 'right' in {wide} has examples of shape (5,), but the model's "
                    "input 'right' takes (2,) (shape of the whole array: (40, 5)); reshape "
                    "it to (N, 2)")


def test_inspect_one_input_from_npz(saved, tmp_path):
    _, path, x = saved
    name = keras.saving.load_model(path).inputs[0].name  # the file's name for the input
    expected = json.loads(run_here("inspect", path, "--data", tmp_path / "x.npy",
                                   "--json").stdout)
    for arrays in ({name: x, "labels": np.zeros(40)}, {"x": x, "labels": np.zeros(40)},
                   {"anything": x}):
        np.savez(tmp_path / "one.npz", **arrays)
        proc = run_here("inspect", path, "--data", tmp_path / "one.npz", "--json")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads(proc.stdout) == pytest.approx(expected)
    np.savez(tmp_path / "two.npz", a=x, b=x)
    _one_line_error(run_here("inspect", path, "--data", tmp_path / "two.npz"), 1,
                    f"{tmp_path / 'two.npz'} holds arrays ['a', 'b'], but none is named x or "
                    f"{name}")


def _rnn():
    return keras.Sequential([keras.Input((6,), dtype="int32"),
                             keras.layers.Embedding(20, 4, name="embed"),
                             keras.layers.LSTM(5, return_sequences=True, name="lstm"),
                             keras.layers.SimpleRNN(3, name="rnn"),
                             keras.layers.Dense(2, name="out")], name="seq")


def _quantized():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, name="hidden"),
                              keras.layers.Dense(2, name="out")], name="seq")
    with warnings.catch_warnings():  # Keras warns that the InputLayer cannot quantize
        warnings.simplefilter("ignore")
        model.quantize("int8")
    return model


@pytest.mark.parametrize("build, points", [
    (_rnn, {"seq", "seq/embed", "seq/lstm", "seq/rnn", "seq/out"}),
    (_quantized, {"seq", "seq/hidden", "seq/out"}),
], ids=["rnn", "quantized"])
def test_inspect_rnn_and_quantized_models(build, points, tmp_path):
    model = build()
    path = tmp_path / "model.keras"
    model.save(path)
    rng = np.random.default_rng(2)
    if model.inputs[0].dtype == "int32":
        data = rng.integers(0, 20, size=(24, 6)).astype("int32")
    else:
        data = rng.normal(size=(24, 4)).astype("float32")
    np.save(tmp_path / "data.npy", data)
    proc = run("inspect", path, "--data", tmp_path / "data.npy", "--json", "--batch-size", 10)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    stats = json.loads(proc.stdout)
    # The cells inside the RNNs' loops are not points: only the layers the model calls.
    assert {key.partition(":")[0] for key in stats} == points
    _assert_same_as_in_process(stats, _in_process(path, data, 10))
    expected = model.predict(data, verbose=0)
    assert stats["seq/out:output/mean"] == pytest.approx(expected.mean(), rel=1e-4, abs=1e-6)


MODELS_PY = '''
import keras

@keras.saving.register_keras_serializable(package="cli_import_test")
class Scale(keras.layers.Layer):
    def __init__(self, factor, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * self.factor

    def get_config(self):
        return {**super().get_config(), "factor": self.factor}

@keras.saving.register_keras_serializable(package="cli_import_test")
class Net(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3, name="dense")
        self.scale = Scale(2.5, name="scale")

    def call(self, x):
        return self.scale(self.dense(x))
'''


def test_import_registers_the_custom_objects_a_file_needs(saved, tmp_path, monkeypatch):
    """`--import` runs the module that defines a subclassed model and its custom
    layer, by module name from the current directory or as a .py path, and the
    statistics are those of the model in-process; bad imports are one-line errors."""
    _, _, x = saved
    (tmp_path / "cli_models.py").write_text(MODELS_PY)
    monkeypatch.setattr(sys, "path", list(sys.path))  # (what --import adds, undone)
    for name in ("cli_models", "helpers", "uses_helpers", "needs", "train", "broken",
                 "uses_sibling", "tabnanny"):
        if name not in sys.modules:  # (the modules it runs: gone after the test)
            monkeypatch.setitem(sys.modules, name, None)
            monkeypatch.delitem(sys.modules, name)
    registry = keras.saving.get_custom_objects()
    for key in ("cli_import_test>Net", "cli_import_test>Scale"):
        monkeypatch.setitem(registry, key, None)
        monkeypatch.delitem(registry, key)
    spec = importlib.util.spec_from_file_location("cli_models", tmp_path / "cli_models.py")
    cli_models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli_models)  # (not on the path: --import must put it there)

    keras.utils.set_random_seed(1)
    net = cli_models.Net(name="net")
    called = net(x)  # (builds it)
    net.save(tmp_path / "net.keras")
    kernel, bias = net.dense.get_weights()
    dense = x @ kernel + bias
    np.testing.assert_allclose(keras.ops.convert_to_numpy(called), dense * 2.5,
                               rtol=1e-5, atol=1e-6)

    def forget():  # (what a fresh process has: the file's code not imported)
        for key in ("cli_import_test>Net", "cli_import_test>Scale"):
            keras.saving.get_custom_objects().pop(key, None)
        sys.modules.pop("cli_models", None)

    forget()
    data = tmp_path / "x.npy"
    _one_line_error(run_here("inspect", tmp_path / "net.keras", "--data", data), 1,
                    "custom object", "--import MODULE")
    monkeypatch.chdir(tmp_path)
    for given in ("cli_models", str(tmp_path / "cli_models.py")):
        forget()
        proc = run_here("inspect", tmp_path / "net.keras", "--data", data, "--json",
                        "--import", given)
        assert proc.returncode == 0, proc.stderr
        stats = json.loads(proc.stdout)
        assert stats["net/dense:output/mean"] == pytest.approx(dense.mean(), rel=1e-5)
        assert stats["net/scale:output/std"] == pytest.approx((dense * 2.5).std(), rel=1e-4)
    _one_line_error(run_here("inspect", tmp_path / "net.keras", "--data", data,
                             "--import", "no_such_module_here"), 1,
                    "--import no_such_module_here", "No module named", "a .py file")
    _one_line_error(run_here("inspect", tmp_path / "net.keras", "--data", data,
                             "--import", "missing.py"), 1,
                    "--import missing.py: no such file")
    # The file's own imports: from its folder, and its own failures are its own.
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "helpers.py").write_text(MODELS_PY)
    (tmp_path / "lib" / "uses_helpers.py").write_text("from helpers import Net  # noqa\n")
    forget()
    proc = run_here("inspect", tmp_path / "net.keras", "--data", data, "--json",
                    "--import", str(tmp_path / "lib" / "uses_helpers.py"))
    assert proc.returncode == 0, proc.stderr
    # An `--out` that holds the code `--import` ran, or what that code imported, is
    # refused as one that holds the model: --overwrite deleted the user's code.
    forget()
    sys.modules.pop("uses_helpers", None)
    sys.modules.pop("helpers", None)
    _one_line_error(run_here("inspect", tmp_path / "net.keras", "--data", data,
                             "--import", str(tmp_path / "lib" / "uses_helpers.py"),
                             "--out", tmp_path / "lib", "--overwrite"), 1,
                    f"--out {tmp_path / 'lib'} holds ", "which --overwrite would delete")
    assert {"helpers.py", "uses_helpers.py"} <= set(os.listdir(tmp_path / "lib"))
    (tmp_path / "lib" / "needs.py").write_text("import not_installed_anywhere\n")
    _one_line_error(run_here("inspect", tmp_path / "net.keras", "--data", data,
                             "--import", str(tmp_path / "lib" / "needs.py")), 1,
                    "needs.py raised ModuleNotFoundError: No module named "
                    "'not_installed_anywhere'")
    for exits in ("import sys; sys.exit(0)", "import argparse\n"
                  "argparse.ArgumentParser().add_argument('--epochs', required=True)\n"
                  "argparse.ArgumentParser(prog='train').parse_args(['--nope'])"):
        (tmp_path / "train.py").write_text(exits + "\n")
        _one_line_error(run_here("inspect", tmp_path / "net.keras", "--data", data,
                                 "--import", "train.py"), 1,
                        "--import train.py exited (SystemExit: ", "__main__")
    # The file's folder comes first, as for `python file.py`: a sibling named like
    # a module not imported yet (tabnanny, of the standard library) is the sibling.
    if "tabnanny" not in sys.modules:
        (tmp_path / "lib" / "tabnanny.py").write_text("HELPER = 'the sibling'\n")
        (tmp_path / "lib" / "uses_sibling.py").write_text(
            "import tabnanny\nassert tabnanny.HELPER == 'the sibling'\n" + MODELS_PY)
        forget()
        proc = run_here("inspect", tmp_path / "net.keras", "--data", data, "--json",
                        "--import", str(tmp_path / "lib" / "uses_sibling.py"))
        assert proc.returncode == 0, proc.stderr
    # Imported, yet registering nothing under the saved name.
    (tmp_path / "empty.py").write_text("")
    forget()
    _one_line_error(run_here("inspect", tmp_path / "net.keras", "--data", data,
                             "--import", "empty.py"), 1,
                    "that the modules given to --import (empty.py) did not register")
    (tmp_path / "json.py").write_text("raise AssertionError('ran')\n")
    _one_line_error(run_here("inspect", tmp_path / "net.keras", "--data", data,
                             "--import", "json.py"), 1,
                    "a module named json is already imported", "rename the file")
    (tmp_path / "broken.py").write_text("raise ZeroDivisionError('bad module')\n")
    _one_line_error(run_here("inspect", tmp_path / "net.keras", "--data", data,
                             "--import", "broken.py"), 1,
                    "--import broken.py raised ZeroDivisionError: bad module")
    # The script itself (a new interpreter, whose sys.path lacks the current directory).
    forget()
    proc = run("inspect", tmp_path / "net.keras", "--data", data, "--json", "--import",
               "cli_models", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["net/dense:output/mean"] == pytest.approx(dense.mean(),
                                                                            rel=1e-5)
