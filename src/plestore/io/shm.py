"""One host copy per node: a shared segment (a /dev/shm file) that the first process builds
and later processes map, refcounted by the processes that use it.

Files in the segment directory (`PLESTORE_SHM_DIR`, default /dev/shm), for a segment `KEY`
(named by the table's data id, its row range and row stride):

    plestore-KEY.seg            the published copy: a 4 KiB header, then the rows
    plestore-KEY.seg.tmp-PID    a copy being built (never mapped by anyone but its builder)
    plestore-KEY.build          flock: held exclusively to check, build or remove the copy
    plestore-KEY.users          flock: every process using the copy holds it shared

- Concurrent first opens: one process takes the build lock and builds; the others wait for
  the lock (bounded: they give up when the builder's progress, kept in its header, stalls for
  `timeout_s`), then find the published copy and map it.
- A builder killed half-way leaves only a temporary file and no lock (the kernel drops the
  flocks of a dead process); the next holder of the build lock deletes every temporary file
  (nobody else can be building) and builds again. The copy is published by rename only after
  every row is in and the header says so; attaching checks the header.
- The last closer removes the copy: after dropping its shared lock, a closer that gets both
  locks exclusively (nobody building, nobody using) deletes it. A copy left by a crashed last
  user is reused by the next opener when its header matches, and removed by the next opener of
  any other segment otherwise; a foreign or stale file under the name is replaced. The two lock
  files stay (empty) until `plestore shm clean` (io/shmlist.py) removes an unused copy's: every
  taker of the build lock checks, once it holds it, that the file is still the one under the
  name (else it locks the new one), so nobody keeps a lock on a file no one else sees.
- Space is reserved up front (posix_fallocate), so a full tmpfs is a clear error at open
  rather than a SIGBUS while filling.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from plestore.io.locks import POLL_S, lock_while_progressing, open_lock, try_lock
from plestore.io.memory import HostBuffer
from plestore.io.probe import filesystem_type

__all__ = [
    "HEADER_BYTES",
    "SharedCopy",
    "SharedHostBuffer",
    "open_shared",
    "read_header",
    "remove_if_unused",
    "segment_dir",
    "segment_path",
]

HEADER_BYTES = 4096  # keeps the rows page-aligned (cudaHostRegister, mmap offsets)
_MAGIC = b"PLESTORE-SHM\0\0\0\0"
_VERSION = 1
_COMPLETE = 0xC0FFEE
_HEAD = struct.Struct("<16sIIQQI")  # magic, version, state, nbytes, filled, builder pid
_KEY_AT = 64  # the key (utf-8, NUL-padded) follows at this offset
_CLOSE_WAIT_S = 10.0  # a closer's wait for the build lock held by a check or an attach
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)


def segment_dir() -> str:
    """Where segments live: a tmpfs (CUDA refuses to register a shared file mapping of a disk
    file system)."""
    return os.environ.get("PLESTORE_SHM_DIR", "/dev/shm")


def segment_path(key: str, directory: str | None = None) -> str:
    return os.path.join(directory or segment_dir(), f"plestore-{key}.seg")


class SharedHostBuffer(HostBuffer):
    """A node-wide copy of `nbytes` (see the module docstring): `fill(array, progress)` writes
    it, once per node; `array` / `tensor` view it as HostBuffer's do; pinned with CUDA per
    process. `built` says whether this process built it."""

    def __init__(
        self,
        key: str,
        nbytes: int,
        fill: Callable[[np.ndarray, Callable[[int], None]], None],
        pin: bool = False,
        hugepages: bool = True,
        timeout_s: float = 120.0,
        directory: str | None = None,
        label: str = "",
    ) -> None:
        if not key or "/" in key or len(key.encode()) > HEADER_BYTES - _KEY_AT - 1:
            raise ValueError(f"bad shared segment key {key!r}")
        if nbytes <= 0:
            raise ValueError(f"a shared segment holds at least one byte, got {nbytes}")
        self.key, self.nbytes = key, int(nbytes)
        self.label = label  # what the copy holds, for `plestore shm list` (a table's path)
        self.path = segment_path(key, directory)
        base = self.path[: -len(".seg")]
        if pin:
            _require_tmpfs(os.path.dirname(self.path))
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        self._users: int | None = None
        self._fd: int | None = None
        self.pinned = False
        self.built = False
        try:
            build_lock = lock_while_progressing(
                base + ".build",
                lambda: _build_progress(self.path),
                timeout_s,
                lambda last: _stalled(self.path, timeout_s, last),
            )
            try:
                self._fd = self._attach() or self._build(fill)
                self._users = open_lock(base + ".users")
                fcntl.flock(self._users, fcntl.LOCK_SH)  # (exclusive only in a closer's check)
            finally:
                os.close(build_lock)  # (and its lock)
            _sweep_orphans(os.path.dirname(self.path), keep=self.path)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # PSS: counted at once
            self._map = mmap.mmap(self._fd, self.nbytes, flags, offset=HEADER_BYTES)
            if hugepages and self.nbytes >= (2 << 20):
                with contextlib.suppress(OSError, ValueError):
                    self._map.madvise(_MADV_HUGEPAGE)  # shmem THP where the host enables it
            self.array = np.frombuffer(self._map, dtype=np.uint8, count=self.nbytes)
            self.tensor = torch.from_numpy(self.array)
            if pin:
                self._register()
        except BaseException:
            self._release()
            raise

    # -- open: attach or build (under the build lock) ----------------------------------------
    def _attach(self) -> int | None:
        """The published copy's fd if its header matches; a mismatching file is removed."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return None
        if _header_ok(fd, self.key, self.nbytes):
            return fd
        os.close(fd)
        os.unlink(self.path)  # foreign, stale or from another version: mapped by no one new
        return None

    def _build(self, fill) -> int:
        for tmp in glob.glob(glob.escape(self.path) + ".tmp-*"):  # abandoned: we hold the lock
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        tmp = f"{self.path}.tmp-{os.getpid()}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, HEADER_BYTES + self.nbytes)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EFBIG):
                    raise OSError(
                        e.errno,
                        f"no room for a shared copy of {self.nbytes / 2**30:.2f} GiB in "
                        f"{os.path.dirname(tmp)} ({_free(tmp) / 2**30:.2f} GiB free); enlarge "
                        "it (PLESTORE_SHM_DIR picks another tmpfs) or open with share='none'",
                    ) from None
                raise
            _write_head(fd, self.key, self.nbytes, 0, 0, self.label)
            # (no `with`: a failed fill's traceback holds a view, and closing under it would
            # raise BufferError in place of the fill's error; the mapping goes with the view)
            m = mmap.mmap(fd, self.nbytes, mmap.MAP_SHARED, offset=HEADER_BYTES)
            filled = [0]

            def progress(n: int) -> None:
                filled[0] += n
                os.pwrite(fd, struct.pack("<Q", filled[0]), 32)  # waiters watch this

            fill(np.frombuffer(m, dtype=np.uint8, count=self.nbytes), progress)
            m.close()
            _write_head(fd, self.key, self.nbytes, _COMPLETE, self.nbytes, self.label)
            os.rename(tmp, self.path)  # published: complete, or not there at all
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        self.built = True
        return fd

    # -- close: the last user removes the copy -------------------------------------------------
    def close(self) -> None:
        super().close()
        self._release()

    def _release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._users is not None:
            os.close(self._users)  # drops this process's shared lock
            self._users = None
            with contextlib.suppress(OSError):  # (the lock files too: nothing stays behind)
                remove_if_unused(self.path, wait_s=_CLOSE_WAIT_S, lock_files=True)


