"""The direct tier's read in numpy: `DirectCore` (direct.c), the same arguments, rows, cache
contents and counts. Block reads are `os.preadv` calls on a thread pool (each releases the GIL
while the disk works), not an io_uring; reads started at prefetch run on that pool too."""

from __future__ import annotations

import errno
import os
import threading
import zlib
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from plestore.native.reference.gather import as_bytes, as_ids, layout_offsets, thread_pool
from plestore.native.rowsets import row_hash_torch, set_of

__all__ = ["DirectCore", "probe_numpy", "probe_torch"]

#: probes of more rows than this run in torch ops, on torch's threads (a random pass over memory
#: is latency bound: threads add up). measured: RESULTS.md "e2e: host gathers"
PARALLEL_ROWS = 8192


def probe_numpy(tags, stamp, data, rows, out, clock) -> np.ndarray:
    """Cached rows into out[i] (uint8 [n, >= row_bytes]), their ways stamped `clock`; returns
    the hit mask [n]."""
    sets, ways = tags.shape
    rb = data.shape[1]
    s = set_of(rows, sets)
    match = np.take(tags, s, axis=0) == rows[:, None]  # [n, ways]
    hit = match.any(1)
    if hit.any():
        way = match[hit].argmax(1)
        stamp[s[hit], way] = clock
        out[np.flatnonzero(hit), :rb] = np.take(data, s[hit] * ways + way, axis=0)
    return hit


def probe_torch(tags, stamp, data, rows, out, clock) -> np.ndarray:
    """probe_numpy in torch ops (large probes: a few random passes over memory, on torch's
    threads); its int64 hash names the same set as the uint64 one for any id."""
    sets, ways = tags.shape
    rb = data.shape[1]
    r = torch.from_numpy(rows)
    s = row_hash_torch(r) % sets
    match = torch.from_numpy(tags).index_select(0, s) == r[:, None]  # [n, ways]
    way = match.to(torch.uint8).argmax(1)  # the first way holding the row (0 if none)
    hit = match.any(1)
    slots, where = (s * ways + way)[hit], hit.nonzero().view(-1)
    torch.from_numpy(stamp).view(-1).index_fill_(0, slots, clock)
    dst = torch.from_numpy(out)[:, :rb]
    dst.index_copy_(0, where, torch.from_numpy(data).index_select(0, slots))
    return hit.numpy()


def admit(tags, stamp, data, rows, positions, out, clock) -> None:
    """rows[positions] (missed, in order; a repeat once, at its first) with their bytes in out,
    each into its set's least recently used way (the first of equal stamps), at most `ways` a
    set: the r-th of a set takes its r-th oldest way (direct.c's admit)."""
    sets, ways = tags.shape
    if not sets or not positions.size:
        return
    _, first = np.unique(rows[positions], return_index=True)
    pos = positions[np.sort(first)]  # distinct rows, in the order they missed
    s = set_of(rows[pos], sets)
    order = np.argsort(s, kind="stable")
    pos, s = pos[order], s[order]
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    rank = np.arange(s.size) - np.repeat(starts, np.diff(np.r_[starts, s.size]))
    keep = rank < ways
    pos, s, rank = pos[keep], s[keep], rank[keep]
    way = np.argsort(stamp[s], axis=1, kind="stable")[np.arange(s.size), rank]
    tags[s, way] = rows[pos]
    stamp[s, way] = clock
    data[s * ways + way] = out[pos, : data.shape[1]]


