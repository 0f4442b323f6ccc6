"""Streamed captures (`to=`) at their edges: what a capture reads is what its own
call wrote, or a clear error. Values against a stock Keras sub-model or numpy."""

import asyncio
import contextlib
import contextvars
import errno
import io
import os
import resource
import signal
import threading

import keras
import numpy as np
import pytest
from conftest import BACKEND

import callscope as cs
from callscope import _writer

rng = np.random.default_rng(0)
X = rng.normal(size=(10, 3)).astype("float32")


def _model():
    keras.utils.set_random_seed(0)
    return cs.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="d1"),
                          keras.layers.ReLU(name="relu"), keras.layers.Dense(2, name="d2")],
                         name="m")


def _stock(model, name, x):
    return keras.Model(model.inputs, model.get_layer(name).output).predict(x, verbose=0)


def test_a_capture_whose_directory_was_written_again_refuses_to_read(tmp_path):
    """`overwrite=True` reuses the names `call_000/0000.bin`: an earlier capture,
    live or loaded, read the later capture's rows under its own keys."""
    model = _model()
    with cs.capture(model, "m/d1", to=tmp_path) as first:
        model.predict(X, batch_size=4, verbose=0)
    loaded = cs.load_capture(tmp_path)
    mapped = first["m/d1:output"]  # a memmap taken before: still its own file
    np.testing.assert_allclose(loaded["m/d1:output"], _stock(model, "d1", X), rtol=1e-5)
    with cs.capture(model, "m/relu", to=tmp_path, overwrite=True) as second:
        model.predict(X * 10, batch_size=4, verbose=0)
    for stale in (first, loaded):
        with pytest.raises(ValueError, match="were deleted or replaced") as error:
            stale["m/d1:output"]
        assert str(error.value).endswith("Received: key='m/d1:output'")
    np.testing.assert_allclose(mapped, _stock(model, "d1", X), rtol=1e-5)
    np.testing.assert_allclose(second["m/relu:output"], _stock(model, "relu", X * 10),
                               rtol=1e-5)
    np.testing.assert_allclose(cs.load_capture(tmp_path)["m/relu:output"],
                               _stock(model, "relu", X * 10), rtol=1e-5)


class _Mixed(keras.utils.PyDataset):
    """An int32 batch, then a float32 one."""

    def __len__(self):
        return 2

    def __getitem__(self, index):
        values = np.arange(6).reshape(2, 3) + 1
        return (values.astype("int32") if index == 0 else values.astype("float32") + 0.5,)


