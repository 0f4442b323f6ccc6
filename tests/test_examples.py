"""Every example runs, on this backend, as a user would run it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BACKEND

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
JAX_ONLY = {
    "seed_002_custom_fit_jax.py",  # the guide it comes from is JAX-only
    "sharded_residual_stream.py",  # keras.distribution is JAX's engine
}


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_example_runs(name, tmp_path):
    if name in JAX_ONLY and BACKEND != "jax":
        pytest.skip("JAX-only: a stateless JAX train_step, or keras.distribution")
    env = {**os.environ, "KERAS_BACKEND": BACKEND}
    proc = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True,
                          text=True, env=env, timeout=600, cwd=tmp_path)  # files land there
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
