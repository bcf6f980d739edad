"""Read many aligned units of one file with O_DIRECT and a deep queue.

Two engines behind one call: io_uring (one thread keeps `queue_depth` reads in flight; the
default where the kernel allows it) and a native-thread pool of `os.preadv` calls (each releases
the GIL while the disk works). AUTO picks io_uring and says so when it falls back.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from plestore.io.uring import IoUring, ReadBatch, UringUnavailable

__all__ = ["BlockReader"]

log = logging.getLogger("plestore")


class BlockReader:
    """`read(offsets, out)`: out[i] = the `unit` bytes at offsets[i] (all multiples of `unit`).

    `out` must be page-aligned memory of shape [n, unit] (see io.memory.HostBuffer).
    """

    ENGINES = ("auto", "io_uring", "threads")

    def __init__(
        self,
        path: str | os.PathLike,
        unit: int,
        engine: str = "auto",
        queue_depth: int = 128,
        threads: int = 64,
        direct: bool = True,
    ) -> None:
        if engine not in self.ENGINES:
            raise ValueError(f"io engine must be one of {self.ENGINES}, got {engine!r}")
        self.path = os.fspath(path)
        self.unit = unit
        self.queue_depth = max(1, queue_depth)
        self.direct = direct
        flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
        self.fd = os.open(self.path, flags)
        self.size = os.fstat(self.fd).st_size  # a unit may end past it, and its read with it
        self._ring: IoUring | None = None
        self._pool: ThreadPoolExecutor | None = None
        if engine in ("auto", "io_uring"):
            try:
                self._ring = IoUring(entries=max(64, 1 << (self.queue_depth - 1).bit_length()))
            except (UringUnavailable, OSError) as e:
                if engine == "io_uring":
                    os.close(self.fd)
                    raise OSError(
                        e.errno, f"io_uring unavailable ({e}); use io_engine='threads'"
                    ) from None
                log.warning(
                    "plestore: io_uring unavailable (%s); direct reads use %d threads", e, threads
                )
        if self._ring is None:
            self._threads = max(1, threads)
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="plestore-io")
        self.engine = "io_uring" if self._ring is not None else "threads"
        self._closed = False
        self._lock = threading.Lock()

    def read(self, offsets: np.ndarray, out: np.ndarray) -> None:
        self.finish(self.start(offsets, out))

    def start(self, offsets: np.ndarray, out: np.ndarray, submit: bool = True) -> Any:
        """Begin reading; `finish(handle)` waits. With io_uring the reads are submitted now and
        the disk works while the caller goes on; the threads engine reads at finish (as
        io_uring does with submit=False: see IoUring.start)."""
        n = len(offsets)
        if out.shape[0] < n or out.shape[1] != self.unit or out.dtype != np.uint8:
            raise ValueError(f"out must be uint8 [>={n}, {self.unit}], got {out.dtype} {out.shape}")
        offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        if self._closed:
            raise OSError(errno.EBADF, f"block reader for {self.path} is closed")
        expect = None  # every read returns a whole unit, unless the file ends inside it
        last = int(offsets.max()) if n else 0
        if last > self.size - self.unit:
            if last >= self.size:
                raise ValueError(f"offset {last} is past the end of {self.path} ({self.size} B)")
            expect = np.minimum(self.unit, self.size - offsets).astype(np.uint32)
        if n and self._ring is not None:
            addrs = out.ctypes.data + np.arange(n, dtype=np.uint64) * np.uint64(self.unit)
            return self._ring.start(
                self.fd,
                offsets.astype(np.uint64),
                self.unit,
                addrs,
                queue_depth=self.queue_depth,
                submit=submit,
                expect=expect,
            )
        return offsets, out, expect

    def finish(self, handle: Any) -> None:
        if isinstance(handle, ReadBatch):
            self._ring.finish(handle)
        elif len(handle[0]):
            self._read_threads(*handle)

    def _read_threads(self, offsets: np.ndarray, out: np.ndarray, expect) -> None:
        n = len(offsets)
        parts = np.array_split(np.arange(n), min(n, self._threads))
        offs = offsets.tolist()
        want = [self.unit] * n if expect is None else expect.tolist()

        def work(idx: np.ndarray) -> None:
            for i in idx.tolist():
                got = os.preadv(self.fd, [memoryview(out[i])], offs[i])
                if got != want[i]:
                    raise OSError(
                        errno.EIO,
                        f"short read at offset {offs[i]} of {self.path}: "
                        f"{got} of {want[i]} bytes (file truncated?)",
                    )

        for fut in [self._pool.submit(work, p) for p in parts if len(p)]:
            fut.result()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._ring is not None:
                self._ring.close()
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            os.close(self.fd)
