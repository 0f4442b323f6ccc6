"""The host data path of captures: memory, read cost and streaming, per backend.

Prints, for the backend that KERAS_BACKEND selects (one process per backend):

1. memory while capturing N and 4N batches of 256 x 256: the most device bytes the
   capture holds at any step end (JAX: live device arrays of a captured batch's
   shape; TF and torch: arrays not yet landed), and the process's resident memory
   growth (the host buffers, which hold the data by design);
2. the cost of reading a key after 100 vs 800 batches, after the call and during
   it (a callback that reads at batch 100 and at batch 800);
3. streaming capture (`to=`) of every block of an 8-block MLP ÷ plain predict.

Ratios are paired (the two sides alternate), reported as median and best over
`--repeats` (at least 7). Acceptance: reading after 800 batches costs no more than
2x reading after 100; device bytes flat within 10% while the batches grow 4x.

Usage:
    KERAS_BACKEND=jax python bench/buffers.py [--repeats 7]
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time

import keras
import numpy as np
from _paired import timed_pairs

import callscope as cs

BACKEND = keras.backend.backend()
UNITS, BATCH, INPUTS = 256, 256, 128  # inputs narrower: not counted as captures


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _captured_device_bytes() -> int:
    """JAX: bytes of live device arrays shaped like a captured batch. (Stock Keras
    keeps predict's own outputs on the device until the call ends: (batch, 1)
    here, left out.)"""
    import jax

    return sum(a.nbytes for a in jax.live_arrays() if a.shape == (BATCH, UNITS))


def _mlp(blocks=2):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((INPUTS,))]
    layers += [keras.layers.Dense(UNITS, activation="relu", name=f"block_{i}")
               for i in range(blocks)]
    layers.append(keras.layers.Dense(1, name="head"))
    return cs.Sequential(layers, name="mlp")


class _AtBatchEnd(keras.callbacks.Callback):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def on_predict_batch_end(self, batch, logs=None):
        self.fn(batch)


def _summary(pairs):
    ratios = [a / b for a, b in pairs]
    return statistics.median(ratios), min(ratios)


def memory(model, n):
    """Peak device bytes held by the capture, and RSS growth, over n batches."""
    x = np.random.default_rng(0).normal(size=(n * BATCH, INPUTS)).astype("float32")
    model.predict(x[:BATCH], batch_size=BATCH, verbose=0)  # compiled before measuring
    base_rss, peak = _rss(), [0]
    with cs.capture(model, "*/block_0") as cap:
        def probe(batch):
            held = _captured_device_bytes() if BACKEND == "jax" else \
                cap.calls[-1]._landing.held() * BATCH * UNITS * 4
            peak[0] = max(peak[0], held)
        model.predict(x, batch_size=BATCH, verbose=0, callbacks=[_AtBatchEnd(probe)])
        grown = _rss() - base_rss
    return peak[0], grown


def _timed_reads(model, x, n):
    """One captured predict over n batches: read times during it (at batches 100
    and 800) and after it."""
    times = {}
    with cs.capture(model, "*/block_0") as cap:
        def probe(batch):
            if batch + 1 in (100, 800):
                start = time.perf_counter()
                cap["mlp/block_0:output"]
                times[("during", batch + 1)] = time.perf_counter() - start
        model.predict(x[:n * BATCH], batch_size=BATCH, verbose=0,
                      callbacks=[_AtBatchEnd(probe)])
    start = time.perf_counter()
    value = cap["mlp/block_0:output"]
    times[("after", n)] = time.perf_counter() - start
    assert value.shape == (n * BATCH, UNITS)
    return times


def read_costs(model, repeats):
    """Paired read times (800 batches, 100 batches), after the call and during it."""
    x = np.random.default_rng(0).normal(size=(800 * BATCH, INPUTS)).astype("float32")
    after, during = [], []
    for _ in range(repeats):
        short, long = _timed_reads(model, x, 100), _timed_reads(model, x, 800)
        after.append((long[("after", 800)], short[("after", 100)]))
        during.append((long[("during", 800)], long[("during", 100)]))
    return after, during


def streaming(repeats):
    model = _mlp(blocks=8)
    x = np.random.default_rng(0).normal(size=(8192, INPUTS)).astype("float32")
    root = tempfile.mkdtemp()

    def captured():
        target = os.path.join(root, "caps")
        with cs.capture(model, "mlp/block_*", to=target, overwrite=True):
            model.predict(x, batch_size=BATCH, verbose=0)
        shutil.rmtree(target)

    def plain():
        model.predict(x, batch_size=BATCH, verbose=0)

    pairs = timed_pairs(captured, plain, repeats)
    shutil.rmtree(root, ignore_errors=True)
    return pairs


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batches", type=int, default=50, help="N for the memory figure")
    args = parser.parse_args()
    repeats = max(args.repeats, 7)
    print(f"backend {BACKEND}, batches of {BATCH} x {UNITS}, {repeats} repetitions")

    model = _mlp()
    (dev_n, rss_n), (dev_4n, rss_4n) = memory(model, args.batches), memory(model, 4 * args.batches)
    ratio = dev_4n / dev_n if dev_n else (1.0 if dev_4n == 0 else float("inf"))
    print(f"memory, {args.batches} vs {4 * args.batches} batches: device bytes held by the "
          f"capture at peak {dev_n:,} vs {dev_4n:,} (ratio {ratio:.2f}); process RSS growth "
          f"{rss_n / 2**20:.1f} MiB vs {rss_4n / 2**20:.1f} MiB (the host buffers)")

    after, during = read_costs(model, repeats)
    for name, pairs in (("after the call", after), ("during the call", during)):
        median, best = _summary(pairs)
        print(f"read cost, 800 / 100 batches, {name}: median {median:.2f}, best {best:.2f} "
              f"(800: median {statistics.median(a for a, _ in pairs) * 1e6:.0f} us)")

    median, best = _summary(streaming(repeats))
    print(f"streaming capture of 8 blocks (to=) / plain predict: median {median:.2f}, "
          f"best {best:.2f}")


if __name__ == "__main__":
    main()
