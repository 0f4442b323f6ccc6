"""Checks that installing callscope with a backend extra keeps the backend already
installed (a CUDA build, another release) instead of replacing it.

It asks the given environment's pip what `pip install -e '.[EXTRA]'` would do
(`--dry-run --report`, so nothing is downloaded in full or installed) and fails if
the plan installs the backend's package. Run it with the Python of a venv that
has the backend at a version other than the one in constraints.txt. Not run by CI:
making such a venv takes gigabytes.

Usage:
    python3.11 -m venv /tmp/v && /tmp/v/bin/pip install --no-deps torch-2.14.1-...whl
    python tools/check_extra_keeps_backend.py --python /tmp/v/bin/python --extra torch
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

PACKAGES = {"torch": "torch", "jax": "jax", "tensorflow": "tensorflow-cpu"}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True, help="the venv's python")
    parser.add_argument("--extra", choices=sorted(PACKAGES), default="torch")
    args = parser.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    package = PACKAGES[args.extra]
    installed = subprocess.run(
        [args.python, "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
        capture_output=True, text=True)
    if installed.returncode != 0:
        sys.exit(f"{package} is not installed in {args.python}: install another version "
                 f"of it there first. Received: python={args.python}")
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        subprocess.run([args.python, "-m", "pip", "install", "--dry-run", "--quiet",
                        "--report", report, "-e", f"{root}[{args.extra}]"], check=True)
        with open(report) as f:
            plan = {item["metadata"]["name"].lower(): item["metadata"]["version"]
                    for item in json.load(f)["install"]}
    print(f"installed {package}: {installed.stdout.strip()}; "
          f"pip would install: {sorted(plan.items())}")
    if package in plan:
        sys.exit(f"FAIL: `pip install -e '.[{args.extra}]'` would replace {package} "
                 f"{installed.stdout.strip()} with {plan[package]}")
    print(f"OK: `pip install -e '.[{args.extra}]'` keeps {package} {installed.stdout.strip()}")


if __name__ == "__main__":
    main()