class SharedCopy:
    """One opener's handle on its process's mapping of a node copy (`open_shared`): a process
    maps and registers a copy once, however many tables open it (a model's tables, a tier with
    and without a GPU row cache); the last handle closed closes the mapping."""

    def __init__(self, buffer: SharedHostBuffer, built: bool) -> None:
        self._buffer, self.built = buffer, built
        self.path, self.nbytes = buffer.path, buffer.nbytes
        self.array, self.tensor = buffer.array, buffer.tensor
        self.address = buffer.address
        self._closed = False

    @property
    def pinned(self) -> bool:
        return self._buffer.pinned

    def close(self) -> None:
        with _OPEN_LOCK:
            if self._closed:
                return
            self._closed = True
            self.array = self.tensor = None  # this handle's views (the last closer unmaps)
            buffer, users = _OPEN.get(self.path, (None, 0))
            if buffer is not self._buffer:  # a parent's handle in a forked child: not ours
                return
            if users > 1:
                _OPEN[self.path] = (buffer, users - 1)
                return
            del _OPEN[self.path]
        buffer.close()


# the process's mappings: segment path -> (mapping, handles); a lock per path serialises its
# opening (a build streams the whole table: the registry's own lock is never held that long)
_OPEN: dict[str, tuple[SharedHostBuffer, int]] = {}
_OPENING: dict[str, threading.Lock] = {}
_OPEN_LOCK = threading.Lock()


