#!/usr/bin/env bash
# bench/ on a GPU (the issue's GPU figures), one backend: each script under a
# time limit, in order of importance, its output kept in DIR/bench-BACKEND.txt.
#
# Usage: [REPEATS=21] bench/gpu.sh DIR [BACKEND]   (python3 must import keras,
#        callscope and a GPU build of the backend; BACKEND defaults to jax)
set -u
out=${1:?usage: bench/gpu.sh DIR [BACKEND]}
backend=${2:-jax}
repeats=${REPEATS:-21}
mkdir -p "$out"
export KERAS_BACKEND=$backend PYTHONUNBUFFERED=1
cd "$(dirname "$0")"
log="$out/bench-$backend.txt"

run() {  # run NAME SECONDS ARGS...: one script, its warnings left out
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s): python3 $*" | tee -a "$log"
  local start=$SECONDS
  timeout "$limit" python3 "$@" 2>&1 | grep -v -e '^WARNING' -e '^I0000' -e '^W0000' >>"$log"
  echo "   rc ${PIPESTATUS[0]}, $((SECONDS - start)) s" | tee -a "$log"
}

python3 -c "import importlib, keras, numpy; b = keras.backend.backend()
print(b, importlib.import_module(b).__version__, 'keras', keras.__version__,
      'numpy', numpy.__version__)" 2>&1 | tee -a "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$log"
run capture 150 capture.py --backend "$backend" --only 2,3 --repeats "$repeats"
run fit-rows 120 capture.py --backend "$backend" --only 4,5 --repeats "$repeats"
run buffers 60 buffers.py --repeats "$repeats"
run context 60 context_overhead.py --backend "$backend" --repeats "$repeats"
run sweep 40 sweep.py
run sow 80 capture.py --backend "$backend" --only 1 --repeats "$repeats"
run compile 120 compile_time.py