class DirectCore:
    """The direct tier's read over an O_DIRECT descriptor: the host row cache (tags, stamp,
    data: the tier's arrays) probed, the misses' read units read into `staging`, their blocks
    checked (crcs), the rows placed and admitted; prefetch reads units into `ahead`."""

    def __init__(
        self,
        fd: int,
        file_size: int,
        data_offset: int,
        unit: int,
        step: int,
        row_bytes: int,
        rows_per_block: int,
        block: int,
        stride: int,
        staging: Any,
        ahead: Any,
        queue_depth: int,
        tags: np.ndarray,
        stamp: np.ndarray,
        data: np.ndarray,
        threads: int = 1,
        crcs: Any = None,
        check_unit: int = 0,
        data_bytes: int = 0,
        check_fd: int = -1,
    ) -> None:
        if min(unit, step, rows_per_block, block, row_bytes, queue_depth) < 1:
            raise ValueError("DirectCore: bad geometry")
        if tags.ndim != 2 or stamp.shape != tags.shape or data.shape != (tags.size, row_bytes):
            raise ValueError("DirectCore: cache arrays disagree in size")
        self.fd, self.file_size, self.data_offset = fd, file_size, data_offset
        self.unit, self.step, self.row_bytes = unit, step, row_bytes
        self.layout = (0, rows_per_block, block, stride)
        self.staging = as_bytes(staging, writable=True)
        self.staging = self.staging[: self.staging.size // unit * unit].reshape(-1, unit)
        self.ahead = as_bytes(ahead, writable=True)
        self.ahead = self.ahead[: self.ahead.size // unit * unit].reshape(-1, unit)
        if not len(self.staging):
            raise ValueError("DirectCore: staging holds no read unit")
        self.tags, self.stamp, self.data = tags, stamp, data
        self.threads = max(1, threads, queue_depth // 4)  # (preads in flight)
        self.checks = None
        if crcs is not None:
            crcs = np.asarray(crcs)
            if (
                crcs.itemsize != 4
                or check_unit < 1
                or check_fd < 0
                or crcs.size < -(-data_bytes // max(1, check_unit))
            ):
                raise ValueError("DirectCore: crcs (uint32) do not cover the data")
            self.checks = (crcs, check_unit, data_bytes, check_fd)
        self._ahead: tuple[np.ndarray, Future] | None = None  # (units, their reads)
        self._lock = threading.Lock()
        self._open = True
        self.clock = 0  # the cache's last stamp (each read advances it by 2)

    # -- reads -------------------------------------------------------------------------------
    def _units(self, rows: np.ndarray) -> np.ndarray:
        """The file offset of the read unit holding each row, and each row's offset in it."""
        offs = self.data_offset + layout_offsets(rows, *self.layout)
        within = offs % self.step
        return offs - within, within

    def _start_reads(self, units: np.ndarray, dst: np.ndarray) -> list[Future]:
        """dst[i] = the unit at file offset units[i] (the file may end inside the last), read
        on the pool: one task a unit (none waits on another, so the pool cannot deadlock)."""

        def one(i: int, off: int) -> None:
            want = min(self.unit, self.file_size - off)
            try:
                got = os.preadv(self.fd, [memoryview(dst[i])], off)
            except OSError as e:
                raise OSError(e.errno, f"read at offset {off} failed: {e.strerror}") from None
            if got != want:
                raise OSError(
                    errno.EIO,
                    f"short read at offset {off}: {got} of {want} bytes (file truncated?)",
                )

        pool = thread_pool(self.threads)
        return [pool.submit(one, i, off) for i, off in enumerate(units.tolist())]

    def _check(self, units: np.ndarray, staged: np.ndarray) -> int:
        """The first block of the staged units failing its CRC-32, or -1 (direct.c's
        check_units)."""
        if self.checks is None:
            return -1
        crcs, cu, data_bytes, fd = self.checks
        for i, off in enumerate(units.tolist()):
            lo = off - self.data_offset
            hi = lo + self.unit
            for b in range(lo // cu, -(-min(hi, data_bytes) // cu)):
                bs, be = b * cu, min((b + 1) * cu, data_bytes)
                if bs >= lo and be <= hi:
                    got = staged[i, bs - lo : be - lo].tobytes()
                else:  # a block the unit holds only in part: read it whole
                    try:
                        got = os.pread(fd, be - bs, self.data_offset + bs)
                    except OSError:
                        return b  # (unreadable: as corrupt, as direct.c has it)
                if len(got) != be - bs or zlib.crc32(got) != int(crcs[b]):
                    return b
        return -1

    def _place(self, rows, miss, units, staged, dst) -> np.ndarray:
        """Rows rows[miss] found in staged units (sorted offsets) into dst (void rows); the rest
        of miss."""
        start, within = self._units(rows[miss])
        at = np.minimum(np.searchsorted(units, start), len(units) - 1)
        found = units[at] == start
        rb = self.row_bytes
        items = np.ndarray((staged.size - rb + 1,), (np.void, rb), staged, 0, (1,))
        dst[miss[found]] = items[at[found] * self.unit + within[found]]
        return miss[~found]

    def read(self, rows: Any, out: Any, out_stride: int, streaming: bool = False):
        """(cache hits, blocks read now, blocks read at prefetch, a block failing its CRC-32 or
        -1: nothing admitted then); hits stamped clock + 1, admissions clock + 2."""
        rows, buf = as_ids(rows), as_bytes(out, writable=True)
        n = rows.size
        if out_stride < self.row_bytes or (n and (n - 1) * out_stride + self.row_bytes > buf.size):
            raise ValueError("read: out is too small for the rows")
        with self._lock:
            if not self._open:
                raise RuntimeError("DirectCore is closed")
            self.clock += 2
            clock = self.clock - 1
            view = np.ndarray((n, self.row_bytes), np.uint8, buf, 0, (out_stride, 1))
            dst = np.ndarray((n,), (np.void, self.row_bytes), buf, 0, (out_stride,))
            hit = np.zeros(n, bool)
            if self.tags.shape[0] and n:
                probe = probe_torch if n > PARALLEL_ROWS else probe_numpy
                hit = probe(self.tags, self.stamp, self.data, rows, view, clock)
            miss = np.flatnonzero(~hit)
            left, blocks, ahead, bad = miss, 0, 0, -1
            if self._ahead is not None:
                units = self._drop_ahead()
                if units is not None and len(units):  # read at prefetch
                    staged = self.ahead[: len(units)]
                    bad = self._check(units, staged)
                    if bad < 0 and len(left):
                        left = self._place(rows, left, units, staged, dst)
                    ahead = len(units)
            for a in range(0, len(left) if bad < 0 else 0, len(self.staging)):
                part = left[a : a + len(self.staging)]
                units = np.unique(self._units(rows[part])[0])
                if units[-1] >= self.file_size:
                    raise OSError(
                        errno.EINVAL, f"read at offset {units[-1]} failed: Invalid argument"
                    )
                staged = self.staging[: len(units)]
                for f in self._start_reads(units, staged):
                    f.result()
                blocks += len(units)
                bad = self._check(units, staged)
                if bad >= 0:
                    break
                self._place(rows, part, units, staged, dst)
            if bad < 0:
                admit(self.tags, self.stamp, self.data, rows, miss, view, clock + 1)
            return n - len(miss), blocks, ahead, bad

    def prefetch(self, rows: Any) -> int:
        """Start reading the units of the rows the cache lacks (one ahead staging at most);
        how many. A hint: a failure shows in read()."""
        rows = as_ids(rows)
        with self._lock:
            if not self._open:
                raise RuntimeError("DirectCore is closed")
            self._drop_ahead()
            if not len(self.ahead) or not rows.size:
                return 0
            sets, ways = self.tags.shape
            if sets:
                s = set_of(rows, sets)
                rows = rows[~(np.take(self.tags, s, axis=0) == rows[:, None]).any(1)]
            units = np.unique(self._units(rows)[0])[: len(self.ahead)]
            units = units[units < self.file_size]
            if not units.size:
                return 0
            staged = self.ahead[: len(units)]
            self._ahead = (units, self._start_reads(units, staged))
            return int(units.size)

    def _drop_ahead(self) -> np.ndarray | None:
        """Wait for the reads started at prefetch: their units, or None (none, or failed)."""
        if self._ahead is None:
            return None
        (units, reads), self._ahead = self._ahead, None
        failed = False
        for f in reads:  # (every read waited for: none writes into staging after this)
            try:
                f.result()
            except OSError:
                failed = True  # read() reads these rows again and raises the error
        return None if failed else units

    def clear(self) -> None:
        """Forget every cached row."""
        with self._lock:
            if not self._open:
                raise RuntimeError("DirectCore is closed")
            self.tags.fill(-1)
            self.stamp.fill(0)

    def inflight(self) -> bool:
        return self._open and self._ahead is not None

    def close(self) -> None:
        with self._lock:
            self._drop_ahead()
            self._open = False
