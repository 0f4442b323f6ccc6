"""The streaming writer: one background thread per run that appends captures to disk.

`cs.capture(to=...)` must not stall the step on the disk, nor hold a run's captures
in memory. Each run that streams gets one `Writer`: a thread that opens each file
once (never truncating one: mode `xb`), appends what the caller queues, and flushes
and closes everything when the run ends or fails. The queue is bounded in bytes, so
a caller that captures faster than the disk writes waits (backpressure), and memory
never grows with the run. An error on the thread (a full disk, a read-only
directory) is kept and raised in the caller's thread at its next `write`, `drain`
or `close`; a waiting caller is woken by it, so nothing hangs.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Callable

import numpy as np

QUEUE_BYTES = 64 << 20  # what may wait for the disk; one larger item always fits

WRITE_FAILED = (
    "cs.capture(to=...) could not write its files: {error}. The capture's files stop "
    "at the last rows written (its index says how many), and nothing more is "
    "streamed in this call. Free space on the disk or choose a writable directory, "
    "and run the call again. Received: file={path!r}"
)


class WriteError(OSError):
    """The streaming writer failed; raised in the caller's thread."""


class Writer:
    """Appends arrays to files on one background thread (see the module docstring).

    `write(path, array, done)` queues `array`'s bytes for the end of `path`, and
    `done()` runs on the thread once they are written (to count what is on disk).
    """

    def __init__(self, limit: int = QUEUE_BYTES):
        self._limit = limit
        self._items: collections.deque = collections.deque()
        self._bytes = 0
        self._queued = self._written = 0
        # (path, its size once these bytes are in, done) of writes not yet flushed
        self._unflushed: list[tuple[str, int, Callable[[], None]]] = []
        self._sizes: dict[str, int] = {}  # bytes handed to each file
        self._error: BaseException | None = None
        self._failed = ""  # the file it could not write
        self._closing = False
        self._dropping = False  # close was interrupted: write nothing more
        self._files: dict = {}
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="callscope-writer",
                                        daemon=True)
        self._thread.start()

    # -- the caller's side ---------------------------------------------------
    def write(self, path: str, array: np.ndarray, done: Callable[[], None]) -> None:
        array = np.ascontiguousarray(array)
        with self._cond:
            self._raise_if_failed()
            # Backpressure: wait while the queue holds its limit (one item always fits).
            self._cond.wait_for(lambda: self._error is not None or not self._items
                                or self._bytes + array.nbytes <= self._limit)
            self._raise_if_failed()
            self._items.append((path, array, done))
            self._bytes += array.nbytes
            self._queued += 1
            self._cond.notify_all()

    def drain(self) -> None:
        """Waits until everything queued is written and flushed (to read it back)."""
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None
                                or self._written == self._queued)
            self._raise_if_failed()

    def close(self) -> None:
        """Writes what is queued, flushes and closes every file, and ends the thread.
        Raises the thread's error, if any."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        try:
            self._thread.join()
        except BaseException:
            # Interrupted while the disk catches up: what still waits is dropped, so
            # that the files are closed, and what reached them counted, before the
            # capture writes its index (the thread wrote on after the scope exited,
            # under an index that counted none of it).
            with self._cond:
                self._dropping = True
                self._cond.notify_all()
            self._thread.join()  # (the write in progress only)
            raise
        with self._cond:
            self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise WriteError(WRITE_FAILED.format(error=self._error,
                                                 path=self._failed)) from self._error

    # -- the thread ----------------------------------------------------------
    def _loop(self) -> None:
        path = ""
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._items or self._closing)
                    if self._dropping:
                        self._items.clear()
                    if not self._items:
                        return
                    path, array, done = self._items[0]
                file = self._files.get(path)
                if file is None:
                    # Its call's folder, in the capture's: not the capture's (a
                    # directory removed while the run streams stays removed).
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(os.path.dirname(path))
                    file = self._files[path] = open(path, "xb")  # never truncates
                file.write(array.reshape(-1).view(np.uint8))
                self._sizes[path] = self._sizes.get(path, 0) + array.nbytes
                with self._cond:
                    self._items.popleft()
                    self._bytes -= array.nbytes
                    self._unflushed.append((path, self._sizes[path], done))
                    self._cond.notify_all()  # a caller waiting for room
                    if self._items:
                        continue
                # Idle: flushed, then counted (not at each write: a flush of each
                # small write is a system call each). An index that counted rows
                # still in a file object's buffer would read past the end of a
                # file that a full disk cut short (a reader maps the file at once).
                for path, f in self._files.items():  # noqa: B007 - `path`: the one that failed
                    f.flush()
                with self._cond:
                    for _, _, counted in self._unflushed:
                        counted()
                    self._written += len(self._unflushed)
                    self._unflushed.clear()
                    self._cond.notify_all()
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            with self._cond:
                self._error, self._failed = error, path
                self._items.clear()
                self._cond.notify_all()
        finally:
            for f in self._files.values():
                try:
                    f.close()  # flushes
                except OSError as error:
                    with self._cond:
                        self._error = self._error or error
            self._files.clear()
            # After a failure, the writes whose bytes all reached the disk count.
            for path, size, counted in self._unflushed:
                if os.path.exists(path) and size <= os.path.getsize(path):
                    counted()
            self._unflushed.clear()
