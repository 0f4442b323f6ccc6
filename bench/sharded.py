"""Time per fit step and device memory, sharded (ModelParallel, 8 CPU devices) vs one
device, with and without a capture of every block's output and gradient.

Run: python bench/sharded.py   (JAX; starts its own process with 8 CPU devices)
Prints, per model: seconds per step plain and captured, their ratio, and the most
more bytes of live arrays any one device holds while a capture of 16 batches is held.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).resolve().parent.parent / "tests" / "sharded_worker.py"
env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND")}
proc = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True, env=env)
if proc.returncode:
    sys.exit(proc.stderr[-3000:])
results = json.loads(next(x for x in proc.stdout.splitlines()
                          if x.startswith("RESULTS "))[len("RESULTS "):])
print(f"{'model':8} {'run':8} {'step ms':>8} {'captured ms':>12} {'ratio':>6} "
      f"{'capture bytes/device':>21} {'devices':>8}")
for name, case in results.items():
    for run in ("single", "sharded"):
        f = case[run]["figures"]
        print(f"{name:8} {run:8} {f['step_s'] * 1e3:8.2f} {f['step_captured_s'] * 1e3:12.2f} "
              f"{f['step_captured_s'] / f['step_s']:6.2f} "
              f"{f['max_device_bytes_capturing']:21,d} {f['devices_holding']:8d}")
