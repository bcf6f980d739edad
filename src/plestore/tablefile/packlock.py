"""One packer per output directory at a time, the others waiting while it makes progress.

    with pack_lock(out, timeout_s):   # flock on out/.plestore-pack.lock
        ... pack (or find the table reusable: the holder before us packed it) ...

A waiter polls the lock and watches the holder's temporary files (`.<table>.*.tmp-PID`) grow;
it gives up with TimeoutError, naming the holder, once they have not changed for `timeout_s`.
A killed packer's lock vanishes with it (the kernel drops the flocks of a dead process), and
its temporary files are the next packer's to delete (`remove_stale_temps`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["LOCK_NAME", "pack_lock"]

LOCK_NAME = ".plestore-pack.lock"
_POLL_S = 0.05


@contextlib.contextmanager
def pack_lock(out: str | os.PathLike, timeout_s: float) -> Iterator[None]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, out, timeout_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)  # who holds it, for a waiter's message
        yield
    finally:
        os.close(fd)  # (releases the lock)


def _acquire(fd: int, out: Path, timeout_s: float) -> None:
    seen, since = None, time.monotonic()
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        now, progress = time.monotonic(), _progress(out)
        if progress != seen:
            seen, since = progress, now
        elif now - since > timeout_s:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise TimeoutError(
                f"another process (pid {holder}) is packing tables into {out} and has made no "
                f"progress for {timeout_s:g} s; if it hangs, end it and start again"
            )
        time.sleep(_POLL_S)


def _progress(out: Path) -> tuple:
    """Sizes and change times of the temporary files being written in `out`."""
    found = []
    for p in out.glob(".*.tmp-*"):
        with contextlib.suppress(FileNotFoundError):
            st = p.stat()
            found.append((p.name, st.st_size, st.st_mtime_ns))
    return tuple(sorted(found))