class _Raw(cs.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d = keras.layers.Dense(2, name="d")

    def call(self, x):
        return self.d(keras.ops.cast(cs.sow(self, "raw", x * 1), "float32"))


@pytest.mark.parametrize("streamed", [False, True])
def test_a_value_whose_dtype_changes_within_a_call_is_not_cast(tmp_path, streamed):
    """The float batch was cast to the first batch's int32 (2.5 read as 2), though
    the model computed with 2.5."""
    model = _Raw(name="net")
    model(np.ones((1, 3), "float32"))
    to = tmp_path / "caps" if streamed else None
    if BACKEND == "tensorflow":  # Keras's TF loop casts the batch to the first's dtype
        with cs.capture(model, "net/raw", to=to) as cap:
            model.predict(_Mixed(), verbose=0)
        np.testing.assert_array_equal(cap["net/raw:output"][2:], [[1, 2, 3], [4, 5, 6]])
        return
    with pytest.raises(ValueError, match="changed dtype from int32 to float32") as error:
        with cs.capture(model, "net/raw", to=to) as cap:
            model.predict(_Mixed(), verbose=0)
            cap["net/raw:output"]
    assert str(error.value).endswith("Received: a batch of dtype float32")


def test_a_call_in_a_copied_context_is_part_of_the_capture_it_started_in(tmp_path):
    """The scope's exit wrote an index of the rows so far while the thread's call
    went on writing: load_capture read 8 rows of 40, the live capture 40."""
    model = _model()
    x = rng.normal(size=(40, 3)).astype("float32")
    started, proceed = threading.Event(), threading.Event()

    class Slow(keras.callbacks.Callback):
        def on_predict_batch_end(self, batch, logs=None):
            started.set()
            proceed.wait(30)

    with cs.capture(model, "m/d1", to=tmp_path) as cap:
        context = contextvars.copy_context()
        worker = threading.Thread(target=context.run, args=(
            lambda: model.predict(x, batch_size=4, verbose=0, callbacks=[Slow()]),))
        worker.start()
        assert started.wait(60)
        threading.Timer(0.5, proceed.set).start()  # the exit below waits for the call
    worker.join(60)  # it returns after its run ended, which the exit waited for
    expected = _stock(model, "d1", x)
    np.testing.assert_allclose(cap["m/d1:output"], expected, rtol=1e-5)
    np.testing.assert_allclose(cs.load_capture(tmp_path)["m/d1:output"], expected, rtol=1e-5)
    # A call made there after the scope closed has nowhere to go.
    with pytest.raises(RuntimeError, match="after that scope closed"):
        context.run(lambda: model.predict(x, verbose=0))
    np.testing.assert_allclose(model.predict(x, verbose=0), _stock(model, "d2", x), rtol=1e-5)


def test_an_asyncio_task_made_inside_a_capture_that_calls_after_it_closed_is_told_so():
    # The error spoke of `contextvars.copy_context()` only, which the user never
    # called: asyncio copies the context into every task it makes.
    model = _model()

    async def main():
        with cs.capture(model, "m/d1") as cap:
            inside = asyncio.ensure_future(asyncio.sleep(0))
            late = asyncio.ensure_future(_predict_later(model))
            await inside
            model.predict(X, verbose=0)
        with pytest.raises(RuntimeError, match=r"copied inside a cs.capture scope "
                           r"\(`contextvars.copy_context\(\)`, or an asyncio task made "
                           r"there, which copies the context it is made in\) after that "
                           r"scope closed.*await the task inside it"):
            await late
        return cap

    cap = asyncio.run(main())
    np.testing.assert_allclose(cap["m/d1:output"], _stock(model, "d1", X), rtol=1e-5)


async def _predict_later(model):
    await asyncio.sleep(0.05)
    return model.predict(X, verbose=0)


class _Full(io.RawIOBase):
    """A file on a disk with `room` bytes left."""

    def __init__(self, path, room):
        self._file, self._room = open(path, "xb"), room

    def writable(self):
        return True

    def write(self, data):
        if self._room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        data = memoryview(data)[:self._room]
        self._room -= len(data)
        return self._file.write(data)

    def close(self):
        self._file.close()
        super().close()


def test_the_index_counts_only_rows_that_reached_the_disk(tmp_path, monkeypatch):
    """Rows were counted once in the file object's buffer: after a full disk the
    index said 64 rows of 16 bytes where 1000 bytes were on disk, and reading
    failed with "mmap length is greater than file size"."""
    monkeypatch.setattr(_writer, "open", lambda path, mode: io.BufferedWriter(
        _Full(path, room=1000)), raising=False)
    rows = {"n": 0}
    writer = _writer.Writer()
    path = str(tmp_path / "f.bin")
    with pytest.raises(_writer.WriteError, match="No space left on device"):
        for i in range(200):
            writer.write(path, np.full((2, 4), i, "float32"),
                         lambda: rows.__setitem__("n", rows["n"] + 2))
        writer.close()
    writer_rows = rows["n"]
    assert 0 < writer_rows * 16 <= os.path.getsize(path) == 1000
    on_disk = np.fromfile(path, "float32")[:writer_rows * 4].reshape(writer_rows, 4)
    np.testing.assert_array_equal(on_disk[:, 0], np.repeat(np.arange(writer_rows // 2), 2))


@pytest.mark.skipif(BACKEND == "torch", reason="torch has no float8 numpy conversion")
def test_a_float8_value_is_streamed_and_read_back():
    """float8_e5m2's numpy string is '<f1' (kind "f"), which numpy cannot read
    back: streaming it failed with "ml_dtypes has no attribute '<f1'"."""
    import ml_dtypes
    import tempfile

    class Eight(keras.layers.Layer):
        def call(self, x):
            cs.sow(self, "v", keras.ops.cast(x, "float8_e5m2"))
            return x

    model = cs.Sequential([keras.Input((3,)), Eight(name="e")], name="m")
    with tempfile.TemporaryDirectory() as to:
        with cs.capture(model, "m/e/v", to=to) as streamed:
            model.predict(X, batch_size=4, verbose=0)
        loaded = cs.load_capture(to)["m/e/v:output"]
        assert loaded.dtype == np.dtype(ml_dtypes.float8_e5m2)
        np.testing.assert_array_equal(loaded.astype("float32"),
                                      X.astype(ml_dtypes.float8_e5m2).astype("float32"))
        np.testing.assert_array_equal(streamed["m/e/v:output"], loaded)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="string tensors")
def test_a_string_value_streamed_raises_what_to_do_before_the_next_step(tmp_path):
    """It failed at the call's end as a disk error ("Free space on the disk")."""
    inputs = keras.Input((1,), dtype="string")
    lookup = keras.layers.StringLookup(vocabulary=["a", "b"], name="lookup")
    model = cs.Model(inputs, lookup(inputs), name="m")
    import tensorflow as tf

    words = tf.constant([["a"], ["b"], ["c"], ["a"]])
    with cs.capture(model, "m/lookup", kinds=("input",)) as held:
        model.predict(words, batch_size=2, verbose=0)
    assert held["m/lookup:input"].ravel().tolist() == [b"a", b"b", b"c", b"a"]
    with pytest.raises(ValueError, match="holds strings, which cannot be streamed") as error:
        with cs.capture(model, "m/lookup", kinds=("input",), to=tmp_path):
            model.predict(words, batch_size=2, verbose=0)
    assert "Capture it without `to=`" in str(error.value)


def test_to_refuses_an_empty_path_and_overwrite_keeps_a_linked_directory(tmp_path,
                                                                        monkeypatch):
    """`to=""` was the working directory, which overwrite=True emptied; a link to
    a directory raised "Cannot call rmtree on a symbolic link"."""
    model = _model()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "precious.txt").write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(ValueError, match="got an empty path") as error:
            with cs.capture(model, "m/d1", to="", overwrite=overwrite):
                model.predict(X, verbose=0)
        assert str(error.value).endswith("Received: to=''")
    # "." (or a directory above it) was emptied, the script's own files with it.
    for to in (".", tmp_path, tmp_path.parent):
        with pytest.raises(ValueError, match="which is, or holds, the working directory"):
            with cs.capture(model, "m/d1", to=to, overwrite=True):
                model.predict(X, verbose=0)
    assert (tmp_path / "precious.txt").read_text() == "mine"
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "old.bin").write_bytes(b"old")
    os.symlink(tmp_path / "real", tmp_path / "link")
    with cs.capture(model, "m/d1", to=tmp_path / "link", overwrite=True):
        model.predict(X, verbose=0)
    assert (tmp_path / "link").is_symlink() and not (tmp_path / "real" / "old.bin").exists()
    np.testing.assert_allclose(cs.load_capture(tmp_path / "real")["m/d1:output"],
                               _stock(model, "d1", X), rtol=1e-5)


@pytest.mark.parametrize("made", [False, True])
def test_a_scope_that_wrote_nothing_leaves_its_directory_as_it_found_it(tmp_path, made):
    """A selection that matched nothing left an `index.json`, so the same `to=`
    was refused ("already holds a capture") once the selection was fixed."""
    model = _model()
    target = tmp_path / "caps"
    if made:
        target.mkdir()
    with pytest.raises(ValueError, match="selected nothing"):
        with cs.capture(model, "m/nothing*", to=target):
            model.predict(X, verbose=0)
    with pytest.raises(RuntimeError, match="before any call"):
        with cs.capture(model, "m/d1", to=target):
            raise RuntimeError("before any call")
    assert target.exists() == made and (not made or not os.listdir(target))
    with cs.capture(model, "m/d1", to=target):
        model.predict(X, verbose=0)
    np.testing.assert_allclose(cs.load_capture(target)["m/d1:output"],
                               _stock(model, "d1", X), rtol=1e-5)


@contextlib.contextmanager
def _files_up_to(size):
    """The process may write files of at most `size` bytes (`RLIMIT_FSIZE`): a
    longer write fails with EFBIG, as a full disk's with ENOSPC."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (else it kills)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_an_index_that_cannot_be_written_says_what_is_still_readable(tmp_path):
    """A full disk failed the writer, then the index: a bare OSError, an empty
    `index.json.tmp`, and no word on the rows already on disk; a scope opened on
    a full disk left `owner.json.tmp` in the directory it made."""
    model = _model()
    target = tmp_path / "caps"
    with _files_up_to(10):  # not even the owner's 34 bytes
        with pytest.raises(OSError, match="File too large"):
            with cs.capture(model, "m/d1", to=target):
                pass
    assert not target.exists()
    with _files_up_to(100):  # 6 of the 10 rows of 16 bytes, and no index
        with pytest.raises(_writer.WriteError) as raised:
            with cs.capture(model, "m/d1", to=target) as cap:
                model.predict(X, batch_size=2, verbose=0)
    message = str(raised.value)
    assert "could not write its index (`index.json`): [Errno 27] File too large (after " \
        "the WriteError above). The rows on disk of ['m/d1:output'] are read through " \
        "this scope's capture" in message and f"Received: to={str(target)!r}" in message
    chain, error = [], raised.value
    while error is not None:
        chain.append(str(error))
        error = error.__context__
    assert any("could not write its files" in m for m in chain), chain  # the first error
    assert sorted(os.listdir(target)) == ["call_000", "owner.json"]
    rows = cap["m/d1:output"]
    assert len(rows) == 6 and os.path.getsize(target / "call_000" / "0000.bin") == 100
    np.testing.assert_allclose(rows, _stock(model, "d1", X)[:6], rtol=1e-5)
    with pytest.raises(FileNotFoundError, match="holds no capture index"):
        cs.load_capture(target)


@pytest.mark.parametrize("change", ["deleted", "cut short"])
def test_a_capture_file_deleted_or_cut_short_after_the_scope_says_so(change, tmp_path):
    # numpy's own error named neither the file's key nor what happened to it (a
    # bare FileNotFoundError, or "mmap length is greater than file size").
    model, target = _model(), tmp_path / "caps"
    with cs.capture(model, "m/d1", to=target) as cap:
        model.predict(X, batch_size=4, verbose=0)
    path = target / "call_000" / "0000.bin"
    if change == "deleted":
        path.unlink()
    else:
        os.truncate(path, 40)
    message = (r"The capture file `.*0000.bin` of captured `m/d1:output` is gone or shorter "
               r"than the capture's index says.*Received: (FileNotFoundError|ValueError)")
    for capture in (cap, cs.load_capture(target)):
        with pytest.raises(ValueError, match=message):
            capture["m/d1:output"]


def test_a_call_that_waits_for_the_closing_thread_does_not_hang_its_exit(tmp_path,
                                                                        monkeypatch):
    """A worker's predict over a generator that the main thread ends after the
    scope: the exit waited for it for ever. It waits `WAIT_S`, warns, and the
    call's end writes the index again, with every row."""
    import queue

    from callscope import _capture

    monkeypatch.setattr(_capture, "WAIT_S", 0.5)
    model = _model()
    model.predict(X, verbose=0)
    items, asked, fed = queue.Queue(), threading.Event(), {}

    class Fed(keras.utils.PyDataset):  # its batches come from the main thread
        def __len__(self):
            return 2

        def __getitem__(self, index):  # (TF asks for the first batch twice)
            asked.set()
            if index not in fed:
                fed[index] = items.get(timeout=60)
            return (fed[index],)

    with pytest.warns(UserWarning, match="running after WAIT_S=0.5 s") as caught:
        with cs.capture(model, "m/d1", to=tmp_path) as cap:
            context = contextvars.copy_context()
            worker = threading.Thread(target=context.run, args=(
                lambda: model.predict(Fed(), verbose=0),))
            worker.start()
            assert asked.wait(60)  # its call has begun
            items.put(X[:4])
    message = next(str(w.message) for w in caught if "WAIT_S" in str(w.message))
    assert "its index on disk is written again when the last ends" in message
    with pytest.raises(ValueError, match="another open cs.capture"):  # still its own
        with cs.capture(model, "m/d1", to=tmp_path, overwrite=True):
            pass
    # Read in another process now, the index says that a call still runs.
    with pytest.warns(UserWarning, match=r"written while calls it records still ran.* "
                      r"Received: calls \[0\] running"):
        cs.load_capture(tmp_path)
    items.put(X[4:])
    worker.join(60)
    np.testing.assert_allclose(cap["m/d1:output"], _stock(model, "d1", X), rtol=1e-5)
    np.testing.assert_allclose(cs.load_capture(tmp_path)["m/d1:output"],
                               _stock(model, "d1", X), rtol=1e-5)
    with cs.capture(model, "m/d1", to=tmp_path, overwrite=True):  # released
        model.predict(X, verbose=0)


def test_a_call_that_raised_reads_back_as_failed(tmp_path):
    """The index kept no word of a call's failure: read in another process, a fit
    stopped at its third step looked like a whole one."""

    class Stops(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                raise RuntimeError("stop")

    model = _model()
    model.compile("sgd", "mse")
    with pytest.raises(RuntimeError, match="stop"):
        with cs.capture(model, "m/d1", to=tmp_path) as cap:
            model.predict(X, verbose=0)
            model.fit(X, X[:, :2], batch_size=2, epochs=1, verbose=0, callbacks=[Stops()])
    loaded = cs.load_capture(tmp_path)
    for found in (cap, loaded):
        assert [(c.method, c.failed) for c in found.calls] == [("predict", False),
                                                               ("fit", True)]
        assert len(found.calls[1]["m/d1:output"]) == 6  # the 3 steps that ran, 2 rows each
    np.testing.assert_allclose(loaded.calls[0]["m/d1:output"], cap.calls[0]["m/d1:output"])


def test_an_interrupt_while_a_run_ends_leaves_no_directory_claimed(tmp_path, monkeypatch):
    """A KeyboardInterrupt in the writer's join skipped the release of the call:
    the exit thought it late and kept its directory claimed for the process."""
    model = _model()
    close = _writer.Writer.close

    def interrupted(self):
        close(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(_writer.Writer, "close", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with cs.capture(model, "m/d1", to=tmp_path):
            model.predict(X, batch_size=4, verbose=0)
    monkeypatch.setattr(_writer.Writer, "close", close)
    with cs.capture(model, "m/d1", to=tmp_path, overwrite=True) as again:  # not claimed
        model.predict(X, batch_size=4, verbose=0)
    np.testing.assert_allclose(again["m/d1:output"], _stock(model, "d1", X), rtol=1e-5)


def test_a_late_index_that_cannot_be_written_warns_and_the_other_captures_end(tmp_path,
                                                                            monkeypatch):
    """Two captures late on one call: the first's index write failed (a full
    disk), raised a bare FileNotFoundError in the worker's call, and left
    the second's call running and its directory claimed for good."""
    import time

    from callscope import _capture

    monkeypatch.setattr(_capture, "WAIT_S", 0.3)
    model = _model()
    model.predict(X, verbose=0)
    gone, kept = tmp_path / "gone", tmp_path / "kept"
    release = threading.Event()

    class Held(keras.callbacks.Callback):
        def on_predict_batch_end(self, batch, logs=None):
            release.wait(30)

    errors = []

    def predict():
        try:
            model.predict(X, batch_size=4, verbose=0, callbacks=[Held()])
        except Exception as error:  # noqa: BLE001 - asserted below
            errors.append(error)

    with pytest.warns(UserWarning) as caught:  # (the warnings module is the process's)
        with cs.capture(model, "m/d1", to=gone), cs.capture(model, "m/d1", to=kept) as cap:
            worker = threading.Thread(target=contextvars.copy_context().run,
                                      args=(predict,))
            worker.start()
            while not cap.calls:
                time.sleep(0.01)
        write_json = _capture._write_json

        def full(path, value):  # the late index of `gone` meets a full disk
            if path.startswith(str(gone)):
                raise OSError(errno.ENOSPC, "No space left on device")
            write_json(path, value)

        monkeypatch.setattr(_capture, "_write_json", full)
        release.set()
        worker.join(60)
    caught = [str(w.message) for w in caught]
    assert any("WAIT_S=0.3" in m for m in caught), caught
    assert errors == []
    assert any("could not write the index of" in m and str(gone) in m for m in caught), caught
    np.testing.assert_allclose(cs.load_capture(kept)["m/d1:output"], _stock(model, "d1", X),
                               rtol=1e-5)
    with cs.capture(model, "m/d1", to=kept, overwrite=True):  # let go
        model.predict(X, verbose=0)
