"""Statistics captured during fit land in History, CSVLogger and TensorBoard."""

import csv
import glob

import keras
import numpy as np
import pytest
from models_for_tests import Branching

import callscope as cs

rng = np.random.default_rng(0)
X = rng.normal(size=(12, 4)).astype("float32")
Y = rng.normal(size=(12, 1)).astype("float32")


def _model():
    keras.utils.set_random_seed(0)
    model = cs.Sequential([keras.Input((4,)), keras.layers.Dense(6, name="hidden",
                                                                 activation="relu"),
                           keras.layers.Dense(1, name="out")], name="seq")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    return model


def test_epoch_logs_history_and_csv_get_exact_epoch_aggregates(tmp_path, capsys):
    model = _model()
    path = tmp_path / "log.csv"
    with cs.capture(model, "seq/hidden", reduce=("mean", "frac_zero"), log=True) as cap:
        history = model.fit(X, Y, batch_size=4, epochs=2, shuffle=False, verbose=2,
                            callbacks=[keras.callbacks.CSVLogger(str(path))])
    key = "seq/hidden:output/mean"
    h = np.asarray(keras.ops.convert_to_numpy(model.get_layer("hidden")(X)))
    assert history.history[key] == pytest.approx([h.mean(), h.mean()], rel=1e-5)
    assert history.history["seq/hidden:output/frac_zero"][0] == pytest.approx((h == 0).mean())
    assert cap[key].shape == (6,)  # the capture itself still has one row per step
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert float(rows[1][key]) == pytest.approx(h.mean(), rel=1e-5)
    printed = capsys.readouterr().out
    assert "loss" in printed and "hidden:output" not in printed  # progress bar untouched


def test_tensorboard_records_scalars_and_histograms(tmp_path):
    # Keras's TensorBoard callback writes through TensorFlow, whatever the backend.
    pytest.importorskip("tensorflow", reason="Keras's TensorBoard callback needs TensorFlow")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = _model()
    board = keras.callbacks.TensorBoard(log_dir=str(tmp_path))
    with cs.capture(model, "seq/hidden", reduce=("std", "hist"), hist_range=(0.0, 2.0),
                    log=True):
        model.fit(X, Y, batch_size=4, epochs=2, verbose=0, callbacks=[board])
    tags = {}
    for path in glob.glob(str(tmp_path / "train" / "events.*")):
        events = EventAccumulator(path, size_guidance={"tensors": 0, "histograms": 0})
        events.Reload()
        for kind, names in events.Tags().items():
            if isinstance(names, list):
                tags.setdefault(kind, set()).update(names)
    assert "epoch_seq/hidden:output/std" in tags["tensors"]
    assert "seq/hidden:output/hist" in tags["tensors"] | tags.get("histograms", set())


@pytest.mark.filterwarnings("ignore:Gradients do not exist for variables")  # (a skipped)
def test_an_epoch_that_never_reaches_a_point_logs_nan_and_keeps_history_aligned():
    # An eager step (torch's; `run_eagerly` on JAX and TF) may skip a point in an
    # epoch: History's list for it lost that epoch, and the next epoch's value
    # took its place.
    class SkipSecondEpoch(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.model.use_a = epoch != 1

    net = Branching(name="net")
    net.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", run_eagerly=True)
    x, y = np.ones((16, 2), "float32"), np.zeros((16, 3), "float32")
    with cs.capture(net, ["net/a", "net/b"], reduce=("mean",), log=True):
        history = net.fit(x, y, batch_size=8, epochs=3, verbose=0,
                          callbacks=[SkipSecondEpoch()]).history
    assert history["net/b:output/mean"] == [2.0, 2.0, 2.0]
    np.testing.assert_array_equal(history["net/a:output/mean"], [6.0, np.nan, 6.0])


def test_log_needs_statistics():
    with pytest.raises(ValueError, match="give `reduce=`"):
        cs.capture(_model(), log=True)
