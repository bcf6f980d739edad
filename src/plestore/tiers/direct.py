"""`direct` tier: O_DIRECT reads of exactly the blocks that hold the needed rows, many in
flight, into a bounded host row cache — the page cache is never touched.

With 512-byte blocks a cold row costs one 512-B read (8 KiB per Qwen4Exp decode token), not a
4 KiB page or 64 KiB of readahead. The host footprint is the row cache plus fixed staging for
block reads (and a second, queue-sized staging for reads started at prefetch), all reported.
A read is one call of the host core's `DirectCore` (cache probe, the misses' block reads, their
checks with verify_reads, placing, admission): the compiled one reads through io_uring, the
numpy reference (native="off", io_engine="threads", or where io_uring is refused: announced)
with preadv on threads.
"""

from __future__ import annotations

import errno
import functools
import logging
import math
import os
import time

import numpy as np

from plestore import native
from plestore.io.memory import HostBuffer
from plestore.io.probe import o_direct_alignment
from plestore.tablefile import DATA_OFFSET
from plestore.tiers.base import FedReads, HostPart, ReadStats, Tier
from plestore.tiers.hostcache import HostRowCache

__all__ = ["DirectTier"]

log = logging.getLogger("plestore")

_STAGING_BYTES = 32 << 20  # block-read staging per batch; larger lookups run in batches


@functools.cache
def _announce_threads(why: str) -> None:
    log.warning("plestore: io_uring unavailable (%s); direct reads use preadv on threads", why)


class DirectTier(Tier):
    name = "direct"
    can_read_host = True
    exact_disk_bytes = True  # every read is an O_DIRECT block read it counts
    # a large lookup's row-cache probe in one call of torch ops, not 16,384 rows at a time
    # (cold reads go in staging-sized batches anyway). measured: RESULTS.md "e2e: host gathers"
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
        self.fd = os.open(table.data_path, os.O_RDONLY | os.O_DIRECT)
        self.staging = self._ahead_buf = self._check_fd = None  # (what _release may meet)
        try:
            self.size = os.fstat(self.fd).st_size  # a unit may end past it, and its read too
            # the budget covers row bytes plus the 16 B of tag and stamp per slot
            self.cache = HostRowCache(options.cache_bytes // (self.row_bytes + 16), self.row_bytes)
            self._units = max(1, _STAGING_BYTES // self.unit)
            self.staging = HostBuffer(self._units * self.unit, pin=False)
            ahead_units = min(options.tuning.queue_depth, self._units)
            self._ahead_buf = HostBuffer(ahead_units * self.unit, pin=False)
            self.blocks_read = 0
            self.bytes_read = 0
            # verify_reads: blocks a read unit holds only in part are read through this one
            self._check_fd = os.open(table.data_path, os.O_RDONLY) if self.checks else None
            self.engine, self._core = self._open_core(lay)
        except BaseException:
            self._release()
            raise

    @property
    def reads_in_flight(self) -> bool:
        """Reads started by prefetch that no read has collected yet."""
        return not self._closed and self._core.inflight()

    def _open_core(self, lay) -> tuple:
        """(io engine, DirectCore): the compiled core's io_uring where it works, else the
        reference's preads (io_engine="threads", native="off", or io_uring refused: announced
        where the engine was auto)."""
        tuning, c = self.options.tuning, self.cache
        core = native.load(tuning.native)
        rows_per_block, block, stride = native.layout_rule(lay)
        args = dict(
            fd=self.fd, file_size=self.size, data_offset=DATA_OFFSET, unit=self.unit,
            step=self._step, row_bytes=self.row_bytes, rows_per_block=rows_per_block,
            block=block, stride=stride, staging=self.staging.array, ahead=self._ahead_buf.array,
            queue_depth=tuning.queue_depth, tags=c.tags, stamp=c.stamp, data=c.data,
            threads=native.memory_threads(tuning.threads),
        )  # fmt: skip
        if self.checks is not None:
            args.update(crcs=self.checks.crcs, check_unit=self.checks.unit,
                        data_bytes=self.table.data_bytes, check_fd=self._check_fd)  # fmt: skip
        reference = native.load("off")
        if tuning.io_engine == "threads" or core is reference:
            if tuning.io_engine == "io_uring":
                raise OSError(
                    errno.EINVAL,
                    "io_engine='io_uring' reads through the compiled host core, and this table "
                    "runs on its numpy reference (native=off, or not built): use "
                    "io_engine='threads' or 'auto'",
                )
            return "threads", reference.DirectCore(**args)
        try:
            return "io_uring", core.DirectCore(**args)
        except OSError as e:
            if tuning.io_engine == "io_uring":
                raise OSError(
                    e.errno, f"io_uring unavailable ({e}); use io_engine='threads'"
                ) from None
            _announce_threads(str(e))
            return "threads", reference.DirectCore(**args)

    def prefetch(self, rows: np.ndarray) -> None:
        """Start the reads of rows the cache lacks now (up to one queue's worth) and return:
        the disk works while the caller launches the layers before the PLE layer, and `read`
        collects them. A decode step's 16-128 rows then cost the caller almost no wait."""
        if self._closed:
            return
        k = self._core.prefetch(rows)
        self.blocks_read += k
        self.bytes_read += k * self.unit

    def read(self, rows: np.ndarray, out: np.ndarray) -> ReadStats:
        """One call of the core: probe, reads, checks, placing, admission (inline, in the
        caller's thread). Its read errors (either core's) name the offset; this adds the file."""
        try:
            return self._read_rows(rows, out)
        except OSError as e:
            if str(self.table.data_path) in str(e):
                raise
            raise OSError(e.errno, f"{self.table.data_path}: {e.strerror or e}") from e

    def _read_rows(self, rows: np.ndarray, out: np.ndarray) -> ReadStats:
        self._check_open()
        n = len(rows)
        if n == 0:
            return ReadStats()
        t0 = time.perf_counter()
        hits, blocks, ahead, bad = self._core.read(rows, out, out.shape[1], self.stream_stores)
        if bad >= 0:
            raise self.checks.mismatch(bad)
        self.cache.count(hits, n - hits)
        self.blocks_read += blocks
        self.bytes_read += blocks * self.unit
        return ReadStats(
            rows=n,
            cache_hits=hits,
            blocks_read=blocks + ahead,
            bytes_read=(blocks + ahead) * self.unit,
            seconds=time.perf_counter() - t0,
        )

    def host_parts(self) -> tuple[HostPart, ...] | None:
        if self._closed:
            return None
        return (HostPart(self.row_range.start, self.row_range.end, self._core),)

    def fed_reads(self, reads: FedReads) -> None:
        self.cache.count(reads.hits, reads.misses)
        self.blocks_read += reads.blocks
        self.bytes_read += reads.blocks * self.unit

    def drop_cache(self) -> None:
        self._check_open()
        self._core.clear()

    def _staging_bytes(self) -> int:
        return self.staging.nbytes + self._ahead_buf.nbytes

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
        self._core.close()  # waits for its reads in flight before the buffers go
        self._release()

    def _release(self) -> None:
        for buf in (self._ahead_buf, self.staging):
            if buf is not None:
                buf.close()
        os.close(self.fd)
        if self._check_fd is not None:
            os.close(self._check_fd)
