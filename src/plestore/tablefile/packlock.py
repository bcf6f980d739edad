"""One packer per output directory at a time, the others waiting while it makes progress.

    with pack_lock(out, timeout_s):   # flock on out/.plestore-pack.lock
        ... pack (or find the table reusable: the holder before us packed it) ...

A waiter polls the lock (io/locks.py) and watches the holder's temporary files
(`.<table>.*.tmp-PID`) grow; it gives up with TimeoutError, naming the holder, once they have
not changed for `timeout_s`. The holder removes the lock file when it is done. A killed
packer's lock vanishes with it, and its temporary files are the next packer's to delete
(`remove_stale_temps`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from plestore.io.locks import lock_while_progressing

__all__ = ["LOCK_NAME", "pack_lock"]

LOCK_NAME = ".plestore-pack.lock"


@contextlib.contextmanager
def pack_lock(out: str | os.PathLike, timeout_s: float) -> Iterator[None]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = str(out / LOCK_NAME)
    fd = lock_while_progressing(
        path, lambda: _progress(out), timeout_s, lambda _: _stalled(path, out, timeout_s), 0o644
    )
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)  # who holds it, for a waiter's message
        yield
    finally:
        # removed while held, so no pack leaves it behind: a waiter that then locks the
        # removed file sees it gone and locks a new one (io/locks.py try_lock)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)  # (releases the lock)


def _stalled(path: str, out: Path, timeout_s: float) -> str:
    holder = "unknown"
    with contextlib.suppress(OSError), open(path, "rb") as f:
        holder = f.read(32).decode(errors="replace").strip() or holder
    return (
        f"another process (pid {holder}) is packing tables into {out} and has made no "
        f"progress for {timeout_s:g} s; if it hangs, end it and start again"
    )


def _progress(out: Path) -> tuple:
    """Sizes and change times of the temporary files being written in `out`."""
    found = []
    for p in out.glob(".*.tmp-*"):
        with contextlib.suppress(FileNotFoundError):
            st = p.stat()
            found.append((p.name, st.st_size, st.st_mtime_ns))
    return tuple(sorted(found))
