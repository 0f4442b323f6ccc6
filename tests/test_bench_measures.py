"""What the benchmarks measure with is right: `bench/capture.py`'s memory figures
are this process's own, and `--backend` times the backend it names."""

import os
import subprocess
import sys

import numpy as np

_BENCH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench")

# A child started by a process that held 300 MiB, reading its own peak. With
# `ru_maxrss` it read the parent's (Linux keeps it across fork and exec), so
# every streaming figure of the bench read 1.00 whatever the data.
_CHILD = f"""
import sys
sys.path.insert(0, {_BENCH!r})
import capture
capture._reset_peak()
before, _ = capture._resident_mib()
held = bytearray(64 * 2**20)
held[::4096] = b"x" * len(held[::4096])  # every page written: resident
_, peak = capture._resident_mib()
print(before, peak)
"""


def test_a_childs_peak_resident_memory_is_its_own_and_sees_what_it_holds():
    parent_holds = np.ones(300 * 2**20 // 8)  # 300 MiB, resident
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                         check=True, env={**os.environ, "KERAS_BACKEND": "jax"})
    before, peak = map(float, out.stdout.split())
    assert parent_holds.sum() == parent_holds.size
    assert peak < 250, f"the child read its parent's peak: {peak:.0f} MiB"
    assert 60 <= peak - before <= 80, (before, peak)  # sees the 64 MiB it holds


def test_backend_flag_times_the_backend_it_names():
    # `--only 0` runs no figure: the title line alone says which backend ran.
    for backend in ("jax", "torch"):
        env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
        out = subprocess.run(
            [sys.executable, os.path.join(_BENCH, "capture.py"), "--backend", backend,
             "--only", "0", "--repeats", "1"],
            capture_output=True, text=True, check=True, env=env)
        assert f"\n{backend} (keras" in out.stdout, out.stdout
