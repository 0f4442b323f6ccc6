"""The `callscope` command: `demo` (the main job) and `inspect` (a model you were given).

    callscope demo [--out DIR] [--epochs N]
    callscope inspect MODEL.keras --data FILE.npy|.npz [--select GLOB] [--reduce mean,std]
                      [--kinds output,input] [--batch-size N] [--out DIR] [--json]
                      [--unsafe] [--overwrite] [--import MODULE ...]

`--data` is a .npy (one input), or an .npz: for a model with several inputs, one
array per input, named after it (`np.savez(path, left=..., right=...)`); for one
input, an array named `x`, named after the input, or the only array.

`--import` runs the code a file's custom objects need (a subclassed model, a
custom layer, registered with `keras.saving.register_keras_serializable`) before
it loads: a module importable from the current directory (`--import mypkg.models`)
or a `.py` file (`--import models.py`); repeat it for several.

Exit codes: 0 success, 1 an input error (a missing or unreadable file, a shape
that does not fit), 2 a usage error. Errors are one line on stderr, never a
traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import zipfile

import numpy as np

DEFAULT_STATS = "mean,std,min,max,frac_zero"


class InputError(Exception):
    """A problem with the user's files or data: exit code 1, one line."""


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors as one line on stderr (exit code 2) instead of a
    usage block followed by the error. Subcommands' parsers are of this class too."""

    def error(self, message):
        message = " ".join(str(message).split())
        self.exit(2, f"callscope: error: {message} (see {self.prog} --help)\n")


def main(argv=None) -> int:
    parser = _Parser(prog="callscope", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="train a small model and report what happens "
                                            "inside it")
    demo.add_argument("--out", default="callscope-report", help="report directory")
    demo.add_argument("--epochs", type=_positive, default=6)

    inspect = commands.add_parser("inspect", help="statistics of every point of a saved model")
    inspect.add_argument("model", help="a .keras file")
    inspect.add_argument("--data", required=True,
                         help="input data: .npy, or .npz with one array per input, named "
                              "after it")
    inspect.add_argument("--select", default="*", help="glob of points (default: all)")
    inspect.add_argument("--reduce", default=DEFAULT_STATS, help="statistics, comma-separated")
    inspect.add_argument("--kinds", default="output", help="output and/or input")
    inspect.add_argument("--batch-size", type=_positive, default=32)
    inspect.add_argument("--out", help="also write full captures, statistics and plots here")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.add_argument("--unsafe", action="store_true",
                         help="allow code inside the file (Lambda layers): only for files "
                              "you trust")
    inspect.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    inspect.add_argument("--import", dest="imports", action="append", default=[],
                         metavar="MODULE",
                         help="import a module (or run a .py file) that registers the "
                              "file's custom objects before it loads; repeatable")
    args = parser.parse_args(argv)
    if args.command == "inspect":
        _check_choices(inspect, args)
    try:
        if args.command == "demo":
            from callscope._demo import run_demo

            _check_out(args.out, overwrite=True)  # (the demo writes over its own files)
            _make_out(args.out)
            run_demo(args.out, args.epochs)
        else:
            run_inspect(args)
    except InputError as error:
        print(f"callscope: error: {error}", file=sys.stderr)
        return 1
    return 0


