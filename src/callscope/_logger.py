"""Statistics captured during `fit`, in the places Keras users already look.

`cs.capture(model, reduce=..., log=True)` makes every `fit` inside the scope put
one exact per-epoch aggregate of each statistic into the epoch logs, so History,
`CSVLogger` and the `TensorBoard` callback record them like any metric (histograms
go to TensorBoard as histograms). The progress bar is left alone: the callback that
does this is Keras's own progress bar with the statistics filtered out, so Keras
adds no second one.
"""

from __future__ import annotations

import numpy as np
from keras import callbacks as keras_callbacks

from callscope import _reduce


class EpochStatistics(keras_callbacks.ProgbarLogger):
    """Adds a capture's per-epoch statistics to the epoch logs, and prints progress.

    Inserted first in `fit`'s callbacks by callscope when a `cs.capture(...,
    log=True)` is open, so History, CSVLogger and TensorBoard (later in the list)
    see the statistics. Not meant to be constructed by hand.
    """

    def __init__(self, call, callbacks=(), progress=True):
        super().__init__()
        # progress=False: only the statistics (a user-built CallbackList passed to
        # fit keeps its own progress bar, or none).
        self._progress = progress
        self.capture = call  # this fit's records (a `_capture.Call`)
        self._callbacks = list(callbacks)
        self._start: dict[str, int] = {}
        self._keys: set[str] = set()

    def on_epoch_begin(self, epoch, logs=None):
        call = self.capture
        call.flush()  # the last step lands first: the epoch starts after it
        self._start = {key: call.steps(key) for key in call._steps}
        if self._progress:
            super().on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            scalars, histograms = self.epoch_statistics()
            logs.update(scalars)
            self._keys.update(scalars)
            self._write_histograms(histograms, epoch)
        if self._progress:
            shown = {k: v for k, v in (logs or {}).items() if k not in self._keys}
            super().on_epoch_end(epoch, shown)

    def epoch_statistics(self):
        """Exact aggregates over this epoch's steps: ({key: float}, {key: counts})."""
        scalars, histograms = {}, {}
        call = self.capture
        call.flush()
        for key in call._steps:
            rows = call.step_rows(key, self._start.get(key, 0))
            if not len(next(iter(rows.values()))):
                # A point no step of this epoch reached (torch runs each step's
                # Python: a branch not taken) logs NaN: History keeps one value
                # an epoch, where a missing one moved the next epoch's into its place.
                scalars.update({f"{key}/{stat}": float("nan")
                                for stat in self.capture.spec.stats if stat != "hist"})
                continue
            merged = _reduce.merge(rows)
            for stat in self.capture.spec.stats:
                value = _reduce.finalize(merged, stat)
                if stat == "hist":
                    histograms[f"{key}/hist"] = value
                else:
                    scalars[f"{key}/{stat}"] = float(value)
        return scalars, histograms

    def _write_histograms(self, histograms, epoch):
        board = next((cb for cb in self._callbacks
                      if isinstance(cb, keras_callbacks.TensorBoard)), None)
        if board is None or not histograms:
            return
        import tensorflow as tf  # the TensorBoard callback needs it anyway

        writer = tf.summary.create_file_writer(f"{board.log_dir}/train")
        with writer.as_default():
            for key, counts in histograms.items():
                edges = self.capture.hist_edges(key)
                centres = np.repeat((edges[:-1] + edges[1:]) / 2, counts.astype(np.int64))
                tf.summary.histogram(key, centres, step=epoch, buckets=len(counts))
        writer.flush()
