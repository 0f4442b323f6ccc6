"""The host data path of captures: buffers, the landing of each step, the writer.

Structure, not time: device arrays held by a capture while the number of batches
grows 4x, reallocations and copies when reading, host transfers per step, files
opened per run, and the writer's errors and backpressure. Values are checked
against a stock Keras model.
"""

import os
import shutil
import threading
import time

import keras
import numpy as np
import pytest
from conftest import BACKEND

import callscope as cs
from callscope import _backend, _sinks, _writer

JIT = [False, "auto"]
WIDE = 64
rng = np.random.default_rng(0)


def _model(jit_compile="auto"):
    keras.utils.set_random_seed(0)
    model = cs.Sequential([keras.Input((8,)), keras.layers.Dense(WIDE, name="wide"),
                           keras.layers.Dense(1, name="out")], name="m")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", jit_compile=jit_compile)
    return model


def _wide(model, x):
    """The stock Keras reference: the `wide` layer's outputs."""
    return keras.Model(model.inputs, model.get_layer("wide").output).predict(x, verbose=0)


class _EachBatch(keras.callbacks.Callback):
    def __init__(self, fn):
        super().__init__()
        self.fn, self.seen = fn, []

    def on_predict_batch_end(self, batch, logs=None):
        self.seen.append(self.fn(batch))


def _captured_bytes_on_device(batch):
    """Bytes of live device arrays shaped like one captured batch (JAX)."""
    import jax

    return sum(a.nbytes for a in jax.live_arrays() if a.shape == (batch, WIDE))


@pytest.mark.parametrize("jit_compile", JIT)
def test_device_memory_stays_flat_while_batches_grow_4x(jit_compile):
    model, batch = _model(jit_compile), 16
    held = {}
    for steps in (8, 32):
        x = rng.normal(size=(steps * batch, 8)).astype("float32")
        with cs.capture(model, "*/wide") as cap:
            probe = _EachBatch(lambda b: (
                cap.calls[-1]._landing.held(),
                _captured_bytes_on_device(batch) if BACKEND == "jax" else 0))
            model.predict(x, batch_size=batch, verbose=0, callbacks=[probe])
            held[steps] = probe.seen
            np.testing.assert_allclose(cap["m/wide:output"], _wide(model, x), rtol=1e-5,
                                       atol=1e-5)
            assert isinstance(cap["m/wide:output"], np.ndarray)
    # At most one step's arrays are on their way (JAX lands one step late, so the
    # device runs ahead); TF and torch on the CPU land at once.
    arrays = max(h for h, _ in held[32])
    assert arrays == (1 if BACKEND == "jax" else 0)
    assert max(h for h, _ in held[32]) == max(h for h, _ in held[8])
    if BACKEND == "jax":
        peak_8, peak_32 = (max(b for _, b in held[s]) for s in (8, 32))
        assert peak_32 <= peak_8 <= 2 * batch * WIDE * 4  # one step's, twice at most
        assert _captured_bytes_on_device(batch) == 0  # all landed when the call ended


class _HeldAtEachTrainBatch(keras.callbacks.Callback):
    """Records how many arrays `capture`'s run still has on their way, as each
    train batch begins (batch begin, not end: Keras's loop stays asynchronous)."""

    def __init__(self, capture):
        super().__init__()
        self.capture, self.held = capture, []

    def on_train_batch_begin(self, batch_index, logs=None):
        calls = self.capture.calls
        landing = calls[-1]._landing if calls else None
        self.held.append(landing.held() if landing is not None else 0)


def test_statistics_only_steps_land_without_making_fit_wait_for_each_step():
    # Steps long enough (large matmuls) that the last one is still running when
    # fit's loop dispatches the next: a stats-only capture lets its packed rows
    # wait (JAX), where landing each one a step late made the loop wait for the
    # device at every step. Full tensors still land one step late (the test above).
    keras.utils.set_random_seed(0)
    model = cs.Sequential([keras.Input((512,)), keras.layers.Dense(512, name="wide"),
                           *[keras.layers.Dense(512) for _ in range(5)],
                           keras.layers.Dense(1, name="out")], name="m")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    batch, steps = 512, 8
    x = rng.normal(size=(steps * batch, 512)).astype("float32")
    y = rng.normal(size=(len(x), 1)).astype("float32")
    model.fit(x, y, batch_size=batch, verbose=0)  # compiled before the capture
    with cs.capture(model, "*/wide", reduce=("mean", "std")) as stats:
        probe = _HeldAtEachTrainBatch(stats)
        model.fit(x, y, batch_size=batch, shuffle=False, verbose=0, callbacks=[probe])
    held = probe.held
    assert len(held) == steps
    if BACKEND == "jax":  # one packed array a step; some steps' rows waited together
        assert max(held) <= _sinks.STATS_AHEAD
        if _backend._jax_on_host():  # a GPU may finish each step before the next
            assert max(held) >= 2
    else:  # TF and torch on the CPU land each step at once
        assert max(held) == 0
    wide = _per_batch(keras.Model(model.inputs, model.get_layer("wide").output)
                      .predict(x, batch_size=batch, verbose=0), batch)
    np.testing.assert_allclose(stats["m/wide:output/mean"],
                               [b.astype(np.float64).mean() for b in wide], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["m/wide:output/std"],
                               [b.astype(np.float64).std() for b in wide], rtol=1e-5)


