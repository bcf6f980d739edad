"""`direct` tier: O_DIRECT reads of exactly the blocks that hold the needed rows, many in
flight, into a bounded row cache — the page cache is never touched.

With 512-byte blocks a cold row costs one 512-B read (8 KiB per Qwen4Exp decode token), not a
4 KiB page or 64 KiB of readahead. The host footprint is the row cache plus fixed staging for
block reads (and a second, queue-sized staging for reads started at prefetch), all reported.
Rows read enter the cache on a thread of their own after read() returns them, off the step's
critical path (measured: RESULTS.md "host time, part by part"); the next read, prefetch or
drop_cache waits for that insert, so the cache is always as if it had been inserted inline.
"""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from plestore import native
from plestore.io.blockreader import BlockReader
from plestore.io.memory import HostBuffer
from plestore.io.probe import o_direct_alignment
from plestore.tablefile import DATA_OFFSET
from plestore.tiers.base import ReadStats, Tier
from plestore.tiers.rowcache import RowCache

__all__ = ["DirectTier"]

_STAGING_BYTES = 32 << 20  # block-read staging per batch; larger lookups run in batches


class DirectTier(Tier):
    name = "direct"
    can_read_host = True
    exact_disk_bytes = True  # every read is an O_DIRECT block read it counts
    # a large lookup's row-cache probe in one call of torch ops, not 16,384 rows at a time
    # (cold reads go in staging-sized batches anyway). measured: RESULTS.md "e2e: warm host
    # gathers"
    read_chunk_rows = 1 << 18

    def __init__(self, table, row_range, device, options) -> None:
        super().__init__(table, row_range, device, options)
        try:
            align = o_direct_alignment(table.data_path, DATA_OFFSET)
        except OSError as e:
            raise OSError(
                e.errno,
                f"direct tier unavailable: {e}; use tier='mapped' (page cache) or 'pinned' (DRAM)",
            ) from None
        lay = table.layout
        if lay.rows_per_block:  # a row never leaves its block: read the aligned unit holding it
            self.unit = self._step = max(lay.block_bytes, align)
        else:  # rows start every `pitch` bytes: read from the aligned offset at or below one
            pitch = lay.row_span if lay.block_bytes else lay.row_stride
            lead = align - math.gcd(pitch, align)  # the most a row starts past that offset
            self.unit = -(-(self.row_bytes + lead) // align) * align
            self._step = align  # (DATA_OFFSET is a multiple of every alignment)
        self.align = align
        self.reader = BlockReader(
            table.data_path,
            self.unit,
            engine=options.io_engine,
            queue_depth=options.queue_depth,
            threads=options.threads,
        )
        # the budget covers row bytes plus the 16 B of tag and stamp per slot
        self.cache = RowCache(options.cache_bytes // (self.row_bytes + 16), self.row_bytes)
        self._inserter = ThreadPoolExecutor(1, thread_name_prefix="plestore-direct-cache")
        self._inserts: list[Future] = []  # cache inserts of rows already returned
        self._inserts_lock = threading.Lock()
        self._units = max(1, _STAGING_BYTES // self.unit)
        self.staging = HostBuffer(self._units * self.unit, pin=False)
        self._staged = self.staging.array.reshape(self._units, self.unit)  # [units, unit]
        self._staged_items = self._items(self._staged)
        self.blocks_read = 0
        self.bytes_read = 0
        # verify_reads: blocks a read unit holds only in part are read through this descriptor
        self._check_fd = os.open(table.data_path, os.O_RDONLY) if self.checks else None
        # reads submitted at prefetch time (io_uring only) land in a second, smaller staging
        # area through a second ring, collected by the next read()
        self._ahead: BlockReader | None = None
        self._ahead_buf: HostBuffer | None = None
        self._inflight: tuple | None = None
        self._ahead_lock = threading.Lock()
        # the native core (io_uring only): the whole read in one call, with rings of its own
        self._core = None
        # verify_reads checks blocks on the Python path (the native read does not check them)
        use_core = self.reader.engine == "io_uring" and self.checks is None
        core = native.load(options.native) if use_core else None
        if self.reader.engine == "io_uring":
            ahead_units = min(options.queue_depth, self._units)
            self._ahead_buf = HostBuffer(ahead_units * self.unit, pin=False)
            self._ahead_staged = self._ahead_buf.array.reshape(ahead_units, self.unit)
        if core is not None:
            c = self.cache
            self._core = core.DirectCore(
                self.reader.fd, self.reader.size, DATA_OFFSET, self.unit, self._step,
                self.row_bytes, *native.layout_rule(lay), self.staging.array,
                self._ahead_buf.array, options.queue_depth, c.tags, c.stamp, c.data,
                native.memory_threads(options.threads),
            )  # fmt: skip
        elif self.reader.engine == "io_uring":
            self._ahead = BlockReader(
                table.data_path, self.unit, engine="io_uring", queue_depth=ahead_units
            )
            self._ahead_items = self._items(self._ahead_staged)

    @property
    def engine(self) -> str:
        return self.reader.engine

    def prefetch(self, rows: np.ndarray) -> None:
        """Submit the reads of rows the cache lacks now (up to one queue's worth) and return:
        the disk works while the caller launches the layers before the PLE layer, and `read`
        collects them. A decode step's 16-128 rows then cost the caller almost no wait."""
        if self._core is not None and not self._closed:
            with self.cache._lock:  # the core reads the cache's arrays
                k = self._core.prefetch(rows)
                self._inflight = (k,) if self._core.inflight() else None
            self.blocks_read += k
            self.bytes_read += k * self.unit
            return
        if self._ahead is None or self._closed:
            return
        self._settle()
        with self._ahead_lock:
            if self._closed:  # closed since the check above
                return
            self._drop_inflight()
            miss = rows[~self.cache.contains(rows)]
            if not len(miss):
                return
            units = np.unique(self._locate(miss)[0])[: len(self._ahead_staged)]
            try:
                self._inflight = (units, self._ahead.start(units, self._ahead_staged))
            except OSError:
                return  # a hint only: the read path meets (and raises) the same error
            self.blocks_read += len(units)
            self.bytes_read += len(units) * self.unit

    def _drop_inflight(self) -> np.ndarray | None:
        """Wait for the prefetched reads; their unit offsets, or None if none or they failed."""
        if self._inflight is None:
            return None
        units, handle = self._inflight
        self._inflight = None
        try:
            self._ahead.finish(handle)
        except OSError:
            return None  # the read path reads these rows again and reports the error
        return units

    def read(self, rows: np.ndarray, out: np.ndarray) -> ReadStats:
        try:
            return self._read_rows(rows, out)
        except OSError as e:  # the reads name the offset; say which file too
            if str(self.table.data_path) in str(e):
                raise
            raise OSError(e.errno, f"{self.table.data_path}: {e.strerror or e}") from e

    def _read_rows(self, rows: np.ndarray, out: np.ndarray) -> ReadStats:
        self._check_open()
        n = len(rows)
        if n == 0:
            return ReadStats()
        t0 = time.perf_counter()
        if self._core is not None:
            return self._read_native(rows, out, t0)
        self._settle()
        hit = self.cache.get(rows, out)
        miss = np.flatnonzero(~hit)
        blocks = ahead = 0
        if self._ahead is not None and len(miss):
            with self._ahead_lock:
                units = self._drop_inflight()
                if units is not None and self.checks is not None:
                    self.checks.check_reads(units, self._ahead_staged, self._check_fd)
                if units is not None:  # read at prefetch (counted in the tier's totals then)
                    miss = miss[~self._place(rows, miss, units, self._ahead_items, out)]
                    ahead = len(units)
        with self._lock:  # one staging area: block reads of concurrent lookups take turns
            for a in range(0, len(miss), self._units):
                blocks += self._read_missing(rows, miss[a : a + self._units], out)
        self.blocks_read += blocks
        self.bytes_read += blocks * self.unit
        return ReadStats(
            rows=n,
            cache_hits=int(hit.sum()),
            blocks_read=blocks + ahead,
            bytes_read=(blocks + ahead) * self.unit,
            seconds=time.perf_counter() - t0,
        )

    def _read_native(self, rows: np.ndarray, out: np.ndarray, t0: float) -> ReadStats:
        """read() in one call of the native core (probe, reads, placing, admission). The cache
        admits the rows inline: a few microseconds in C, where the Python path hands its numpy
        insert to a thread."""
        c = self.cache
        with c._lock:
            c._clock += 2  # probe hits stamped clock - 1, admissions clock
            hits, blocks, ahead = self._core.read(
                rows, out, out.shape[1], c._clock - 1, self.stream_stores
            )
            self._inflight = (0,) if self._core.inflight() else None
        c.hits += hits
        c.misses += len(rows) - hits
        self.blocks_read += blocks
        self.bytes_read += blocks * self.unit
        return ReadStats(
            rows=len(rows),
            cache_hits=hits,
            blocks_read=blocks + ahead,
            bytes_read=(blocks + ahead) * self.unit,
            seconds=time.perf_counter() - t0,
        )

    def _read_missing(self, rows: np.ndarray, idx: np.ndarray, out: np.ndarray) -> int:
        """Read the units holding rows[idx] (at most self._units of them) into out[idx]."""
        start, within = self._locate(rows[idx])
        units, slot = np.unique(start, return_inverse=True)  # staged[slot[i]]: row i's unit
        self.reader.read(units, self._staged)
        if self.checks is not None:  # before any row is returned or cached
            self.checks.check_reads(units, self._staged, self._check_fd)
        self._copy_out(rows[idx], idx, slot * self.unit + within, self._staged_items, out)
        return len(units)

    def _place(self, rows, idx, units, items, out) -> np.ndarray:
        """Copy rows[idx] found in staged units (sorted file offsets; unit i staged at byte
        i * unit of `items`) into out[idx] and the cache; returns which of idx were found."""
        start, within = self._locate(rows[idx])
        slot = np.minimum(np.searchsorted(units, start), len(units) - 1)
        found = units[slot] == start
        pos = slot[found] * self.unit + within[found]
        self._copy_out(rows[idx[found]], idx[found], pos, items, out)
        return found

    def _locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the file offset of the read unit holding each row, the row's offset within it)."""
        offs = DATA_OFFSET + self.table.layout.offsets(rows)
        within = offs % self._step
        return offs - within, within

    def _copy_out(self, rows, idx, pos, items, out) -> None:
        """out[idx] = the rows at byte offsets `pos` of the staging `items`; then (on the
        inserter thread) into the cache."""
        got = items[pos]  # [k] void rows (fancy indexing: np.take would copy the staging area)
        out.view(np.dtype((np.void, self.row_bytes)))[idx, 0] = got
        data = got.view(np.uint8).reshape(len(got), self.row_bytes)  # (a copy: out may change)
        insert = self._inserter.submit(self.cache.put, rows, data, False)
        with self._inserts_lock:
            self._inserts.append(insert)

    def _items(self, staged: np.ndarray) -> np.ndarray:
        """A view of `staged` as one row-sized void item at every byte offset."""
        n = staged.size - self.row_bytes + 1
        return np.ndarray((n,), np.dtype((np.void, self.row_bytes)), staged, strides=(1,))

    def _settle(self) -> None:
        """Wait for the cache inserts of earlier reads (raising any error of theirs)."""
        with self._inserts_lock:
            inserts, self._inserts = self._inserts, []
        for insert in inserts:
            insert.result()

    def drop_cache(self) -> None:
        self._check_open()
        self._settle()
        self.cache.clear()

    def _staging_bytes(self) -> int:
        return self.staging.nbytes + (self._ahead_buf.nbytes if self._ahead_buf is not None else 0)

    def host_bytes(self) -> int:
        return self.cache.nbytes + self._staging_bytes()

    def host_budget(self) -> int | None:
        return self.options.cache_bytes + self._staging_bytes()

    def describe(self) -> dict:
        return {
            **super().describe(),
            "io_engine": self.engine,
            "read_unit": self.unit,
            "o_direct_alignment": self.align,
            "cache_rows": self.cache.capacity_rows,
            "cache_hits": self.cache.hits,
            "cache_misses": self.cache.misses,
            "blocks_read": self.blocks_read,
            "bytes_read": self.bytes_read,
        }

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self._settle()
        self._inserter.shutdown(wait=True)
        if self._core is not None:
            with self.cache._lock:
                self._core.close()  # waits for its reads in flight before the buffers go
        if self._ahead is not None:
            with self._ahead_lock:
                self._drop_inflight()
                self._ahead.close()
        if self._ahead_buf is not None:
            self._ahead_buf.close()
        self.reader.close()
        self.staging.close()
        if self._check_fd is not None:
            os.close(self._check_fd)
