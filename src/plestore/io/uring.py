"""A minimal io_uring for batched reads, in Python + numpy, with no per-I/O Python work.

Submission entries are filled for a whole batch at once through a numpy structured view of the
kernel's SQE array, completions are checked the same way, and the only calls per batch are
`io_uring_enter` syscalls (made through ctypes, which releases the GIL). That keeps a queue of
hundreds of O_DIRECT reads in flight from one thread — the depth an NVMe or virtio disk needs to
reach its IOPS — without a C extension or liburing.

Only what plestore needs: IORING_OP_READ into caller-owned buffers, no SQPOLL, no fixed files.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import struct
import threading
from dataclasses import dataclass

import numpy as np

__all__ = ["IoUring", "ReadBatch", "UringUnavailable", "uring_available"]

_SYS_SETUP = 425
_SYS_ENTER = 426
_OFF_SQ_RING = 0
_OFF_CQ_RING = 0x8000000
_OFF_SQES = 0x10000000
_FEAT_SINGLE_MMAP = 1
_ENTER_GETEVENTS = 1
_OP_READ = 22  # Linux 5.6+

_SQE = np.dtype(
    [
        ("opcode", "u1"),
        ("flags", "u1"),
        ("ioprio", "<u2"),
        ("fd", "<i4"),
        ("off", "<u8"),
        ("addr", "<u8"),
        ("len", "<u4"),
        ("rw_flags", "<u4"),
        ("user_data", "<u8"),
        ("pad", "V24"),
    ]
)
_CQE = np.dtype([("user_data", "<u8"), ("res", "<i4"), ("flags", "<u4")])
assert _SQE.itemsize == 64 and _CQE.itemsize == 16

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class UringUnavailable(OSError):
    """The kernel refuses io_uring (disabled by sysctl, seccomp, or too old)."""


def _syscall(*args: int) -> int:
    ret = _libc.syscall(*[ctypes.c_long(a) for a in args])
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


@dataclass
class ReadBatch:
    """Reads started on a ring and not yet finished (see IoUring.start)."""

    fd: int
    offsets: np.ndarray
    lengths: np.ndarray
    addrs: np.ndarray
    qd: int
    expect: np.ndarray  # bytes each read must return: its length, or less where the file ends
    submitted: int = 0  # reads written to the submission ring
    completed: int = 0
    failure: OSError | None = None
    finished: bool = False


class IoUring:
    """One ring. `read(fd, offsets, lengths, addrs)` runs a batch of reads to completion."""

    def __init__(self, entries: int = 1024) -> None:
        params = (ctypes.c_uint8 * 120)()
        try:
            self.fd = _syscall(_SYS_SETUP, entries, ctypes.addressof(params))
        except OSError as e:
            raise UringUnavailable(e.errno, f"io_uring_setup failed: {e.strerror}") from None
        p = bytes(params)
        sq_entries, cq_entries, _, _, _, features, _ = struct.unpack_from("<7I", p, 0)
        sq = struct.unpack_from("<7I", p, 40)  # head, tail, mask, entries, flags, dropped, array
        cq = struct.unpack_from("<6I", p, 80)  # head, tail, mask, entries, overflow, cqes
        sq_size = sq[6] + sq_entries * 4
        cq_size = cq[5] + cq_entries * _CQE.itemsize
        try:
            if features & _FEAT_SINGLE_MMAP:
                self._sq_map = self._cq_map = self._map(max(sq_size, cq_size), _OFF_SQ_RING)
            else:
                self._sq_map = self._map(sq_size, _OFF_SQ_RING)
                self._cq_map = self._map(cq_size, _OFF_CQ_RING)
            self._sqe_map = self._map(sq_entries * _SQE.itemsize, _OFF_SQES)
        except OSError:
            os.close(self.fd)
            raise
        u32 = np.dtype("<u4")
        self._sq_head = np.frombuffer(self._sq_map, u32, 1, sq[0])
        self._sq_tail = np.frombuffer(self._sq_map, u32, 1, sq[1])
        self._sq_mask = int(np.frombuffer(self._sq_map, u32, 1, sq[2])[0])
        self._sq_array = np.frombuffer(self._sq_map, u32, sq_entries, sq[6])
        self._cq_head = np.frombuffer(self._cq_map, u32, 1, cq[0])
        self._cq_tail = np.frombuffer(self._cq_map, u32, 1, cq[1])
        self._cq_mask = int(np.frombuffer(self._cq_map, u32, 1, cq[2])[0])
        self._cqes = np.frombuffer(self._cq_map, _CQE, cq_entries, cq[5])
        self._sqes = np.frombuffer(self._sqe_map, _SQE, sq_entries)
        # SQ slot i always names SQE i, and every field a read leaves alone is set once: a
        # batch then writes only its fields, in at most two contiguous runs of entries
        self._sq_array[:] = np.arange(sq_entries, dtype=np.uint32)
        self._sqes[:] = np.zeros(1, _SQE)
        self._sqes["opcode"] = _OP_READ
        self.sq_entries = sq_entries
        self.cq_entries = cq_entries
        self._lock = threading.Lock()  # one batch at a time per ring
        self._broken: str | None = None  # why the ring cannot serve another batch

    def _map(self, size: int, offset: int) -> mmap.mmap:
        return mmap.mmap(
            self.fd,
            size,
            mmap.MAP_SHARED | mmap.MAP_POPULATE,
            mmap.PROT_READ | mmap.PROT_WRITE,
            offset=offset,
        )

    def start(
        self,
        fd: int,
        offsets: np.ndarray,
        lengths: np.ndarray | int,
        addrs: np.ndarray,
        queue_depth: int = 128,
        submit: bool = True,
        expect: np.ndarray | None = None,
    ) -> ReadBatch:
        """Submit the first `queue_depth` reads of a batch and return without waiting: the
        disk works while the caller does something else. `finish` must follow (it submits the
        rest and waits); the ring serves no other batch until then. submit=False: only write
        their entries (finish hands them to the kernel), so that finish alone is the reads'
        time: the disk's own latency for a batch, with no Python of this module in it.
        expect: the bytes each read must return where not all of `lengths` (the file ends
        inside it); any other count fails the batch."""
        n = len(offsets)
        lengths = np.broadcast_to(np.asarray(lengths, dtype=np.uint32), (n,))
        qd = max(1, min(queue_depth, self.sq_entries, self.cq_entries))
        self._lock.acquire()
        expect = lengths if expect is None else expect
        batch = ReadBatch(fd, offsets, lengths, addrs, qd, expect)
        try:
            if self._broken:
                raise OSError(errno.EIO, f"this io_uring is unusable: {self._broken}")
            k = min(qd, n)
            if k:
                self._fill(fd, offsets, lengths, addrs, 0, k)
                batch.submitted = k
                if submit:
                    self._enter(0)
        except BaseException:
            self._drain(batch)
            self._lock.release()
            raise
        return batch

    def finish(self, batch: ReadBatch) -> None:
        """Complete a started batch: every read done. Raises OSError on the first failed read
        and on a short read (naming the offset); all submitted reads are reaped first, so no
        buffer is written after this returns."""
        b = batch
        if b.finished:
            raise RuntimeError("this read batch was already finished")
        try:
            n = len(b.offsets)
            while b.completed < n:
                room = b.qd - (b.submitted - b.completed)
                k = 0 if b.failure else min(room, n - b.submitted)
                if k:
                    self._fill(b.fd, b.offsets, b.lengths, b.addrs, b.submitted, k)
                    b.submitted += k
                # all submitted: one wake-up for all of them, not one per read (measured:
                # RESULTS.md "Tried, not kept", wait-one); before, a completion frees room
                inflight = b.submitted - b.completed
                wait = inflight if b.submitted == n else min(inflight, 1)
                self._enter(wait)
                done, err = self._reap(b.offsets, b.expect)
                b.completed += done
                b.failure = b.failure or err
                if b.failure and b.completed == b.submitted:
                    break
        except BaseException:
            self._drain(b)
            raise
        finally:
            b.finished = True
            self._lock.release()
        if b.failure:
            raise b.failure

    def _fill(self, fd, offsets, lengths, addrs, start: int, k: int) -> None:
        tail = int(self._sq_tail[0])
        done = 0
        while done < k:  # the ring's entries from tail on, wrapping once at most
            a = (tail + done) & self._sq_mask
            m = min(k - done, self.sq_entries - a)
            sqe, src = self._sqes[a : a + m], slice(start + done, start + done + m)
            sqe["fd"] = fd
            sqe["off"] = offsets[src]
            sqe["addr"] = addrs[src]
            sqe["len"] = lengths[src]
            sqe["user_data"] = np.arange(src.start, src.stop, dtype=np.uint64)
            done += m
        self._sq_tail[0] = (tail + k) & 0xFFFFFFFF  # the kernel reads it in io_uring_enter

    def _enter(self, min_complete: int) -> None:
        """Hand the kernel every entry written and not yet taken (the kernel's head trails
        our tail until it has: a call that took fewer, or was interrupted, leaves none behind)
        and wait for min_complete completions."""
        while True:
            pending = (int(self._sq_tail[0]) - int(self._sq_head[0])) & 0xFFFFFFFF
            try:
                _syscall(_SYS_ENTER, self.fd, pending, min_complete, _ENTER_GETEVENTS, 0, 0)
                return
            except OSError as e:
                if e.errno == errno.EINTR:
                    continue
                raise

    def _drain(self, b: ReadBatch) -> None:
        """After an error out of a batch (a failed or interrupted io_uring_enter): drop the
        entries the kernel has not taken and wait for the reads it has, so that no buffer is
        written once the batch is given up. If even that wait fails, the ring is unusable."""
        untaken = (int(self._sq_tail[0]) - int(self._sq_head[0])) & 0xFFFFFFFF
        self._sq_tail[0] = self._sq_head[0]  # (the kernel reads entries only inside enter)
        inflight = b.submitted - b.completed - untaken
        try:
            while inflight > 0:
                try:
                    _syscall(_SYS_ENTER, self.fd, 0, inflight, _ENTER_GETEVENTS, 0, 0)
                except OSError as e:
                    if e.errno != errno.EINTR:
                        raise
                done, _ = self._reap(b.offsets, b.expect)
                b.completed += done
                inflight -= done
        except BaseException as e:
            self._broken = f"{inflight} reads of a failed batch may still land: {e}"

    def _reap(self, offsets, expect) -> tuple[int, OSError | None]:
        head, tail = int(self._cq_head[0]), int(self._cq_tail[0])
        count = (tail - head) & 0xFFFFFFFF
        if not count:
            return 0, None
        cqe = self._cqes[(head + np.arange(count)) & self._cq_mask]
        self._cq_head[0] = tail
        res = cqe["res"].astype(np.int64)
        idx = cqe["user_data"].astype(np.int64)
        bad = res != expect[idx].astype(np.int64)
        err = None
        if bad.any():
            j = int(np.argmax(bad))
            off, r = int(offsets[idx[j]]), int(res[j])
            if r < 0:
                err = OSError(-r, f"read at offset {off} failed: {os.strerror(-r)}")
            else:
                err = OSError(
                    errno.EIO,
                    f"short read at offset {off}: {r} of "
                    f"{int(expect[idx[j]])} bytes (file truncated?)",
                )
        return count, err

    def close(self) -> None:
        if self.fd >= 0:
            # drop the numpy views first: a mapping with live exports cannot be closed
            self._sq_head = self._sq_tail = self._sq_array = self._sqes = None
            self._cq_head = self._cq_tail = self._cqes = None
            for m in {id(x): x for x in (self._sq_map, self._cq_map, self._sqe_map)}.values():
                m.close()
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:  # best effort; close() is the API
        try:
            self.close()
        except Exception:
            pass


_AVAILABLE: bool | None = None


def uring_available() -> bool:
    """Whether this process may use io_uring (probed once by creating a small ring)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            IoUring(8).close()
            _AVAILABLE = True
        except (UringUnavailable, OSError, AttributeError):
            _AVAILABLE = False
    return _AVAILABLE