def test_statistics_rows_wait_no_more_than_their_bound_and_land_in_order(monkeypatch):
    # A device that never says a step is done (JAX's `is_ready` always False):
    # rows wait until the bound, then land first in, first out; all of them
    # by the end of the call, each the step it came from.
    monkeypatch.setattr(_backend, "is_ready", lambda handles: False)
    model, batch = _model(), 2
    steps = _sinks.STATS_AHEAD + 6
    x = rng.normal(size=(steps * batch, 8)).astype("float32")
    y = rng.normal(size=(len(x), 1)).astype("float32")
    with cs.capture(model, "*/wide", reduce="max") as stats:
        probe = _HeldAtEachTrainBatch(stats)
        model.fit(x, y, batch_size=batch, shuffle=False, verbose=0, callbacks=[probe])
    held = probe.held
    if BACKEND == "jax":
        assert held[:_sinks.STATS_AHEAD + 1] == list(range(_sinks.STATS_AHEAD + 1))
        assert max(held) == _sinks.STATS_AHEAD
    else:
        assert max(held) == 0
    np.testing.assert_allclose(stats["m/wide:output/max"],
                               [b.max() for b in _per_batch(_wide(model, x), batch)],
                               rtol=1e-6)


@pytest.mark.parametrize("jit_compile", JIT)
def test_reading_during_a_run_gives_the_rows_so_far_as_a_view(jit_compile):
    model, batch = _model(jit_compile), 4
    x = rng.normal(size=(10 * batch, 8)).astype("float32")
    reference = _wide(model, x)
    with cs.capture(model, "*/wide") as cap:
        probe = _EachBatch(lambda b: np.array(cap["m/wide:output"]))
        model.predict(x, batch_size=batch, verbose=0, callbacks=[probe])
        for step, rows in enumerate(probe.seen):
            np.testing.assert_allclose(rows, reference[:(step + 1) * batch], rtol=1e-5,
                                       atol=1e-5)
        first, again = cap["m/wide:output"], cap["m/wide:output"]
    # Reading copies nothing: each read is a read-only view of the one buffer.
    assert np.shares_memory(first, again)
    assert not first.flags.writeable
    buffer = cap.calls[0]._full["m/wide:output"]
    assert buffer.grows <= int(np.ceil(np.log2(10)))


@pytest.mark.parametrize("streamed", [False, True])
def test_a_key_over_several_calls_is_read_only_too(streamed, tmp_path):
    """Several predicts concatenate: a copy, read-only like one call's view (and
    one streamed call's memmap)."""
    model = _model(False)
    x = rng.normal(size=(12, 8)).astype("float32")
    reference = _wide(model, x)
    with cs.capture(model, "*/wide", to=tmp_path / "c" if streamed else None) as cap:
        model.predict(x[:8], batch_size=4, verbose=0)
        model.predict(x[8:], batch_size=4, verbose=0)
    both = cap["m/wide:output"]
    np.testing.assert_allclose(both, reference, rtol=1e-5, atol=1e-5)
    assert not both.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        both[0, 0] = 1.0
    one = cap.calls[1]["m/wide:output"]
    np.testing.assert_allclose(one, reference[8:], rtol=1e-5, atol=1e-5)
    assert not one.flags.writeable
    assert isinstance(one, np.memmap) == streamed


def test_a_buffer_grows_geometrically_and_a_read_never_copies():
    buffer = _sinks.HostBuffer("k")
    views = []
    for step in range(800):
        buffer.append(np.full((256, 4), step, np.float32))
        if step in (99, 799):
            views.append(buffer.view())
    assert buffer.grows <= 10  # log2(800) reallocations, not 800
    early, late = views
    assert early.shape == (100 * 256, 4) and late.shape == (800 * 256, 4)
    assert np.shares_memory(late, buffer.view())
    np.testing.assert_array_equal(late[::256, 0], np.arange(800))
    np.testing.assert_array_equal(early[::256, 0], np.arange(100))  # still valid


