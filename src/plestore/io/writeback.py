"""Write-behind for long sequential writes (pack): keep the disk writing from the first byte.

Buffered writes only reach the disk when the kernel decides to flush: after ~30 s, or once
dirty pages pass `dirty_background_ratio` of RAM — 12 GiB on a 128 GiB host. A 27 GiB pack
would leave the disk idle for its first third and then wait on one huge fsync. So every
`chunk_bytes` written, writeback of that range starts at once (sync_file_range WRITE), and the
writer waits for the range `depth` chunks back (WAIT_AFTER): at most depth+1 chunks are dirty,
and the writer is paced by the disk instead of by the page cache filling up. The final fsync
still makes the file durable (sync_file_range does not flush metadata).

Linux only; elsewhere (or if the call fails) it does nothing and the final fsync does it all.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from collections import deque
from pathlib import Path

__all__ = ["WriteBehind", "fsync_dir"]

_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4


def _load():
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load()


class WriteBehind:
    """Call `written(end)` as a file grows sequentially; ranges are flushed behind the writer."""

    def __init__(self, fd: int, start: int = 0, chunk_bytes: int = 64 << 20, depth: int = 2):
        self.fd, self.chunk, self.depth = fd, chunk_bytes, depth
        self._flushed = start  # writeback has been started for [.., _flushed)
        self._inflight: deque[tuple[int, int]] = deque()
        self.enabled = _sync_file_range is not None

    def written(self, end: int) -> None:
        """Bytes [.., end) of the file are written."""
        if not self.enabled or end - self._flushed < self.chunk:
            return
        span = (self._flushed, end - self._flushed)
        if not self._call(*span, _WRITE):
            return
        self._flushed = end
        self._inflight.append(span)
        while len(self._inflight) > self.depth:
            self._call(*self._inflight.popleft(), _WAIT_BEFORE | _WRITE | _WAIT_AFTER)

    def _call(self, offset: int, nbytes: int, flags: int) -> bool:
        if _sync_file_range(self.fd, offset, nbytes, flags) == 0:
            return True
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EINVAL, errno.ESPIPE):  # unsupported here
            self.enabled = False
            return False
        raise OSError(err, f"sync_file_range: {os.strerror(err)}")


def fsync_dir(path: Path) -> None:
    """Make renames in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
