"""What capture costs: callscope against stock Keras doing the same work, side by side.

Per backend, on the issue's workload (8 x Dense(512) on 8192 x 256, batch 256),
prints ratios measured in one run (callscope time / reference time; median of
interleaved repeats after a warm-up):

1. `sow` in every block, capture off, vs the same model without `sow` (predict, fit),
   and the control: that model against a second build of itself (the bench's noise);
2. full capture of every block in predict vs plain predict, and vs the stock
   functional multi-output model returning the same tensors; and what bounds it
   on a CPU: plain predict followed by one numpy copy of the captured bytes (a
   diagnostic);
3. the same capture vs an eager per-batch loop over that multi-output model (a
   speed-up: higher is better);
4. statistics-only capture of the 8 blocks during fit vs plain fit;
5. gradient and output statistics (rms, absmax) during fit vs plain fit;
6. streaming capture (`to=`) peak RSS when the data grows 4x (1x -> 4x and
   4x -> 16x), as a user sees it and with glibc's heap slack left out, beside
   the same capture held in memory: a control that the measure sees growth;
7. 4 again with the statistics kernels replaced by a constant: what the rest of
   the capture costs (a diagnostic; its values are wrong).

Usage:
    python bench/capture.py                  # jax, tensorflow, torch
    python bench/capture.py --backend jax --repeats 9
    python bench/capture.py --backend torch --repeats 21 --only 4,7   # some rows
"""

import argparse
import os
import subprocess
import sys
import tempfile

from _paired import backend_parser, each_backend, paired, table, use_backend

FEATURES, UNITS, BLOCKS, ROWS, BATCH = 256, 512, 8, 8192, 256


def _build(keras, cs, with_sow):
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(UNITS, activation="relu")

        def call(self, x):
            h = self.dense(x)
            return cs.sow(self, "h", h) if with_sow else h

    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    hidden, x = [], inputs
    for i in range(BLOCKS):
        x = Block(name=f"block_{i}")(x)
        hidden.append(x)
    outputs = keras.layers.Dense(10, name="head")(x)
    return inputs, hidden, outputs