def _positive(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _check_choices(parser, args):
    from callscope._points import KINDS
    from callscope._reduce import STATS

    for stat in args.reduce.split(","):
        if stat not in STATS:
            parser.error(f"--reduce takes {','.join(STATS)}; got {stat!r}")
    for kind in args.kinds.split(","):
        if kind not in KINDS[:2]:
            parser.error(f"--kinds takes output,input; got {kind!r}")


# --------------------------------------------------------------------------
# inspect
# --------------------------------------------------------------------------
def _load_model(path, unsafe, imports=()):
    if not os.path.exists(path):
        raise InputError(f"no such model file: {path} (check the path)")
    if path.endswith(".keras") and not zipfile.is_zipfile(path):
        # (Keras says "File not found" of such a file.)
        raise InputError(f"{path} is not a loadable Keras model: a .keras file is a zip "
                         "archive, as `model.save(path)` writes it, and this one is not")
    _import(imports)
    import keras

    import callscope as cs

    try:
        model = _loaded(keras, path, unsafe)
    except ValueError as error:
        text = str(error)
        if "safe_mode" in text or "unsafe" in text.lower():
            raise InputError(
                f"{path} contains code (a Lambda layer or a custom object) that runs when "
                "it loads; if you trust the file, rerun with --unsafe"
            ) from None
        raise InputError(f"{path} is not a loadable Keras model: {_first_line(text)}") from None
    except Exception as error:  # zip, h5 and json errors all mean "not a .keras file"
        missing = re.search(r"Could not locate (?:class|function) '([^']+)'", str(error))
        if missing and imports:  # (imported, yet not registered under that name)
            raise InputError(
                f"{path} holds a custom object `{missing.group(1)}` that the modules given "
                f"to --import ({', '.join(imports)}) did not register: register it with "
                "`@keras.saving.register_keras_serializable(package=...)` under the "
                "package and name it was saved with, or --import the module that does") from None
        if missing:  # (a subclassed model, or a custom layer: their code is not here)
            raise InputError(
                f"{path} holds a custom object `{missing.group(1)}` whose code this "
                "command cannot import (a subclassed model, a custom layer or a function "
                "in it, registered where it was saved): pass the module that defines "
                "and registers it with --import MODULE (or --import path/to/file.py), or "
                "inspect it in your own script, where that code is "
                "imported: `cs.capture(cs.enable(keras.saving.load_model(path)))` takes "
                "the same selections and statistics") from None
        raise InputError(
            f"{path} is not a Keras model file (.keras): {_first_line(str(error))}"
        ) from None
    if not isinstance(model, keras.Model):
        raise InputError(f"{path} holds a {type(model).__name__}, not a Keras model")
    return cs.enable(model)


def _import(names):
    """Imports each of `names` (`--import`): a module found from the current
    directory, or a `.py` file run as a module named after it (its folder on the
    path, for its own imports), so that the custom objects it registers are there
    when the model loads. What it raises, or a `sys.exit` in it, is one line."""
    import importlib
    import importlib.util

    for name in names:
        try:
            if name.endswith(".py"):
                if not os.path.isfile(name):
                    raise InputError(f"--import {name}: no such file (check the path)")
                module_name = os.path.splitext(os.path.basename(name))[0]
                known = getattr(sys.modules.get(module_name), "__file__", None)
                if module_name in sys.modules and not (
                        known and os.path.realpath(known) == os.path.realpath(name)):
                    raise InputError(
                        f"--import {name}: a module named {module_name} is already "
                        "imported here, which this file would replace; rename the file")
                folder = os.path.dirname(os.path.abspath(name))
                if folder not in sys.path:  # (first, as `python file.py` puts it: its
                    sys.path.insert(0, folder)  # own modules before installed ones)
                spec = importlib.util.spec_from_file_location(module_name, name)
                module = importlib.util.module_from_spec(spec)
                sys.modules[module_name] = module  # (as an import would: dataclasses, pickle)
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[module_name]  # (as a failed import leaves none)
                    raise
            else:
                if os.getcwd() not in sys.path and "" not in sys.path:
                    sys.path.insert(0, os.getcwd())  # (first, as `python -m` puts it;
                    # the script's path lacks it)
                importlib.import_module(name)
        except InputError:
            raise
        except ModuleNotFoundError as error:
            if not name.endswith(".py") and error.name and (
                    name == error.name or name.startswith(error.name + ".")):
                raise InputError(
                    f"--import {name}: {error} (give a module importable from the current "
                    "directory, such as mypkg.models, or the path of a .py file)") from None
            raise InputError(f"--import {name} raised ModuleNotFoundError: "
                             f"{_first_line(str(error))}") from None  # (the module's own)
        except SystemExit as error:  # (a script that parses its arguments as it loads)
            raise InputError(
                f"--import {name} exited (SystemExit: {error.code}) as it ran: put the "
                "script's own code under `if __name__ == \"__main__\":`, or import the "
                "module that defines the custom objects") from None
        except Exception as error:  # noqa: BLE001 - the user's code: its error, one line
            raise InputError(f"--import {name} raised {type(error).__name__}: "
                             f"{_first_line(str(error))}") from None


def _loaded(keras, path, unsafe):
    """The model, compiled as saved (its `jit_compile` and `run_eagerly` kept);
    uncompiled where its compile config needs code that is not here (a custom loss
    or metric, which inspecting never uses)."""
    try:
        return keras.saving.load_model(path, safe_mode=not unsafe)
    except Exception as error:  # noqa: BLE001 - retried, then reported by the caller
        if "Could not locate" not in str(error):
            raise
        return keras.saving.load_model(path, safe_mode=not unsafe, compile=False)


def _model_inputs(model):
    """What the model takes: `(layout, {name: shape without the batch axis})`.

    `layout` is `"dict"` (a Functional model built on a dict of inputs, keyed by
    name: keras_hub backbones), `"list"` (a list of inputs, passed as a list in the
    model's order; names are the `Input`s' names) or `"single"`. A model that does
    not say what it takes (a subclassed model) is `("single", {})`: one array, any
    shape.
    """
    try:
        struct = model.input
    except Exception:  # a Sequential or subclassed model that was never called
        struct = None
    if isinstance(struct, dict) and all(hasattr(t, "shape") for t in struct.values()):
        return "dict", {name: tuple(t.shape)[1:] for name, t in struct.items()}
    try:
        inputs = list(model.inputs or ())
    except Exception:
        inputs = []
    shapes = {t.name: tuple(t.shape)[1:] for t in inputs}
    if not inputs or len(shapes) != len(inputs):
        return "single", {}
    # A list of inputs (one input in a list too: Keras warns when it gets a bare array).
    return ("list" if len(inputs) > 1 or isinstance(struct, (list, tuple)) else "single"), shapes


def _npz_hint(names):
    return f"np.savez(path, {', '.join(f'{n}=...' for n in names)})"


def _load_data(path, names):
    """`{input name: array}` for the inputs `names` (in the model's order); one
    array under the key None when the model does not name its inputs."""
    if not os.path.exists(path):
        raise InputError(f"no such data file: {path} (check the path)")
    try:
        with open(path, "rb") as f:
            start = f.read(6)
    except OSError as error:
        raise InputError(f"cannot read {path}: {error.strerror or error}") from None
    if not start.startswith((b"\x93NUMPY", b"PK")):  # (numpy would try it as a pickle)
        raise InputError(f"{path} is not a .npy or .npz file (it does not start as one); "
                         "save the data with np.save or np.savez")
    try:
        data = np.load(path, allow_pickle=False)
    except Exception as error:
        raise InputError(f"{path} is not a .npy or .npz file: {_first_line(str(error))}") from None
    if isinstance(data, np.lib.npyio.NpzFile):
        with data:
            try:
                # (An .npz reads each array when it is asked for: read them here.)
                arrays = {name: np.asarray(array)
                          for name, array in _pick_arrays(data, path, names).items()}
            except (ValueError, OSError, zipfile.BadZipFile) as error:
                raise InputError(f"{path} holds an array that cannot be read: "
                                 f"{_first_line(str(error))}") from None
    elif len(names) > 1:
        raise InputError(
            f"{path} holds one array, but the model takes inputs {names}: save one array "
            f"per input in an .npz, named after it ({_npz_hint(names)})"
        )
    else:
        arrays = {names[0] if names else None: data}
    for name, array in arrays.items():
        if array.ndim < 1:
            which = f"array {name!r} in {path}" if len(arrays) > 1 else path
            raise InputError(f"{which} holds a single value (a 0-d array), not examples; "
                             "save an array of shape (N, ...), one row per example")
        if len(array) == 0:
            which = f"an empty array {name!r}" if len(arrays) > 1 else "an empty array"
            raise InputError(f"{path} holds {which}; give at least one example")
        if array.dtype.kind not in "biuf":  # bool, integers, floats
            which = f"array {name!r}" if len(arrays) > 1 else "the data"
            raise InputError(f"{which} in {path} holds {array.dtype} values, but a model "
                             "takes numbers; save the data as numbers (tokens as ids)")
    rows = {name: len(array) for name, array in arrays.items()}
    if len(set(rows.values())) > 1:
        counts = ", ".join(f"{name} has {n}" for name, n in rows.items())
        raise InputError(f"the arrays in {path} have different numbers of rows ({counts}); "
                         "every input needs one row per example")
    return arrays


def _pick_arrays(npz, path, names):
    members = npz.zip.namelist()
    if members and not any(member.endswith(".npy") for member in members):
        what = ("a Keras model file (.keras)" if "config.json" in members
                else "a zip archive without arrays")
        raise InputError(f"{path} is {what}, not an .npz of arrays (it holds "
                         f"{members[:4]}); save the data with np.save or np.savez")
    held = list(npz.files)
    if not held:
        raise InputError(f"{path} holds no arrays")
    if len(names) > 1:
        if all(name in held for name in names):
            return {name: npz[name] for name in names}
        raise InputError(
            f"{path} holds arrays {held}, but the model takes inputs {names}: save one "
            f"array per input, named after it ({_npz_hint(names)})"
        )
    # One input: an array named after it, else `x`, else the only array.
    for candidate in (*names, "x"):
        if candidate in held:
            return {names[0] if names else None: npz[candidate]}
    if len(held) == 1:
        return {names[0] if names else None: npz[held[0]]}
    expected = ["x", *names] if names else ["x"]
    raise InputError(
        f"{path} holds arrays {held}, but none is named {' or '.join(expected)}: save the "
        f"input as x ({_npz_hint(['x'])}), or as a .npy"
    )


def _check_shape(shapes, arrays, path):
    """Every array's examples have the shape of its input (None matches any size)."""
    for name, data in arrays.items():
        if name not in shapes:
            continue
        expected = shapes[name]
        got = data.shape[1:]
        if len(expected) == len(got) and all(e is None or e == g
                                             for e, g in zip(expected, got)):
            continue
        wanted = f"(N, {', '.join(str(e) for e in expected)})" if expected else "(N,)"
        if len(shapes) == 1:
            raise InputError(
                f"data in {path} has examples of shape {got}, but the model takes "
                f"{expected} (shape of the whole array: {data.shape}); reshape the data "
                f"to {wanted}"
            )
        raise InputError(
            f"array {name!r} in {path} has examples of shape {got}, but the model's input "
            f"{name!r} takes {expected} (shape of the whole array: {data.shape}); reshape "
            f"it to {wanted}"
        )


def _model_data(layout, arrays, rows=None):
    """The arrays (their first `rows` rows) as the model takes them."""
    cut = {name: array[:rows] for name, array in arrays.items()}
    if layout == "dict":
        return cut
    if layout == "list":
        return list(cut.values())
    return next(iter(cut.values()))


def _check_out(out, overwrite, given=()):
    """Refuses an `--out` that is a file, or a directory with files but no
    `--overwrite`, or one that holds a file `given` (the model, the data, the code
    `--import` ran: emptied, it would delete them), before any work (`_make_out`
    empties it later)."""
    if not out:
        raise InputError("--out takes a directory; received an empty path")
    if os.path.exists(out) and not os.path.isdir(out):
        raise InputError(f"--out {out} is a file; give a directory (new, or empty)")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise InputError(f"{out} already exists and is not empty; choose another --out "
                         "or pass --overwrite")
    inside = os.path.realpath(out) + os.sep
    for path in given:
        if os.path.realpath(path).startswith(inside):
            raise InputError(f"--out {out} holds {path}, which --overwrite would delete; "
                             "choose another --out")


def _make_out(out, empty=False):
    """Makes `out` a directory, emptied with `empty` (`--overwrite`): what it holds
    is deleted, the directory itself kept (its mode, a link to it, `.`, a mount
    point)."""
    from callscope._capture import empty_directory

    try:
        os.makedirs(out, exist_ok=True)
        if empty:
            empty_directory(out)
    except OSError as error:
        raise InputError(f"cannot write --out {out}: {error.strerror or error}") from None


def run_inspect(args):
    import keras

    import callscope as cs
    from callscope import report

    before = set(sys.modules)
    model = _load_model(args.model, args.unsafe, args.imports)
    # (The code `--import` ran, and what it imported: an `--out` that held it lost it.)
    code = [getattr(sys.modules.get(name), "__file__", None) for name in set(sys.modules) - before]
    layout, shapes = _model_inputs(model)
    arrays = _load_data(args.data, list(shapes))
    _check_shape(shapes, arrays, args.data)
    data = _model_data(layout, arrays)
    if args.out is not None:
        _check_out(args.out, args.overwrite,
                   given=(args.model, args.data, *[path for path in code if path]))
        try:  # (before any work: the plot comes last)
            import matplotlib  # noqa: F401
        except ImportError:
            raise InputError("--out writes plots, which need matplotlib: install the "
                             "plot extra (pip install 'callscope[plot]')") from None
    stats_names = tuple(args.reduce.split(","))
    kinds = tuple(args.kinds.split(","))
    sample = _model_data(layout, arrays, args.batch_size)
    try:
        tree = cs.summary(model, sample, print_fn=lambda s: None)
        with cs.capture(model, args.select, kinds=kinds, reduce=stats_names) as stats:
            model.predict(data, batch_size=args.batch_size, verbose=0)
        values = {key: stats[key] for key in stats}
    except ValueError as error:
        raise InputError(_first_line(str(error))) from None
    except Exception as error:  # the model's own (an index out of range): one line too
        raise InputError(f"the model failed on {args.data}: {type(error).__name__}: "
                         f"{_first_line(str(error))}") from None
    try:
        if args.out:
            # Emptied only now that the statistics checked the data and the
            # selection: a run that fails on those leaves it as it was.
            _make_out(args.out, empty=True)
            with cs.capture(model, args.select, kinds=kinds,
                            to=os.path.join(args.out, "captures")) as full:
                model.predict(data, batch_size=args.batch_size, verbose=0)
            report.write_csv(os.path.join(args.out, "statistics.csv"), values)
            with open(os.path.join(args.out, "summary.txt"), "w") as f:
                f.write(tree + "\n")
            hists = stats
            if "hist" not in stats_names:  # the plot needs histograms: one more pass
                with cs.capture(model, args.select, kinds=kinds, reduce="hist") as hists:
                    model.predict(data, batch_size=args.batch_size, verbose=0)
            counts = {k: hists[k] for k in hists if k.endswith("/hist")}
            edges = {k: hists.hist_edges(k) for k in counts}
            report.plot_histograms(counts, edges, os.path.join(args.out, "histograms.png"),
                                   title="Histograms over the whole data")
    except ValueError as error:
        raise InputError(_first_line(str(error))) from None
    except OSError as error:  # (a full disk: the model ran)
        raise InputError(f"cannot write --out {args.out}: {error.strerror or error}") from None
    if args.json:
        # Strict JSON: a statistic with no finite value (NaN, ±inf) is null.
        print(json.dumps({k: _jsonable(v) for k, v in values.items()}, allow_nan=False))
        return
    print(tree)
    print()
    print(report.statistics_table(values))
    if args.out:
        print(f"\nwrote {len(full)} full captures, statistics.csv and summary.txt to {args.out}")
    del keras


def _jsonable(value):
    array = np.asarray(value, np.float64)
    if array.ndim == 0:
        return float(array) if np.isfinite(array) else None
    return np.where(np.isfinite(array), array, None).tolist()


def _first_line(text):
    """The first line that says what went wrong: Keras's "Exception encountered when
    calling ..." heads the cause, which follows it (in bold: ANSI codes dropped)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    said = [line for line in lines if not line.startswith("Exception encountered when")]
    return (said or lines or ["unknown error"])[0]


if __name__ == "__main__":
    sys.exit(main())