@pytest.mark.parametrize("hold", ["array", "slice", "memoryview", "capture"])
def test_a_buffer_is_reused_only_once_nothing_refers_to_it(hold):
    """A dropped capture's host buffer serves the next capture of its size (no
    fresh pages); one still referred to, by any view or by its capture, is never
    written again: its values stay those of its own call."""
    model = _model()
    x = rng.normal(size=(4096, 8)).astype("float32")  # 1 MiB of `wide` rows

    def captured(data):
        cap = cs.capture(model, "*/wide")
        with cap:
            model.predict(data, batch_size=256, verbose=0)
        return cap

    first = captured(x)
    array = first["m/wide:output"]
    kept = {"array": array, "slice": array[10:20].T, "memoryview": memoryview(array),
            "capture": first}[hold]
    expected = np.array(array)
    address = array.__array_interface__["data"][0]
    del array, first
    second = captured(x * 2.0)  # same size: must not take the kept buffer
    held = kept["m/wide:output"] if hold == "capture" else np.asarray(kept)
    np.testing.assert_array_equal(held, expected if hold != "slice" else expected[10:20].T)
    np.testing.assert_allclose(second["m/wide:output"], _wide(model, x * 2.0), rtol=1e-5,
                               atol=1e-5)
    assert second["m/wide:output"].__array_interface__["data"][0] != address
    del kept, held, second
    pooled = {b.__array_interface__["data"][0] for b in _sinks._recycled._buffers}
    assert address in pooled
    third = captured(x * 3.0)  # every reference gone: a pooled buffer is reused
    assert third["m/wide:output"].__array_interface__["data"][0] in pooled
    np.testing.assert_allclose(third["m/wide:output"], _wide(model, x * 3.0), rtol=1e-5,
                               atol=1e-5)


def test_a_batch_of_another_shape_reads_as_a_clear_error():
    buffer = _sinks.HostBuffer("net/x:output")
    buffer.append(np.zeros((2, 3)))
    buffer.append(np.zeros((2, 5)))
    with pytest.raises(ValueError, match=r"changed shape from \(N, 3\) to \(2, 5\).*"
                                         r"whose rows are not its first axis with "
                                         r"`cs.sow\(..., batch_axis=\)`.*"
                                         r"Received: a batch of shape \(2, 5\)"):
        buffer.view()


@pytest.mark.parametrize("jit_compile", JIT)
def test_each_step_crosses_to_the_host_once_and_statistics_merge_as_they_arrive(
        jit_compile, monkeypatch):
    # Past one block of merged rows (64) where the step is compiled; uncompiled
    # steps are slow on JAX, and merge on the same host path.
    model, batch, steps = _model(jit_compile), 4, 80 if jit_compile else 6
    x = rng.normal(size=(steps * batch, 8)).astype("float32")
    transfers = []
    to_host = _backend.to_host
    monkeypatch.setattr(_backend, "to_host", lambda h: transfers.append(len(h)) or to_host(h))
    with cs.capture(model, ("*/wide", "*/out"), reduce=("mean", "std", "max", "hist"),
                    hist_range=(-4, 4), bins=8) as stats, \
            cs.capture(model, "*/out") as full:
        model.predict(x, batch_size=batch, verbose=0)
    # One transfer per step for every point of both captures: the full tensor, and
    # one array for every partial (n, mean, sd, max, hist) of the 2 points.
    assert len(transfers) == steps
    assert set(transfers) == {2}
    # Merged as they arrive: the host keeps less than a block of rows, not a row a step.
    running = stats.calls[0]._stats["m/wide:output"]
    assert len(running._block) == (steps % 64 if jit_compile else steps)
    reference = _wide(model, x)
    assert stats["m/wide:output/mean"] == pytest.approx(reference.mean(), rel=1e-5, abs=1e-6)
    assert stats["m/wide:output/std"] == pytest.approx(reference.std(), rel=1e-5)
    assert stats["m/wide:output/max"] == pytest.approx(reference.max(), rel=1e-6)
    np.testing.assert_array_equal(
        stats["m/wide:output/hist"],
        np.histogram(np.clip(reference, -4, 4), bins=8, range=(-4, 4))[0])
    assert full["m/out:output"].shape == (steps * batch, 1)


def _watched_open(on_open=lambda path: None, on_write=lambda: None):
    """An `open` for the writer (set as `_writer.open`) whose files call
    `on_open(path)` and `on_write()` before the real file's open and write."""

    class Watched:
        def __init__(self, path, mode):
            on_open(path)
            self._file = open(path, mode)  # noqa: SIM115 - closed by the writer

        def write(self, data):
            on_write()
            return self._file.write(data)

        def flush(self):
            self._file.flush()

        def close(self):
            self._file.close()

    return Watched


