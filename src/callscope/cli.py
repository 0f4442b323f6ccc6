"""The `callscope` command: `demo` (the main job) and `inspect` (a model you were given).

    callscope demo [--out DIR] [--epochs N]
    callscope inspect MODEL.keras --data FILE.npy|.npz [--select GLOB] [--reduce mean,std]
                      [--kinds output,input] [--batch-size N] [--out DIR] [--json]
                      [--unsafe] [--overwrite]

Exit codes: 0 success, 1 an input error (a missing or unreadable file, a shape
that does not fit), 2 a usage error. Errors are one line on stderr, never a
traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

DEFAULT_STATS = "mean,std,min,max,frac_zero"


class InputError(Exception):
    """A problem with the user's files or data: exit code 1, one line."""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="callscope", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="train a small model and report what happens "
                                            "inside it")
    demo.add_argument("--out", default="callscope-report", help="report directory")
    demo.add_argument("--epochs", type=_positive, default=6)

    inspect = commands.add_parser("inspect", help="statistics of every point of a saved model")
    inspect.add_argument("model", help="a .keras file")
    inspect.add_argument("--data", required=True, help="input data, .npy or .npz")
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
    args = parser.parse_args(argv)
    if args.command == "inspect":
        _check_choices(parser, args)
    try:
        if args.command == "demo":
            from callscope._demo import run_demo

            run_demo(args.out, args.epochs)
        else:
            run_inspect(args)
    except InputError as error:
        print(f"callscope: error: {error}", file=sys.stderr)
        return 1
    return 0


def _positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
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
def _load_model(path, unsafe):
    if not os.path.exists(path):
        raise InputError(f"no such model file: {path} (check the path)")
    import keras

    import callscope as cs

    try:
        model = keras.saving.load_model(path, safe_mode=not unsafe)
    except ValueError as error:
        text = str(error)
        if "safe_mode" in text or "unsafe" in text.lower():
            raise InputError(
                f"{path} contains code (a Lambda layer or a custom object) that runs when "
                "it loads; if you trust the file, rerun with --unsafe"
            ) from None
        raise InputError(f"{path} is not a loadable Keras model: {_first_line(text)}") from None
    except Exception as error:  # zip, h5 and json errors all mean "not a .keras file"
        raise InputError(
            f"{path} is not a Keras model file (.keras): {_first_line(str(error))}"
        ) from None
    if not isinstance(model, keras.Model):
        raise InputError(f"{path} holds a {type(model).__name__}, not a Keras model")
    return cs.enable(model)


def _load_data(path):
    if not os.path.exists(path):
        raise InputError(f"no such data file: {path} (check the path)")
    try:
        data = np.load(path, allow_pickle=False)
    except Exception as error:
        raise InputError(f"{path} is not a .npy or .npz file: {_first_line(str(error))}") from None
    if isinstance(data, np.lib.npyio.NpzFile):
        names = data.files
        if not names:
            raise InputError(f"{path} holds no arrays")
        name = "x" if "x" in names else names[0]
        data = data[name]
    if data.ndim < 1 or len(data) == 0:
        raise InputError(f"{path} holds an empty array; give at least one example")
    return data


def _check_shape(model, data, path):
    inputs = getattr(model, "inputs", None)
    if not inputs or len(inputs) != 1:
        return
    expected = tuple(inputs[0].shape)[1:]
    got = data.shape[1:]
    if len(expected) != len(got) or any(e is not None and e != g for e, g in zip(expected, got)):
        raise InputError(
            f"data in {path} has examples of shape {got}, but the model takes "
            f"{expected} (shape of the whole array: {data.shape}); reshape the data to "
            f"(N, {', '.join(str(e) for e in expected)})"
        )


def _prepare_out(out, overwrite):
    if os.path.exists(out) and os.listdir(out):
        if not overwrite:
            raise InputError(f"{out} already exists and is not empty; choose another --out "
                             "or pass --overwrite")
        import shutil

        shutil.rmtree(out)
    os.makedirs(out, exist_ok=True)


def run_inspect(args):
    import keras

    import callscope as cs
    from callscope import report

    model = _load_model(args.model, args.unsafe)
    data = _load_data(args.data)
    _check_shape(model, data, args.data)
    if args.out:
        _prepare_out(args.out, args.overwrite)
    stats_names = tuple(args.reduce.split(","))
    kinds = tuple(args.kinds.split(","))
    sample = data[: args.batch_size]
    try:
        tree = cs.summary(model, sample, print_fn=lambda s: None)
        with cs.capture(model, args.select, kinds=kinds, reduce=stats_names) as stats:
            model.predict(data, batch_size=args.batch_size, verbose=0)
        values = {key: stats[key] for key in stats}
        if args.out:
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
    if args.json:
        print(json.dumps({k: _jsonable(v) for k, v in values.items()}))
        return
    print(tree)
    print()
    print(report.statistics_table(values))
    if args.out:
        print(f"\nwrote {len(full)} full captures, statistics.csv and summary.txt to {args.out}")
    del keras


def _jsonable(value):
    array = np.asarray(value)
    return float(array) if array.ndim == 0 else array.tolist()


def _first_line(text):
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else "unknown error"


if __name__ == "__main__":
    sys.exit(main())
