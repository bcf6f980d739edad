"""Lock files one process holds while it builds something the others wait for.

    fd = try_lock(path)                                   # held, or None while another holds it
    fd = lock_while_progressing(path, progress, timeout_s, stalled)   # waits while it moves on

A waiter polls the lock and calls `progress()` (what the holder is writing, e.g. its temporary
file's size): it gives up with TimeoutError(stalled(last progress)) once that has not changed
for `timeout_s`. A killed holder's lock vanishes with it (the kernel drops a dead process's
flocks). Closing the descriptor releases the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable

__all__ = ["POLL_S", "lock_while_progressing", "open_lock", "try_lock"]

POLL_S = 0.02  # a waiter's poll


def open_lock(path: str, mode: int = 0o600) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, mode)


def try_lock(path: str, mode: int = 0o600) -> int | None:
    """A descriptor holding lock file `path` exclusively, or None while another holds it. The
    file is checked, once locked, to still be the one under the name (`shm clean` removes lock
    files): a lock on a removed file is dropped and the new file locked."""
    while True:
        fd = open_lock(path, mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        with contextlib.suppress(FileNotFoundError):
            st, mine = os.stat(path), os.fstat(fd)
            if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                return fd
        os.close(fd)  # removed (or replaced) under us: lock what the name holds now


def lock_while_progressing(
    path: str,
    progress: Callable[[], object],
    timeout_s: float,
    stalled: Callable[[object], str],
    mode: int = 0o600,
) -> int:
    """try_lock(path), waiting while the holder makes progress (`progress()` changes); once it
    has not for `timeout_s`, TimeoutError with the message `stalled(its last progress)`."""
    last, since = None, time.monotonic()
    while (fd := try_lock(path, mode)) is None:
        now, seen = time.monotonic(), progress()
        if seen != last:
            last, since = seen, now
        elif now - since > timeout_s:
            raise TimeoutError(stalled(last))
        time.sleep(POLL_S)
    return fd
