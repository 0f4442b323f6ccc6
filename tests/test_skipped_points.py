"""A point that some steps (or calls) of a capture skip: a branch its Python took
for one batch. Its full rows would not line up with the data's, so reading them is
refused with the steps named; the points every step reached read whole."""

import keras
import numpy as np
import pytest
from conftest import BACKEND
from models_for_tests import Branching, SkipsOnShortBatches

import callscope as cs

X = np.arange(40, dtype="float32").reshape(20, 2) / 40


def _h(x):
    """A Dense(3) of ones, without bias."""
    return x @ np.ones((x.shape[-1], 3), "float32")


SKIPPED = (r"`net/a:output` was recorded by 2 of the 3 steps of this `predict`: steps "
           r"\[2\] \(numbered from 0\) ran without reaching it .* would not line up with "
           r"the data's rows")


@pytest.mark.parametrize("run_eagerly", [False, True])
@pytest.mark.parametrize("streamed", [False, True])
def test_a_point_that_a_step_skipped_is_refused_not_read_short(run_eagerly, streamed, tmp_path):
    # The last batch (4 rows) skipped `a`: its capture read 16 rows for 20 rows of
    # data, with rows 8:12 holding the data's rows 12:16 in another call's layout
    # (batches of 8, 4, 8), and nothing said so.
    model = SkipsOnShortBatches(name="net")
    model.compile(loss="mse", run_eagerly=run_eagerly)
    to = str(tmp_path / "cap") if streamed else None
    with cs.capture(model, ["net/a", "net/b"], to=to) as cap:
        model.predict(X, batch_size=8, verbose=0)
    readers = [cap] + ([cs.load_capture(to)] if streamed else [])
    for read in readers:
        np.testing.assert_allclose(read["net/b:output"], _h(X), rtol=1e-6)
        if BACKEND == "tensorflow" and not run_eagerly:  # every step ran `a`
            np.testing.assert_allclose(read["net/a:output"], _h(_h(X)), rtol=1e-6)
            continue
        with pytest.raises(ValueError, match=SKIPPED):
            read["net/a:output"]
        with pytest.raises(ValueError, match=SKIPPED):
            read.calls[0]["net/a:output"]
        assert "net/a:output" in read.calls[0]  # (Mapping's `in` read the rows: it raised)


@pytest.mark.parametrize("streamed", [False, True])
def test_rows_joined_over_calls_are_refused_where_a_call_did_not_record_the_point(
        streamed, tmp_path):
    # A second call that never reached `a`: `cap[key]` joined the first call's 8 rows
    # alone, for 12 rows of data.
    model = Branching(name="net")
    model.compile(loss="mse", run_eagerly=True)
    to = str(tmp_path / "cap") if streamed else None
    with cs.capture(model, "net/a", to=to) as cap:
        model.predict(X[:8], verbose=0)
        model.use_a = False
        model.predict(X[8:12], verbose=0)
        model.use_a = True
        model.predict(X[12:], verbose=0)
    for read in [cap] + ([cs.load_capture(to)] if streamed else []):
        with pytest.raises(ValueError,
                           match=r"not by cap.calls\[1\] .*Received: 3 calls, 1 without"):
            read["net/a:output"]
        np.testing.assert_allclose(read.calls[0]["net/a:output"], _h(_h(X[:8])), rtol=1e-6)
        with pytest.raises(KeyError, match="this call recorded nothing"):  # ("Nearest keys: []")
            read.calls[1]["net/a:output"]
        np.testing.assert_allclose(read.calls[2]["net/a:output"], _h(_h(X[12:])), rtol=1e-6)


def test_statistics_of_a_point_some_steps_skipped_are_over_the_rows_that_reached_it():
    model = SkipsOnShortBatches(name="net")
    model.compile(loss="mse", run_eagerly=True)
    with cs.capture(model, "net/a", reduce=("mean",)) as stats:
        model.predict(X, batch_size=8, verbose=0)
    np.testing.assert_allclose(stats["net/a:output/mean"], _h(_h(X[:16])).mean(), rtol=1e-6)


def test_a_scope_whose_calls_skipped_a_point_an_earlier_call_ran_says_so():
    # The error said the point had none of the kinds asked for (`output`), which it
    # has: the model's record of the points it ran spans every earlier call.
    model = Branching(name="net")
    model.compile(loss="mse", run_eagerly=True)
    with cs.capture(model, "net/a"):
        model.predict(X, verbose=0)
    model.use_a = False
    with pytest.raises(ValueError, match=r"\['net/a'\] matched \(points that earlier calls "
                       r"ran\), but no call in this scope ran them"):
        with cs.capture(model, "net/a"):
            model.predict(X, verbose=0)


def test_steps_of_one_execution_that_record_different_points_say_what_to_do():
    # Keras joins the outputs of the steps of one execution, which then differ:
    # its error named a key of callscope's, and nothing what to do.
    if BACKEND == "torch":
        pytest.skip("Keras's torch backend only supports steps_per_execution=1")
    model = SkipsOnShortBatches(name="net")
    model.compile(loss="mse", steps_per_execution=3)
    for select in ("net/a", ["net/a", "net/b"]):  # (Keras's error differs)
        with pytest.raises(ValueError, match=r"several steps per execution \(steps_per_"
                           r"execution=3\)\. If this error is Keras joining the outputs .* "
                           r"compile with steps_per_execution=1"):
            with cs.capture(model, select):
                model.predict(X, batch_size=8, verbose=0)
        model.set_weights([np.ones((2, 3)), np.zeros(3), np.ones((3, 3)), np.zeros(3)])


def test_a_call_read_before_its_first_step_ended_says_so():
    model = SkipsOnShortBatches(name="net")
    model.compile(loss="mse")
    said = []

    class Read(keras.callbacks.Callback):
        def on_predict_batch_begin(self, batch, logs=None):
            if batch == 0:
                with pytest.raises(KeyError, match="no step of this call has ended yet") as e:
                    cap.calls[0]["net/b:output"]
                said.append(str(e.value))

    with cs.capture(model, "net/b") as cap:
        model.predict(X, batch_size=8, verbose=0, callbacks=[Read()])
    assert len(said) == 1

    class Fail(keras.callbacks.Callback):
        def on_predict_begin(self, logs=None):
            raise RuntimeError("stop")

    with cs.capture(model, "net/b") as cap:
        with pytest.raises(RuntimeError, match="stop"):
            model.predict(X, batch_size=8, verbose=0, callbacks=[Fail()])
    with pytest.raises(KeyError, match=r"this call ran no step \(it raised first\)"):
        cap.calls[0]["net/b:output"]