def _forget_after_fork() -> None:
    """In a forked child: the parent's copies are the parent's — the child's copies of their
    files close (the parent's last close could not remove a copy while a child held its users
    lock), nothing of them is unregistered (CUDA does not survive a fork) — and the child maps
    its own."""
    global _OPEN_LOCK
    for buffer, _ in _OPEN.values():
        for name in ("_fd", "_users"):
            fd = getattr(buffer, name)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(buffer, name, None)
        buffer.pinned = False
    _OPEN.clear()
    _OPENING.clear()
    _OPEN_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def open_shared(
    key: str,
    nbytes: int,
    fill: Callable[[np.ndarray, Callable[[int], None]], None],
    pin: bool = False,
    hugepages: bool = True,
    label: str = "",
) -> SharedCopy:
    """The node's copy under `key` (built by its first opener on the node), mapped once per
    process; `label` says what it holds (`plestore shm list`)."""
    path = segment_path(key)
    with _OPEN_LOCK:
        opening = _OPENING.setdefault(path, threading.Lock())
    with opening:
        with _OPEN_LOCK:  # mapped here already: held from now on (no close unmaps it)
            buffer, users = _OPEN.get(path, (None, 0))
            if buffer is not None and buffer.nbytes == nbytes:
                _OPEN[path] = (buffer, users + 1)
        if buffer is None:  # (nobody else maps it here: the entry is ours to make)
            buffer = SharedHostBuffer(key, nbytes, fill, pin, hugepages, label=label)
            with _OPEN_LOCK:
                _OPEN[path] = (buffer, 1)
            return SharedCopy(buffer, buffer.built)
        if buffer.nbytes != nbytes:
            raise ValueError(f"{path}: mapped here at {buffer.nbytes} bytes, asked {nbytes}")
        copy = SharedCopy(buffer, built=False)
        if pin and not buffer.pinned:
            try:
                buffer._register()
            except BaseException:
                copy.close()
                raise
        return copy


def _require_tmpfs(directory: str) -> None:
    """A pinned shared copy lives on a tmpfs: CUDA registers no shared mapping of a disk file
    (cudaHostRegister answers "invalid argument")."""
    kind = filesystem_type(directory)
    if kind and kind not in ("tmpfs", "hugetlbfs"):
        raise ValueError(
            f"the node's shared copies go in {directory}, a {kind} filesystem, but a pinned "
            "copy needs a tmpfs (CUDA registers no shared mapping of a disk file): point "
            "PLESTORE_SHM_DIR at a tmpfs (default /dev/shm) or open with share='none'"
        )


