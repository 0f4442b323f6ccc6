"""Runs the test suite once per Keras backend, each in its own process.

`KERAS_BACKEND` is fixed when keras is first imported, so one pytest process can
only ever test one backend.

Usage:
    python tools/test_backends.py                      # jax, tensorflow, torch
    python tools/test_backends.py --backends jax -- -k context   # extra pytest args
"""

import argparse
import os
import subprocess
import sys
import time

BACKENDS = ("jax", "tensorflow", "torch")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help="comma-separated backends (default: %(default)s)")
    parser.add_argument("pytest_args", nargs="*", help="extra arguments for pytest")
    args = parser.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    failed = []
    for backend in args.backends.split(","):
        start = time.time()
        print(f"==== {backend} ====", flush=True)
        env = {**os.environ, "KERAS_BACKEND": backend}
        code = subprocess.call([sys.executable, "-m", "pytest", *args.pytest_args],
                               cwd=root, env=env)
        print(f"==== {backend}: exit {code} in {time.time() - start:.0f}s ====", flush=True)
        if code != 0:
            failed.append(backend)
    if failed:
        print(f"failed on: {', '.join(failed)}")
        return 1
    print(f"passed on: {args.backends}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