def run_backend(repeats, only=()):
    def wanted(*numbers):
        return not only or any(n in only for n in numbers)

    import keras
    import numpy as np

    import callscope as cs

    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, FEATURES)).astype("float32")
    y = rng.normal(size=(ROWS, 10)).astype("float32")
    rows = []

    def compiled(model):
        model.compile(optimizer="sgd", loss="mse")
        return model

    # 1. sow present, capture off, vs no sow.
    if wanted(1):
        inputs, _, outputs = _build(keras, cs, with_sow=True)
        with_sow = compiled(cs.Model(inputs, outputs))
        inputs, _, outputs = _build(keras, cs, with_sow=False)
        without = compiled(keras.Model(inputs, outputs))
        f = paired(lambda: with_sow.predict(x, batch_size=BATCH, verbose=0),
                   lambda: without.predict(x, batch_size=BATCH, verbose=0), repeats)
        rows.append(("sow, capture off vs no sow: predict", f, "target <= 1.01"))
        f = paired(lambda: with_sow.fit(x, y, batch_size=BATCH, verbose=0),
                   lambda: without.fit(x, y, batch_size=BATCH, verbose=0), repeats)
        rows.append(("sow, capture off vs no sow: fit epoch", f, "target <= 1.01"))
        # The control: the model without sow against a second build of itself. Its
        # spread is the bench's own, what a 1% target is read against.
        inputs, _, outputs = _build(keras, cs, with_sow=False)
        again = compiled(keras.Model(inputs, outputs))
        f = paired(lambda: again.predict(x, batch_size=BATCH, verbose=0),
                   lambda: without.predict(x, batch_size=BATCH, verbose=0), repeats)
        rows.append(("control: no sow vs itself rebuilt: predict", f, "the noise"))
        f = paired(lambda: again.fit(x, y, batch_size=BATCH, verbose=0),
                   lambda: without.fit(x, y, batch_size=BATCH, verbose=0), repeats)
        rows.append(("control: the same, fit epoch", f, "the noise"))

    # 2-3. full capture of every block vs the functional multi-output model.
    if wanted(2, 3):
        inputs, hidden, outputs = _build(keras, cs, with_sow=False)
        multi = compiled(keras.Model(inputs, [outputs, *hidden]))
        ours = compiled(cs.Model(inputs, outputs))

        def capture_all():
            with cs.capture(ours, "*/block_?") as cap:
                ours.predict(x, batch_size=BATCH, verbose=0)
            assert sum(v.shape[0] for v in cap.values()) == BLOCKS * ROWS  # to numpy, as Keras

        f = paired(capture_all, lambda: ours.predict(x, batch_size=BATCH, verbose=0), repeats)
        rows.append(("full capture of 8 blocks vs plain predict", f, "target <= 1.10"))

        # What bounds 2 on a CPU, where the device's arrays are host memory: the
        # capture must still copy every captured row once into its host buffers
        # (so that reading is a view, whatever the number of batches). The same
        # bytes copied once with numpy, after a plain predict, give that floor.
        batches = [rng.normal(size=(BATCH, UNITS)).astype("float32")
                   for _ in range(BLOCKS * ROWS // BATCH)]
        rows_out = np.empty((BLOCKS * ROWS, UNITS), "float32")
        rows_out[:] = 0  # its pages mapped, as a reused host buffer's are

        def predict_then_copy():
            ours.predict(x, batch_size=BATCH, verbose=0)
            for i, batch in enumerate(batches):
                rows_out[i * BATCH:(i + 1) * BATCH] = batch

        f = paired(predict_then_copy, lambda: ours.predict(x, batch_size=BATCH, verbose=0),
                   repeats)
        rows.append(("  floor: predict, then numpy copies its bytes", f, "diagnostic"))
        f = paired(capture_all, lambda: multi.predict(x, batch_size=BATCH, verbose=0),
                   repeats)
        rows.append(("capture 8 blocks vs functional multi-output", f, "target <= 1.05"))

        def eager_loop():  # the same work: every block's rows to numpy
            outs = [multi(x[i:i + BATCH]) for i in range(0, ROWS, BATCH)]
            return [[keras.ops.convert_to_numpy(h) for h in o[1:]] for o in outs]

        f = paired(eager_loop, capture_all, max(7, repeats // 2))  # 7: a 95% interval
        # On a GPU the eager loop's op-by-op dispatch is what the compiled step
        # saves (the target there is 5); on a CPU its arithmetic is the same.
        target = "target >= 5" if _on_accelerator(keras) else "target >= 1.5"
        rows.append(("speed-up of capture over an eager batch loop", f, target))

    # 4-7 fit the same plain model.
    inputs, _, outputs = _build(keras, cs, with_sow=False)
    plain = compiled(cs.Model(inputs, outputs))

    def stats_fit():
        with cs.capture(plain, "*/block_?", reduce=("mean", "std", "frac_zero")):
            plain.fit(x, y, batch_size=BATCH, verbose=0)

    # 4. statistics-only capture during fit vs plain fit.
    if wanted(4):
        f = paired(stats_fit, lambda: plain.fit(x, y, batch_size=BATCH, verbose=0), repeats)
        rows.append(("stats capture of 8 blocks in fit vs plain fit", f, "target <= 1.05"))

    # 5. gradient statistics (per-block gradient norms) during fit vs plain fit.
    if wanted(5):
        def grad_stats_fit():
            with cs.capture(plain, "*/block_?", kinds=("output", "grad"), reduce=("rms", "absmax")):
                plain.fit(x, y, batch_size=BATCH, verbose=0)

        f = paired(grad_stats_fit, lambda: plain.fit(x, y, batch_size=BATCH, verbose=0),
                   repeats)
        rows.append(("grad + output stats of 8 blocks in fit vs plain", f, "target <= 1.15"))

    # 7. What bounds 4: the same capture with the statistics kernels replaced
    # by a constant (a diagnostic: the values are wrong). What is left is the cost
    # of carrying the partials out of the step and merging them on the host.
    if wanted(7):
        from callscope import _reduce

        kernels = _reduce.partials

        def constant_partials(value, stats, bins=32, hist_range=None):
            one = keras.ops.ones((1,), "float32")
            return {p: one for p in _reduce.needs(stats)}

        _reduce.partials = constant_partials
        try:
            compiled(plain)  # drops the steps traced with the real kernels
            f = paired(stats_fit, lambda: plain.fit(x, y, batch_size=BATCH, verbose=0),
                       repeats)
            rows.append(("  4 without its statistics kernels", f, "diagnostic"))
        finally:
            _reduce.partials = kernels
            compiled(plain)

    print(table(f"{keras.backend.backend()} (keras {keras.__version__}, {repeats} repeats)",
                rows))


def _on_accelerator(keras) -> bool:
    """True where the backend computes on a GPU (or another accelerator)."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.devices()[0].platform != "cpu"
    if backend == "torch":
        import torch

        return torch.cuda.is_available()
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


def _resident_mib() -> tuple:
    """(resident, peak resident) MiB of this process since `_reset_peak`, from
    /proc (Linux). Not `ru_maxrss`: Linux keeps that across fork and exec, so a
    child of a large process (this script, after the timed rows) read its
    parent's peak, and every figure read 1.00."""
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return tuple(int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))


def _reset_peak() -> None:
    """Gives free heap back to the OS (glibc's `malloc_trim`: an earlier pass's
    slack would otherwise count in this one's start), then resets VmHWM."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # VmHWM := the current resident set


def run_rss(scale):
    """Streams a capture of `scale` x ROWS rows to disk, then holds the same
    capture in memory (the control); prints each pass's peak resident MiB and
    its growth over the resident MiB before it."""
    import keras
    import numpy as np

    import callscope as cs

    inputs, _, outputs = _build(keras, cs, with_sow=False)
    model = cs.Model(inputs, outputs)
    x = np.random.default_rng(0).normal(size=(BATCH, FEATURES)).astype("float32")
    model.predict(x, verbose=0)

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return scale * ROWS // BATCH

        def __getitem__(self, index):
            return (x + index,)

    def measured(run):
        _reset_peak()
        base, _ = _resident_mib()
        result = run()
        _, peak = _resident_mib()
        return peak, peak - base, result

    with tempfile.TemporaryDirectory() as directory:
        with cs.capture(model, "*/block_?", to=os.path.join(directory, "cap")):
            model.predict(Batches(), verbose=0)  # warm-up pass

        def streamed():
            with cs.capture(model, "*/block_?", to=os.path.join(directory, "cap2")) as cap:
                model.predict(Batches(), verbose=0)
            return sum(v.nbytes for v in cap.values()) / 2**20

        def in_memory():
            with cs.capture(model, "*/block_?") as cap:
                model.predict(Batches(), verbose=0)
            return cap  # held until measured

        peak, growth, written = measured(streamed)
        control_peak, control_growth, _ = measured(in_memory)
    print(f"RSS {peak:.1f} {growth:.1f} {written:.0f} {control_peak:.1f} {control_growth:.1f}")


def main():
    parser = backend_parser(__doc__, repeats=7)
    parser.add_argument("--only", default="",
                        help="comma-separated numbers of the figures to run (see above)")
    parser.add_argument("--rss", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss:
        run_rss(args.rss)
        return
    only = {int(n) for n in args.only.split(",") if n}
    if args.backend:
        use_backend(args.backend)
        run_backend(args.repeats, only)
        if only and 6 not in only:
            return
        # Streaming holds at most the writer's queue (64 MiB). glibc's heap adds
        # slack of its own: once a freed 512 KiB block has raised its mmap
        # threshold, blocks of that size come from the heap, whose freed middle
        # it keeps (malloc_trim gives it all back). So the peak is measured as a
        # user sees it, and with that threshold fixed (MALLOC_MMAP_THRESHOLD_):
        # what callscope itself holds.
        def peaks(allocator):
            found = {}
            for scale in (1, 4, 16):
                out = subprocess.run([sys.executable, __file__, "--rss", str(scale)],
                                     capture_output=True, text=True, check=True,
                                     env={**os.environ, "KERAS_BACKEND": args.backend,
                                          **allocator})
                line = next(s for s in out.stdout.splitlines() if s.startswith("RSS "))
                found[scale] = [float(v) for v in line.split()[1:]]
            return found

        for label, allocator in (("", {}), (", fixed mmap threshold",
                                            {"MALLOC_MMAP_THRESHOLD_": "131072"})):
            found = peaks(allocator)
            for low, high in ((1, 4), (4, 16)):
                a, b = found[low], found[high]
                name = f"streaming peak RSS, {low}x -> {high}x data{label}"
                print(f"  {name:<46} {b[0] / a[0]:6.3f}x   (peak {a[0]:.0f} -> {b[0]:.0f} "
                      f"MiB, {a[1]:+.0f} -> {b[1]:+.0f} MiB over the pass's start; "
                      f"{a[2]:.0f} -> {b[2]:.0f} MiB streamed)  target <= 1.10")
                print(f"  {'  control: the same capture in memory':<46} "
                      f"{b[3] / a[3]:6.3f}x   (peak {a[3]:.0f} -> {b[3]:.0f} MiB, "
                      f"{a[4]:+.0f} -> {b[4]:+.0f} MiB over the pass's start)")
        return
    each_backend(__file__, "--repeats", str(args.repeats), "--only", args.only)


if __name__ == "__main__":
    main()
