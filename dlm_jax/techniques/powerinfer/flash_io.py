"""Reading a neuron-bundled flash file (`flash`) at run time (NumPy + stdlib only).

- `FlashReader`: positioned reads of neuron subsets (O_DIRECT where the file system allows),
  one read per run of consecutive positions on flash; `NeuronBundles`: what a read returns.
- `ReaderThread`: one background I/O queue (demand reads in order, read-ahead only between them).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import mmap
import os
import queue
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self

import numpy as np

from dlm_jax._errors import CheckpointError, ConfigError
from dlm_jax.techniques.powerinfer.flash import FlashFile, _as_flash, _split


@dataclasses.dataclass(frozen=True, eq=False)
class NeuronBundles:
    """The bundles of one read, in the order asked for, as float32."""

    layer: int
    neurons: np.ndarray  # [n] int64
    gate: np.ndarray | None  # [n, D]; None for relu
    up: np.ndarray  # [n, D]
    down: np.ndarray  # [D, n]
    bytes_read: int
    requests: int  # preadv calls


def _runs(sorted_ids: np.ndarray) -> list[tuple[int, int]]:
    """(first, count) of each run of consecutive ids in an ascending array."""
    if not len(sorted_ids):
        return []
    breaks = np.flatnonzero(np.diff(sorted_ids) != 1) + 1
    starts = np.concatenate([[0], breaks])
    counts = np.diff(np.concatenate([starts, [len(sorted_ids)]]))
    return [(int(sorted_ids[s]), int(c)) for s, c in zip(starts, counts, strict=True)]


class FlashReader:
    """Positioned reads of neuron bundles from one flash file; safe to share between threads.

    With `direct`, the file is opened with O_DIRECT (no page cache: reads cost what flash
    costs, as on a phone). Where the platform or file system refuses it (tmpfs answers EINVAL
    on open; some file systems only on the first read), reads fall back to buffered I/O,
    `direct` becomes False and `note` says why; `on_note(note)` is called once.
    """

    def __init__(self, flash_file: FlashFile | str | os.PathLike, *, direct: bool = True,
                 on_note: Callable[[str], None] | None = None):
        self.file = _as_flash(flash_file)
        self.header = self.file.header
        self.direct = False
        self.note: str | None = None
        self.bytes_read = 0
        self.requests = 0
        self._on_note = on_note
        self._lock = threading.Lock()
        self._closed = False
        self._spare_fds: list[int] = []  # descriptors replaced by a fallback, closed with the reader
        self._fd = self._open(direct)
        if self.direct:
            self._probe()

    @property
    def path(self) -> Path:
        return self.file.path

    def _probe(self) -> None:
        """The first aligned read (uncounted): where O_DIRECT reads are refused, the fallback
        happens here, so `direct` is settled once the reader exists."""
        buf = mmap.mmap(-1, self.header.stride)
        try:
            with memoryview(buf) as view:
                self._read_into(view, self.header.layer_offsets[0])
        except BaseException:
            self.close()
            raise
        finally:
            buf.close()

    def _open_fd(self, flags: int) -> int:
        try:
            return os.open(self.path, os.O_RDONLY | flags)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open ({e.strerror or e})") from e

    def _open(self, direct: bool) -> int:
        if not direct:
            return self._open_fd(0)
        flag = getattr(os, "O_DIRECT", None)
        if flag is None:
            fd = self._open_fd(0)
            self._set_note("os.O_DIRECT is not available on this platform")
            return fd
        try:
            fd = os.open(self.path, os.O_RDONLY | flag)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise CheckpointError(f"{self.path}: cannot open ({e.strerror or e})") from e
            fd = self._open_fd(0)
            self._set_note(f"open: {e.strerror or e}")
            return fd
        self.direct = True
        return fd

    def _set_note(self, reason: str) -> None:
        self.note = f"{self.path}: O_DIRECT is not supported on this filesystem ({reason}); using buffered reads"
        if self._on_note is not None:
            self._on_note(self.note)

    def _fall_back(self, reason: str) -> None:
        """Swap the O_DIRECT descriptor for a buffered one (once, whichever thread gets here first)."""
        with self._lock:
            if not self.direct:
                return
            fd = self._open_fd(0)
            self._spare_fds.append(self._fd)  # another thread may be reading through it
            self._fd = fd
            self.direct = False
        self._set_note(f"read: {reason}")

    def _preadv(self, view: memoryview, offset: int) -> int:
        was_direct, fd = self.direct, self._fd
        try:
            return os.preadv(fd, [view], offset)
        except OSError as e:
            if not (was_direct and e.errno == errno.EINVAL):
                raise CheckpointError(f"{self.path}: read at byte {offset} failed ({e.strerror or e})") from e
            self._fall_back(e.strerror or str(e))
        return self._preadv(view, offset)

    def _read_into(self, view: memoryview, offset: int) -> int:
        """Fill `view` from `offset`; the number of preadv calls it took."""
        got, calls = 0, 0
        while got < len(view):
            with view[got:] as rest:
                n = self._preadv(rest, offset + got)
            calls += 1
            if n == 0:
                raise CheckpointError(f"{self.path}: short read at byte {offset + got} ({got} of {len(view)} "
                                      f"bytes; the file shrank after it was opened)")
            got += n
        return calls

    def _check_neurons(self, layer: int, neurons: Any) -> np.ndarray:
        ids = np.asarray(neurons)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise ConfigError(f"{self.path}: neurons must be a 1-D sequence of integers, got {ids.dtype} "
                              f"{ids.shape}")
        ids = ids.astype(np.int64)
        count = self.header.neurons[layer]
        bad = ids[(ids < 0) | (ids >= count)]
        if bad.size:
            raise ConfigError(f"{self.path}: neuron {int(bad[0])} is out of range [0, {count}) in layer {layer}")
        unique, counts = np.unique(ids, return_counts=True)
        if (counts > 1).any():
            raise ConfigError(f"{self.path}: neuron {int(unique[counts > 1][0])} is asked for twice in layer {layer}")
        return ids

    def read(self, layer: int, neurons: Sequence[int] | np.ndarray) -> NeuronBundles:
        """The bundles of `neurons` (distinct indices, any order) of `layer`, as float32 in the
        order given. Each run of consecutive positions on flash is one positioned read.

        Raises:
          ConfigError: a layer or neuron out of range, a repeated neuron, or a closed reader.
          CheckpointError: the read failed or came up short.
        """
        if self._closed:
            raise ConfigError(f"{self.path}: the reader is closed")
        header = self.header
        layer = header.check_layer(layer)
        ids = self._check_neurons(layer, neurons)
        pos = header.positions(layer)[ids]
        order = np.argsort(pos, kind="stable")
        n, stride = len(ids), header.stride
        buf = mmap.mmap(-1, max(n * stride, mmap.PAGESIZE))  # page aligned, as O_DIRECT needs
        requests, at = 0, 0
        with memoryview(buf) as whole:
            for first, count in _runs(pos[order]):
                with whole[at * stride:(at + count) * stride] as part:
                    requests += self._read_into(part, header.position_offset(layer, first))
                at += count
        rows = np.frombuffer(buf, header.np_dtype, count=n * stride // header.np_dtype.itemsize)
        rank = np.empty(n, np.int64)
        rank[order] = np.arange(n)
        arrays = _split(rows.reshape(n, stride // header.np_dtype.itemsize)[rank], header, np.float32)
        del rows
        buf.close()
        with self._lock:
            self.bytes_read += n * stride
            self.requests += requests
        return NeuronBundles(layer=layer, neurons=ids, gate=arrays.get("gate"), up=arrays["up"],
                             down=arrays["down"], bytes_read=n * stride, requests=requests)

    def close(self) -> None:
        """Close the descriptors (idempotent). Call once no read is in flight."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            fds, self._spare_fds = [self._fd, *self._spare_fds], []
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------- I/O thread