@pytest.mark.parametrize("jit_compile", JIT)
def test_streaming_opens_each_file_once_and_writes_on_the_writer_thread(
        tmp_path, jit_compile, monkeypatch):
    model, batch = _model(jit_compile), 4
    x = rng.normal(size=(12 * batch, 8)).astype("float32")
    opened, writers = [], set()
    counted = _watched_open(on_open=lambda path: opened.append(os.path.basename(path)),
                            on_write=lambda: writers.add(threading.current_thread().name))
    monkeypatch.setattr(_writer, "open", counted, raising=False)
    with cs.capture(model, ("*/wide", "*/out"), to=tmp_path / "caps") as cap:
        model.predict(x, batch_size=batch, verbose=0)
    assert sorted(opened) == ["0000.bin", "0001.bin"]  # once per file, not per batch
    assert writers == {"callscope-writer"}
    assert not any(t.name == "callscope-writer" for t in threading.enumerate())
    np.testing.assert_allclose(cap["m/wide:output"], _wide(model, x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cs.load_capture(tmp_path / "caps")["m/wide:output"],
                               _wide(model, x), rtol=1e-5, atol=1e-5)


class _Refilled(keras.layers.Layer):
    """Returns one tensor that it refills in place at each call (a torch layer
    keeping a buffer across calls, as a cache does); elsewhere a copy."""

    def call(self, x):
        if BACKEND != "torch":
            return keras.ops.copy(x)
        import torch

        buffer = self.__dict__.get("_buffer")
        if buffer is None or buffer.shape != x.shape:
            buffer = self.__dict__["_buffer"] = torch.empty_like(x)
        with torch.no_grad():
            buffer.copy_(x)
        return buffer


def test_a_streamed_batch_is_written_as_its_step_left_it(tmp_path, monkeypatch):
    # torch reads a step's tensors in place (no copy on the way to the host); the
    # writer, held up here, writes a batch steps later, after the layer refilled
    # its buffer. Each streamed batch must still be its own step's rows.
    slow = _watched_open(on_write=lambda: time.sleep(0.01))
    monkeypatch.setattr(_writer, "open", slow, raising=False)
    model = cs.Sequential([keras.Input((8,)), _Refilled(name="r")], name="m")
    x = np.repeat(np.arange(24, dtype="float32")[:, None], 8, axis=1)
    with cs.capture(model, "*/r", to=tmp_path / "caps") as cap:
        model.predict(x, batch_size=4, verbose=0)
    np.testing.assert_array_equal(cap["m/r:output"], x)
    np.testing.assert_array_equal(cs.load_capture(tmp_path / "caps")["m/r:output"], x)


@pytest.mark.parametrize("jit_compile", JIT)
def test_a_writer_error_surfaces_in_the_caller_and_the_index_says_what_is_on_disk(
        tmp_path, jit_compile):
    model, batch = _model(jit_compile), 4
    x = rng.normal(size=(12 * batch, 8)).astype("float32")
    references = {"m/wide:output": _wide(model, x), "m/out:output": model.predict(x, verbose=0)}
    target = tmp_path / "caps"
    with pytest.raises(_writer.WriteError) as raised:
        with cs.capture(model, ("*/wide", "*/out"), to=target):
            # The second key's file already exists: the writer refuses to truncate it.
            os.makedirs(target / "call_000")
            (target / "call_000" / "0001.bin").write_bytes(b"not ours")
            model.predict(x, batch_size=batch, verbose=0)
    message = str(raised.value)
    assert "could not write its files" in message
    assert message.endswith(f"Received: file={str(target / 'call_000' / '0001.bin')!r}")
    assert "File exists" in message  # the cause (Keras drops `__cause__` on the way out)
    # Raised when the run ended, not inside Keras's loop: the model keeps its weights.
    np.testing.assert_allclose(model.predict(x, verbose=0), references["m/out:output"],
                               rtol=1e-6)
    assert not any(t.name == "callscope-writer" for t in threading.enumerate())
    # What the index holds is on disk: the rows written before the error.
    loaded = cs.load_capture(target)
    rows = {key: len(loaded[key]) for key in references}
    assert sorted(rows.values())[0] == 0 and sorted(rows.values())[1] > 0
    for key, reference in references.items():
        np.testing.assert_allclose(loaded[key], reference[:rows[key]], rtol=1e-5, atol=1e-5)


def test_a_failed_capture_stops_its_own_loop_and_no_other(tmp_path):
    # A sink's failure stops the failing call at its next step. Keras's `stop_*`
    # flags belong to the model, so they would stop another thread's call too,
    # silently short; and the failing fit keeps the weights of its last step, also
    # where that next step is a new epoch's, after validation (on JAX its state
    # then holds the only copy of the weights).
    model, batch = _model(), 4
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    x = rng.normal(size=(64 * batch, 8)).astype("float32")
    y = rng.normal(size=(64 * batch, 1)).astype("float32")
    many = rng.normal(size=(4000, 8)).astype("float32")
    reference = model.predict(many, verbose=0)
    start = model.get_weights()

    def twin_path(rows, epochs):
        """The weights after each step of a fit of the first `rows` rows."""
        twin = keras.Sequential([keras.Input((8,)), keras.layers.Dense(WIDE),
                                 keras.layers.Dense(1)])
        twin.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        twin.set_weights(start)
        path = [twin.get_weights()]
        for i in [i for _ in range(epochs) for i in range(0, rows, batch)]:
            twin.train_on_batch(x[i:i + batch], y[i:i + batch])
            path.append(twin.get_weights())
        return path

    def failing(name, method, rows=64 * batch, pause=0.0, **kwargs):
        target, steps = tmp_path / name, []

        def done(b, logs):
            steps.append(b)
            time.sleep(pause)  # time for the writer to fail within the epoch

        counter = keras.callbacks.LambdaCallback(on_train_batch_end=done,
                                                 on_predict_batch_end=done)
        with pytest.raises(_writer.WriteError, match="could not write its files") as raised:
            with cs.capture(model, "*/wide", to=target):
                os.makedirs(target / "call_000")
                (target / "call_000" / "0000.bin").write_bytes(b"not ours")  # refused
                started.wait(10)
                getattr(model, method)(x[:rows], batch_size=batch, verbose=0,
                                       callbacks=[counter], **kwargs)
        assert not getattr(raised.value, "__notes__", None)  # the weights were put back
        return steps

    started, results = threading.Event(), {}

    def other():
        started.set()
        results["other"] = model.predict(many, batch_size=2, verbose=0)

    thread = threading.Thread(target=other)
    thread.start()
    steps = failing("predict", "predict")
    thread.join(120)
    assert len(steps) < 64  # stopped early, at a step after the failure
    np.testing.assert_allclose(results["other"], reference, rtol=1e-5, atol=1e-6)  # 4000 rows

    started.set()
    for name, rows, epochs, pause, extra in (
            ("fit", len(x), 1, 0.0, {}),
            ("fit_validated", 3 * batch, 6, 0.1, {"validation_data": (x[:8], y[:8])})):
        model.set_weights(start)
        steps = failing(name, "fit", rows, pause, y=y[:rows], epochs=epochs, shuffle=False,
                        **extra)
        path = twin_path(rows, epochs)
        assert 0 < len(steps) < len(path) - 1
        for ours, theirs in zip(model.get_weights(), path[len(steps)]):
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
        model.predict(x, verbose=0)  # the model runs on
    model.fit(x, y, batch_size=batch, verbose=0)


class _Stalled:
    """A file whose writes wait for `go`, then fail with `error` (if given)."""

    def __init__(self, go, error=None):
        self.go, self.error, self.written = go, error, 0

    def write(self, data):
        self.go.wait()
        if self.error is not None:
            raise self.error
        self.written += len(data)

    def flush(self):
        pass

    def close(self):
        pass


def test_a_full_queue_makes_the_caller_wait_and_a_failure_wakes_it(tmp_path, monkeypatch):
    go = threading.Event()
    stalled = _Stalled(go, OSError(28, "No space left on device"))
    monkeypatch.setattr(_writer, "open", lambda path, mode: stalled, raising=False)
    writer = _writer.Writer(limit=1000)
    chunk = np.zeros(100, np.float32)  # 400 bytes: two fit in the queue, a third waits
    path = str(tmp_path / "f.bin")
    for _ in range(2):
        writer.write(path, chunk, lambda: None)
    raised = []

    def third():
        try:
            writer.write(path, chunk, lambda: None)
        except _writer.WriteError as error:
            raised.append(error)

    blocked = threading.Thread(target=third)
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive()  # backpressure: the queue holds its limit
    assert writer._bytes <= 1000
    go.set()  # the write fails: the waiting caller wakes with the error
    blocked.join(10)
    assert not blocked.is_alive() and "No space left on device" in str(raised[0])
    with pytest.raises(_writer.WriteError, match="No space left on device"):
        writer.close()
    with pytest.raises(_writer.WriteError):
        writer.drain()


def test_a_run_that_fails_still_closes_its_files(tmp_path):
    model, batch = _model(), 4
    x = rng.normal(size=(6 * batch, 8)).astype("float32")
    # Before the run: a callback that raises in a JAX predict leaves the model
    # without weights, as in stock Keras 3.15.1.
    reference = _wide(model, x)

    class Stop(keras.callbacks.Callback):
        def on_predict_batch_end(self, batch, logs=None):
            if batch == 2:
                raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        with cs.capture(model, "*/wide", to=tmp_path / "caps"):
            model.predict(x, batch_size=batch, verbose=0, callbacks=[Stop()])
    assert not any(t.name == "callscope-writer" for t in threading.enumerate())
    wide = cs.load_capture(tmp_path / "caps")["m/wide:output"]
    assert len(wide) >= 3 * batch  # every step that returned, flushed and closed
    np.testing.assert_allclose(wide, reference[:len(wide)], rtol=1e-5, atol=1e-5)


class _Growing(keras.utils.PyDataset):
    """Batches whose sequence length grows: a streamed key changes shape."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        return (np.ones((2, 3 + index, 4), "float32"),)


def test_a_streamed_key_that_changes_shape_stops_the_loop_and_raises_at_the_end(tmp_path):
    keras.utils.set_random_seed(0)
    model = cs.Sequential([keras.Input((None, 4)), keras.layers.Dense(3, name="d"),
                           keras.layers.GlobalAveragePooling1D(name="pool")], name="s")
    expected = model.predict(np.ones((2, 3, 4), "float32"), verbose=0)
    steps = _EachBatch(lambda b: b)
    with pytest.raises(ValueError, match=r"changed shape from \(N, \[3, 3\]\) to \(2, 4, 3\)"
                       r".*`cs.sow\(..., batch_axis=\)`"):
        with cs.capture(model, "s/d", to=tmp_path / "caps"):
            model.predict(_Growing(), verbose=0, callbacks=[steps])
    # The loop stopped at once (a step later where the copy lags), not after 8 steps.
    assert len(steps.seen) <= 3
    np.testing.assert_allclose(model.predict(np.ones((2, 3, 4), "float32"), verbose=0),
                               expected, rtol=1e-6)


class _GrowingPairs(keras.utils.PyDataset):
    """Two batches of (x, y), the second one longer: a streamed key changes shape."""

    def __len__(self):
        return 2

    def __getitem__(self, index):
        return np.ones((2, 3 + index, 4), "float32"), np.zeros((2, 3), "float32")


def test_fit_and_its_validation_failing_alike_raise_one_message(tmp_path):
    keras.utils.set_random_seed(0)
    model = cs.Sequential([keras.Input((None, 4)), keras.layers.Dense(3, name="d"),
                           keras.layers.GlobalAveragePooling1D(name="pool")], name="s")
    model.compile(optimizer="sgd", loss="mse")
    message = r"changed shape from \(N, \[3, 3\]\) to \(2, 4, 3\)"
    # fit's own streamed key fails at its last step, and so does its validation's:
    # two failures that read the same are reported once, not again as a note.
    with pytest.raises(ValueError, match=message) as raised:
        with cs.capture(model, "s/d", to=tmp_path / "caps"):
            model.fit(_GrowingPairs(), validation_data=_GrowingPairs(), verbose=0)
    assert not getattr(raised.value, "__notes__", None)


def test_a_call_whose_last_step_fails_to_stream_is_a_failed_call(tmp_path):
    # The last step lands when the run ends, after Keras's loop: its failure is
    # raised there, and the call that raised it is failed like any other (it was
    # not: its rows stopped a step short, read alone and joined, with no word).
    model = cs.Sequential([keras.Input((None, 4)), keras.layers.Dense(3, name="d"),
                           keras.layers.GlobalAveragePooling1D(name="pool")], name="s")
    with pytest.raises(ValueError, match=r"changed shape from \(N, \[3, 3\]\) to \(2, 4, 3\)"):
        with cs.capture(model, "s/d", to=tmp_path / "caps") as cap:
            model.predict(np.ones((2, 3, 4), "float32"), verbose=0)
            model.predict(_GrowingPairs(), verbose=0)
    assert [call.failed for call in cap.calls] == [False, True]
    assert cap.calls[1]["s/d:output"].shape == (2, 3, 3)  # its first step's rows
    with pytest.warns(UserWarning, match=r"2 calls, of which cap.calls\[1\] raised"):
        assert cap["s/d:output"].shape == (4, 3, 3)
    loaded = cs.load_capture(tmp_path / "caps")
    assert [call.failed for call in loaded.calls] == [False, True]
    with pytest.warns(UserWarning, match=r"cap.calls\[1\] raised"):
        assert loaded["s/d:output"].shape == (4, 3, 3)


@pytest.mark.parametrize("at", [3, 8])  # a middle step's values, and the last one's
@pytest.mark.parametrize("to", [True, False])
def test_an_interrupt_while_a_step_lands_leaves_rows_that_line_up(to, at, tmp_path,
                                                                  monkeypatch):
    # Ctrl-C while the caller waits for room in the writer's queue (a slow disk),
    # or adds a step in memory: that step is half added. Where full tensors land a
    # step late (JAX), the step behind it landed at the run's end in its place;
    # and the last step lands at the run's end, where the interrupt left the
    # writer running after the scope, under an index that counted less.
    model, batch = _model(), 4
    x = rng.normal(size=(8 * batch, 8)).astype("float32")
    calls = []
    if to:
        write = _writer.Writer.write

        def interrupted(self, *args):
            calls.append(1)
            if len(calls) == at:
                raise KeyboardInterrupt
            return write(self, *args)

        monkeypatch.setattr(_writer.Writer, "write", interrupted)
    else:
        append = _sinks.HostBuffer.append

        def interrupted(self, array):
            calls.append(1)
            if len(calls) == at:
                raise KeyboardInterrupt
            return append(self, array)

        monkeypatch.setattr(_sinks.HostBuffer, "append", interrupted)
    plain = model.predict(x, verbose=0)
    with pytest.raises(KeyboardInterrupt):
        with cs.capture(model, "m/wide", to=tmp_path / "caps" if to else None) as cap:
            model.predict(x, batch_size=batch, verbose=0)
    monkeypatch.undo()
    assert not [t for t in threading.enumerate() if t.name == "callscope-writer"]
    assert cap.calls[0].failed
    # Raised before the next step, not inside the step's end: JAX keeps the state
    # that step returned (its input was donated), so the weights are there.
    np.testing.assert_allclose(model.predict(x, verbose=0), plain, rtol=1e-6)
    expected = _wide(model, x)
    captured = [cap.calls[0]["m/wide:output"]]
    if to:
        captured.append(cs.load_capture(tmp_path / "caps").calls[0]["m/wide:output"])
    for rows in captured:
        assert len(rows) == (at - 1) * batch  # the steps before the interrupted one
        np.testing.assert_allclose(rows, expected[:len(rows)], rtol=1e-5, atol=1e-6)


def test_an_interrupt_in_fits_last_step_is_raised_before_its_validation(monkeypatch):
    # Kept for the next step of the same call, it waited through the whole of
    # fit's validation (a call of its own) before it was raised.
    model, batch = _model(), 4
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    x = rng.normal(size=(4 * batch, 8)).astype("float32")
    y = rng.normal(size=(4 * batch, 1)).astype("float32")
    copies, validated = [], []
    start = _backend.start_host_copy

    def interrupted(leaves):
        copies.append(1)
        if len(copies) == 4:  # the last training step's
            raise KeyboardInterrupt
        return start(leaves)

    class Counts(keras.callbacks.Callback):
        def on_test_batch_end(self, index, logs=None):
            validated.append(index)

    monkeypatch.setattr(_backend, "start_host_copy", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with cs.capture(model, "m/wide") as cap:
            model.fit(x, y, batch_size=batch, validation_data=(x, y), verbose=0,
                      callbacks=[Counts()])
    monkeypatch.undo()
    assert validated == []
    assert [call.failed for call in cap.calls] == [True, True]  # fit, and its validation
    assert np.isfinite(model.predict(x, verbose=0)).all()  # (JAX: the weights are back)


def test_an_interrupt_while_the_writer_catches_up_closes_its_files_first(tmp_path, monkeypatch):
    # Ctrl-C while the run's end waits for a slow disk: the writer wrote on after
    # the scope exited, under an index that counted none of it, and the capture
    # read more rows later than at once.
    model, batch = _model(), 4
    x = rng.normal(size=(16 * batch, 8)).astype("float32")

    class Slow:
        def __init__(self, file):
            self.file = file

        def write(self, data):
            time.sleep(0.05)
            return self.file.write(data)

        def __getattr__(self, name):
            return getattr(self.file, name)

    class Interrupted:
        def __init__(self, thread):
            self.thread, self.joins = thread, 0

        def join(self):
            self.joins += 1
            if self.joins == 1:
                raise KeyboardInterrupt
            self.thread.join()

    monkeypatch.setattr(_writer, "open", lambda path, mode: Slow(open(path, mode)), raising=False)
    init = _writer.Writer.__init__

    def interrupted_at_close(self, *args):
        init(self, *args)
        self._thread = Interrupted(self._thread)

    monkeypatch.setattr(_writer.Writer, "__init__", interrupted_at_close)
    with pytest.raises(KeyboardInterrupt):
        with cs.capture(model, "m/wide", to=tmp_path / "caps") as cap:
            model.predict(x, batch_size=batch, verbose=0)
    monkeypatch.undo()
    assert not [t for t in threading.enumerate() if t.name == "callscope-writer"]
    assert cap.calls[0].failed
    rows = cap.calls[0]["m/wide:output"]
    time.sleep(0.2)
    loaded = cs.load_capture(tmp_path / "caps").calls[0]["m/wide:output"]
    assert len(rows) % batch == 0  # (whole steps: most of them still queued, dropped)
    assert len(cap.calls[0]["m/wide:output"]) == len(loaded) == len(rows)
    np.testing.assert_allclose(rows, _wide(model, x)[:len(rows)], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(loaded, rows)


def test_a_capture_directory_removed_while_the_run_streams_stays_removed(tmp_path):
    # The writer made the directories its file needed: it made the capture's
    # again, with no owner, and the scope exited as if all went well.
    model, batch = _model(), 4
    x = rng.normal(size=(4 * batch, 8)).astype("float32")
    target = tmp_path / "caps"

    class Removes(keras.callbacks.Callback):
        def on_predict_batch_end(self, index, logs=None):
            if index == 0:  # (moved first: the writer may be making a file in it)
                os.rename(target, tmp_path / "gone")
                shutil.rmtree(tmp_path / "gone", ignore_errors=True)

    with pytest.raises(_writer.WriteError, match=r"No such file or directory"):
        with cs.capture(model, "m/wide", to=target):
            model.predict(x, batch_size=batch, verbose=0, callbacks=[Removes()])
    assert not target.exists()


# --------------------------------------------------------------------------
# fit's statistics: one packed row per step, each partial a view of it
# --------------------------------------------------------------------------
def _per_batch(values, batch):
    return [values[i:i + batch] for i in range(0, len(values), batch)]


@pytest.mark.parametrize("jit_compile", JIT)
def test_fit_statistics_take_one_append_per_step_however_many_points(
        jit_compile, monkeypatch):
    # (uncompiled steps are slow on JAX: fewer of them, every check the same)
    model, batch, steps = _model(jit_compile), 8, 6 if jit_compile else 3
    x = rng.normal(size=(steps * batch + 3, 8)).astype("float32")  # an uneven last batch
    y = rng.normal(size=(len(x), 1)).astype("float32")
    appends = []
    append = _sinks.HostBuffer.append
    monkeypatch.setattr(_sinks.HostBuffer, "append",
                        lambda self, a: appends.append(self.key) or append(self, a))
    seen = []

    class ReadEachStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch_index, logs=None):
            seen.append(np.array(stats["m/wide:output/mean"]))

    with cs.capture(model, ("*/wide", "*/out"), reduce=("mean", "std", "max", "hist"),
                    hist_range=(-4, 4), bins=8) as stats, \
            cs.capture(model, "*/wide", reduce=("frac_zero", "absmax")) as more, \
            cs.capture(model, "*/out") as full:
        model.fit(x, y, batch_size=batch, shuffle=False, verbose=0, callbacks=[ReadEachStep()])
    # Both statistics captures (3 points, 11 partials) append one packed row a step;
    # the full capture one batch of its key.
    assert appends.count("partials") == steps + 1
    assert appends.count("m/out:output") == steps + 1
    assert len(appends) == 2 * (steps + 1)
    # Read during the run: a step's row is there once the step has landed.
    assert [len(s) for s in seen] == list(range(len(seen) - len(seen[-1]) + 1, len(seen) + 1))
    wide, out = _per_batch(_wide(model, x), batch), _per_batch(full["m/out:output"], batch)
    for name, ref in (("mean", np.mean), ("std", np.std), ("max", np.max)):
        np.testing.assert_allclose(stats[f"m/wide:output/{name}"],
                                   [ref(b.astype(np.float64)) for b in wide], rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_allclose(stats[f"m/out:output/{name}"],
                                   [ref(b.astype(np.float64)) for b in out], rtol=1e-5,
                                   atol=1e-6)
    np.testing.assert_array_equal(
        stats["m/wide:output/hist"],
        [np.histogram(np.clip(b, -4, 4), bins=8, range=(-4, 4))[0] for b in wide])
    np.testing.assert_allclose(more["m/wide:output/absmax"],
                               [np.abs(b).max() for b in wide], rtol=1e-6)
    np.testing.assert_array_equal(more["m/wide:output/frac_zero"],
                                  [np.mean(b == 0) for b in wide])


@pytest.mark.parametrize("jit_compile", JIT)
def test_a_step_traced_with_other_points_gives_every_key_its_own_rows(jit_compile):
    batch, steps = 8, 5

    class Split(keras.layers.Layer):
        """Sows `full` in a step of `batch` rows, `last` in any other (traced apart)."""

        def call(self, x):
            name = "full" if x.shape[0] == batch else "last"
            return cs.sow(self, name, x * 2.0)

    keras.utils.set_random_seed(0)
    model = cs.Sequential([keras.Input((8,)), keras.layers.Dense(WIDE, name="wide"),
                           Split(name="split"), keras.layers.Dense(1, name="out")], name="m")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", jit_compile=jit_compile)
    x = rng.normal(size=(steps * batch + 3, 8)).astype("float32")
    y = rng.normal(size=(len(x), 1)).astype("float32")
    with cs.capture(model, ("*/wide", "*/split/*"), reduce=("mean", "std")) as cap:
        model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
    wide = _per_batch(_wide(model, x), batch)
    # Every step's row, whichever layout it came in (the first steps' were views of
    # one packed row; the last step's layout made each key a buffer of its own).
    np.testing.assert_allclose(cap["m/wide:output/mean"], [b.mean() for b in wide],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cap["m/wide:output/std"], [b.std() for b in wide], rtol=1e-5)
    # TF traces Keras's steps with an unknown batch size: one layout, all `last`.
    split = [cap[f"m/split/{n}:output/mean"] for n in ("full", "last")
             if f"m/split/{n}:output/mean" in cap]
    np.testing.assert_allclose(np.concatenate(split), [2 * b.mean() for b in wide],
                               rtol=1e-5, atol=1e-6)
    gave_up = not any(isinstance(b, _sinks.Columns) for r in cap.calls[0]._steps.values()
                      for b in r.values())
    assert gave_up == (len(split) == 2) == (BACKEND != "tensorflow")