def _stalled(seg: str, timeout_s: float, last) -> str:
    return (
        f"another process holds the build lock of {seg} and its build made no progress "
        f"for {timeout_s} s ({last}); if it hangs, stop it (a killed builder leaves "
        "nothing behind)"
    )


def _build_progress(seg: str) -> tuple | None:
    """(temporary file, bytes filled) of a build in progress, or None."""
    for tmp in glob.glob(glob.escape(seg) + ".tmp-*"):
        with contextlib.suppress(OSError, struct.error), open(tmp, "rb") as f:
            return tmp, _HEAD.unpack(f.read(_HEAD.size))[4]
    return None


def _write_head(fd: int, key: str, nbytes: int, state: int, filled: int, label: str) -> None:
    head = _HEAD.pack(_MAGIC, _VERSION, state, nbytes, filled, os.getpid())
    text = key.encode() + b"\0" + label.encode(errors="replace")[: HEADER_BYTES - 2 - _KEY_AT]
    os.pwrite(fd, head.ljust(_KEY_AT, b"\0") + text[: HEADER_BYTES - 1 - _KEY_AT] + b"\0", 0)


def read_header(fd: int) -> dict | None:
    """A segment file's header (key, label, nbytes, filled, complete, builder pid), or None
    if it is no plestore segment."""
    try:
        raw = os.pread(fd, HEADER_BYTES, 0)
        magic, version, state, size, filled, pid = _HEAD.unpack(raw[: _HEAD.size])
        key, label = (raw[_KEY_AT:].split(b"\0") + [b""])[:2]
        if (magic, version) != (_MAGIC, _VERSION):
            return None
        return {
            "key": key.decode(),
            "label": label.decode(errors="replace"),
            "nbytes": size,
            "filled": filled,
            "complete": state == _COMPLETE and size == filled,
            "builder_pid": pid,
        }
    except (OSError, struct.error, UnicodeDecodeError):
        return None


def _header_ok(fd: int, key: str, nbytes: int) -> bool:
    head = read_header(fd)
    return (
        head is not None
        and head["complete"]
        and head["key"] == key
        and head["nbytes"] == nbytes
        and os.fstat(fd).st_size == HEADER_BYTES + nbytes
    )


def remove_if_unused(seg: str, wait_s: float = 0.0, lock_files: bool = False) -> bool:
    """Delete seg if no process builds or uses it (both locks free); True if deleted. A closer
    waits up to wait_s for a build lock held briefly (an opener's attach, another closer's
    check, which may have failed on this closer's shared lock); not for a build in progress
    (its builder becomes a user and removes the copy in turn). `lock_files`: also the
    abandoned builds' temporary files and the two lock files (the last closer, `plestore shm
    clean`): safe under the build lock, as a waiter on a removed lock file retries (try_lock)
    and .users is opened only under the build lock."""
    base = seg[: -len(".seg")]
    deadline = time.monotonic() + wait_s
    while (lock := try_lock(base + ".build")) is None:
        if glob.glob(glob.escape(seg) + ".tmp-*") or time.monotonic() >= deadline:
            return False  # an opener becomes a user, or a builder does
        time.sleep(POLL_S)
    users = open_lock(base + ".users")
    try:
        fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(users)
        os.close(lock)
        return False
    try:
        gone = [seg] + (glob.glob(glob.escape(seg) + ".tmp-*") if lock_files else [])
        gone += [base + ".users", base + ".build"] if lock_files else []  # (the build lock last)
        removed = False
        for path in gone:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed = True
        return removed
    finally:
        os.close(users)
        os.close(lock)


def _sweep_orphans(directory: str, keep: str) -> None:
    """Remove copies nobody builds or uses (left by crashed processes), except `keep`."""
    for seg in glob.glob(os.path.join(glob.escape(directory), "plestore-*.seg")):
        if seg != keep:
            with contextlib.suppress(OSError):
                remove_if_unused(seg)


def _free(path: str) -> int:
    st = os.statvfs(os.path.dirname(path))
    return st.f_bavail * st.f_frsize