_DEMAND, _BACKGROUND, _STOP = 0, 1, 2  # queue priorities


class ReaderThread:
    """One background thread serving reads one at a time (a phone's UFS has a single command
    queue; overlapping reads there only reorder them): demand reads in FIFO order, background
    reads (`submit(..., background=True)`: read-ahead) only while no demand read waits. A read
    in flight is never interrupted. `reader` is a FlashReader or anything with its
    `read(layer, neurons)`; it is not closed here."""

    def __init__(self, reader: Any, *, name: str = "dlm-jax-flash-io"):
        self.reader = reader
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = 0  # FIFO within a priority
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, layer: int, neurons: Sequence[int] | np.ndarray, *,
               background: bool = False) -> concurrent.futures.Future:
        """Queue a read (`background`: after every demand read); the future gets its
        NeuronBundles or its exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            ids = np.array(neurons)  # a copy: the caller may reuse its array while this waits
        except Exception as e:  # noqa: BLE001 - a bad argument belongs on the future, like a bad read
            future.set_exception(e)
            return future
        with self._lock:
            if self._closed:
                raise ConfigError("ReaderThread: closed; cannot submit a read")
            self._put(_BACKGROUND if background else _DEMAND, (future, layer, ids))
        return future

    def _put(self, priority: int, item: Any) -> None:
        self._seq += 1
        self._queue.put((priority, self._seq, item))

    def _serve(self) -> None:
        while True:
            item = self._queue.get()[2]
            if item is None:
                return
            future, layer, ids = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self.reader.read(layer, ids))
            except BaseException as e:  # noqa: BLE001 - every failure goes to whoever waits on it
                future.set_exception(e)

    def close(self, *, cancel: bool = True) -> None:
        """Stop and join the thread. The read in flight completes; queued ones are cancelled
        (`cancel`) or completed first. No future is left pending. Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                if cancel:
                    self._cancel_queued()
                self._put(_STOP, None)
        self._thread.join()

    def _cancel_queued(self) -> None:
        kept = []
        while True:
            try:
                entry = self._queue.get_nowait()
            except queue.Empty:
                break
            if entry[2] is None or not entry[2][0].cancel():
                kept.append(entry)  # a future someone already marked running: let it finish
        for entry in kept:
            self._queue.put(entry)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
