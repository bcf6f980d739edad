"""`mapped` tier: the table file mmap'd read-only; rows come through the page cache.

A read is one gather of the host core: cold, with `threads` workers, so many faults are in
flight (the engines' file backends fault one row at a time); warm, on one thread per core at
most, with no Python thread handoffs (measured: RESULTS.md "e2e: host gathers"). Option
`willneed` advises WILLNEED on a read's pages first; off by default (RESULTS.md "Tried, not
kept"). MADV_RANDOM turns off readahead (tens of KiB per row).
A background thread holds the mapping's resident set at `rss_budget_bytes`, dropping it in 1 GiB
slices (MADV_DONTNEED, then POSIX_FADV_DONTNEED so the page cache lets go too). A truncated or
replaced file raises before a read: touching a truncated mapping would SIGBUS the process.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import time

import numpy as np

from plestore import native
from plestore.native.constants import COLD_GRAIN, COLD_ROWS, PROBE_ROWS, WARM_GRAIN, WARM_READS
from plestore.tablefile import DATA_OFFSET
from plestore.tiers.base import (
    FedReads,
    GatherSource,
    PooledReading,
    Reading,
    ReadStats,
    Tier,
)

__all__ = ["MappedTier", "mapping_rss"]

_PAGE = mmap.PAGESIZE
_SLICE = 1 << 30  # resident-set trimming granularity (as SGLang's trimmer)
_RECHECK_S = 4.0  # the trimmer's check after reads that took no page fault, at most this often
#: the option `willneed` advises reads of more rows than this (one madvise per page)
_WILLNEED_ROWS = 256
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


def mapping_rss(path: str) -> int:
    """Bytes resident in this process's mappings of `path` (sum of Rss over its VMAs).

    Read in one call and searched as bytes: a CUDA process has thousands of mappings, and
    parsing its smaps line by line held the GIL for milliseconds per check, stalling the thread
    that launches the model's kernels (measured: RESULTS.md "host time, part by part")."""
    try:
        with open("/proc/self/smaps", "rb") as f:
            smaps = f.read()
    except OSError:
        return 0
    header_end = b" " + os.fsencode(path) + b"\n"  # a VMA's header line ends with its path
    total, at = 0, smaps.find(header_end)
    while at >= 0:
        rss = smaps.find(b"\nRss:", at)  # the VMA's own Rss: its fourth line
        if rss < 0:
            break
        end = smaps.find(b"kB", rss)
        total += int(smaps[rss + 5 : end]) * 1024
        at = smaps.find(header_end, end)
    return total


class MappedTier(Tier):
    name = "mapped"
    can_read_host = True
    #: every thread that reads through the mapping counts its own disk bytes (per-thread
    #: read_bytes), so a lookup needs no /proc/self/io read before and after it
    exact_disk_bytes = True
    #: cold, WILLNEED hands the kernel every page at once, so read()'s faults wait on reads
    #: already in flight; warm it costs one comparison. measured: RESULTS.md "Tried, not kept"
    prefetch_before_read = True

    def __init__(self, table, row_range, device, options) -> None:
        super().__init__(table, row_range, device, options)
        self.path = os.path.realpath(table.data_path)
        self._core = native.load(options.tuning.native)  # (may refuse: before the fd is open)
        self.fd = os.open(self.path, os.O_RDONLY)
        st = os.fstat(self.fd)
        self._size, self._identity = st.st_size, (st.st_dev, st.st_ino)
        self._seen = (st.st_nlink, st.st_ctime_ns)  # (see check_file)
        try:
            self.map = mmap.mmap(self.fd, self._size, mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(self.fd)
            raise
        self.map.madvise(mmap.MADV_RANDOM)
        probe = np.frombuffer(self.map, np.uint8, count=1)
        self._base = probe.ctypes.data  # the mapping's address, for madvise through ctypes
        del probe
        self._ahead_bytes = 0  # disk bytes prefetch()'s WILLNEED read, for the next read()
        self._ahead_lock = threading.Lock()
        self._warm_threads = native.memory_threads(options.tuning.threads)
        self._rule = native.layout_rule(table.layout)  # (rows per block, block, stride)
        self._region = np.frombuffer(self.map, np.uint8)[DATA_OFFSET:] if self.checks else None
        self.trims = 0
        # cold (prefetch() advises the next rows' pages) from a read that needed the disk until
        # two reads in a row did not (_note_read)
        self._cold, self._clean = False, WARM_READS
        self._reads = 0  # read() calls so far
        # reads that may have mapped pages (the trimmer checks Rss after them): those that took
        # page faults (the core counts every reading thread's)
        self._grew = 0
        self._rss = 0
        self._stop = threading.Event()
        self._trimmer = threading.Thread(
            target=self._trim_loop, daemon=True, name="plestore-rss-trim"
        )
        self._trimmer.start()

    # -- reads -------------------------------------------------------------------------------
    def check_file(self) -> None:
        """Raise if the file under the mapping was truncated (a read past its end would SIGBUS
        the process), removed or replaced since open. One fstat a read (the host core's, in
        one call): its size, link count and change time; a rename, link or unlink of the file
        moves the last two, and only then is its path looked up (a stat of the path every read
        costs a decode lookup: measured: RESULTS.md "host time, part by part")."""
        if not self._core.check_file(self.fd, self._size, *self._seen):
            return
        st = os.fstat(self.fd)  # (also where the core saw a change: again, for the message)
        if (st.st_nlink, st.st_ctime_ns) != self._seen:
            try:
                named = os.stat(self.path)
            except FileNotFoundError:
                raise OSError(
                    errno.ESTALE,
                    f"table data file {self.path} was removed after open; reopen the table",
                ) from None
            if st.st_nlink == 0 or (named.st_dev, named.st_ino) != self._identity:
                raise OSError(
                    errno.ESTALE,
                    f"table data file {self.path} was replaced after open; reopen the table",
                )
            self._seen = (st.st_nlink, st.st_ctime_ns)  # touched, linked, resized: still ours
        if st.st_size < self._size:
            raise OSError(
                errno.EIO,
                f"table data file {self.path} was truncated after open "
                f"({st.st_size} of {self._size} bytes); refusing to read it",
            )

    def read(self, rows: np.ndarray, out: np.ndarray) -> ReadStats:
        """One gather of the host core: offsets from the layout, cold on `threads` threads in
        16-row pieces (so many faults wait at once), warm on one thread per core at most; the
        faults of every gathering thread counted. verify_reads: the rows' blocks are checked
        first, as the mapping holds them."""
        self._check_open()
        n = len(rows)
        if n == 0:
            return ReadStats()
        self.check_file()
        self._reads += 1
        t0 = time.perf_counter()
        if self.checks is not None:
            self.checks.check_region(rows, self._region)
        head = self.table.layout.offsets(rows[:PROBE_ROWS]) if self._cold else None
        cold = n >= COLD_ROWS and head is not None and self._looks_cold(head)
        tuning = self.options.tuning
        threads, grain = (tuning.threads, COLD_GRAIN) if cold else (self._warm_threads, WARM_GRAIN)
        before = self._before_gather(rows)
        result = self._core.gather(
            *self._gather_args(rows, out, threads), grain, True, DATA_OFFSET, self._cold,
            self.stream_stores,
        )  # fmt: skip
        return self._after_gather(rows, result, before, t0)

    def start_read(self, rows: np.ndarray, out: np.ndarray) -> Reading:
        """Warm and past a chunk: one gather begun on the pool, waited for a chunk at a time
        (cold reads stay chunk by chunk: their faults wait on the disk)."""
        if self._cold or len(rows) <= self.read_chunk_rows:
            return Reading(self, rows, out)
        self._check_open()
        self.check_file()
        self._reads += 1
        if self.checks is not None:
            self.checks.check_region(rows, self._region)
        t0, before = time.perf_counter(), self._before_gather(rows)
        job = self._core.gather_start(
            *self._gather_args(rows, out, self._warm_threads), grain=PooledReading.GRAIN,
            count_faults=True, src_offset=DATA_OFFSET, streaming=self.stream_stores,
        )  # fmt: skip
        return PooledReading(
            self, rows, out, job, lambda res: self._after_gather(rows, res, before, t0)
        )

    def gather_source(self) -> GatherSource | None:
        """The mapping, checked by one fstat a read (as check_file); verify_reads: the rows'
        blocks checked in it against the table's CRC-32s (as read() checks them)."""
        if self._closed:
            return None
        file = (self.fd, self._size, *self._seen)
        src, threads = self.map, self.options.tuning.threads
        rb, warm = self.row_bytes, self._warm_threads
        clean = min(self._clean, WARM_READS)
        c = self.checks
        checks = None if c is None else (c.crcs, c.unit, self.table.data_bytes)
        return GatherSource(src, DATA_OFFSET, rb, 0, self._rule, warm, threads, file, clean, checks)

    def fed_reads(self, reads: FedReads) -> None:
        self._reads += reads.steps
        self._grew += reads.faulted  # (the trimmer checks Rss after reads that faulted)
        if reads.clean is not None:  # (the fed steps' reads end or begin a cold phase too)
            self._clean = reads.clean
            self._cold = self._clean < WARM_READS

    def _gather_args(self, rows: np.ndarray, out: np.ndarray, threads: int) -> tuple:
        rpb, block, stride = self._rule
        return self.map, rows, out, out.shape[1], self.row_bytes, 0, rpb, block, stride, threads

    def _before_gather(self, rows: np.ndarray) -> int:
        """Bytes read for these rows before their gather: WILLNEED's (option willneed) and an
        earlier prefetch's."""
        advise = self.options.tuning.willneed and len(rows) > _WILLNEED_ROWS
        disk = max(0, self._advise(rows, 0)) if advise else 0
        return disk + self._take_ahead()

    def _after_gather(self, rows: np.ndarray, result: tuple, before: int, t0: float) -> ReadStats:
        bad, major, minor, gathered = result
        if bad >= 0:
            raise IndexError(f"row {int(rows[bad])} lies outside table file {self.path}")
        self._note_read(major > 0 or before > 0)
        if major or minor:  # a page newly mapped (a fault-free read maps nothing)
            self._grew += 1
        return ReadStats(
            rows=len(rows),
            bytes_read=before + gathered,
            seconds=time.perf_counter() - t0,
            major_faults=major,
            minor_faults=minor,
        )

    def prefetch(self, rows: np.ndarray) -> None:
        """While the table is cold, ask the kernel for the pages of the next lookup's rows at
        once (WILLNEED), so their I/O overlaps the caller's work until result(). Warm, this
        costs one comparison."""
        if self._cold and len(rows) and not self._closed:
            disk = self._advise(np.ascontiguousarray(rows, np.int64), PROBE_ROWS)
            if disk > 0:
                with self._ahead_lock:  # the next read counts it (the lookup's own)
                    self._ahead_bytes += disk

    def _advise(self, rows: np.ndarray, probe: int) -> int:
        """WILLNEED on the pages of rows; the bytes the kernel read doing it, or -1 (nothing
        advised) when probe > 0 and the pages of the first `probe` rows are resident. One call
        of the host core."""
        rpb, block, stride = self._rule
        return self._core.willneed(
            self.map, rows, self.row_bytes, 0, rpb, block, stride, DATA_OFFSET, probe
        )

    def _note_read(self, needed_disk: bool) -> None:
        """A read needed the disk: major faults, or pages its own or a prefetch's WILLNEED read
        (its faults then find them in flight: no major fault, yet the table is cold). The table
        stays cold until two reads in a row need none: another lookup's read may take the bytes
        a prefetch read for the next one."""
        self._clean = 0 if needed_disk else self._clean + 1
        self._cold = self._clean < WARM_READS

    def _take_ahead(self) -> int:
        """The disk bytes prefetch() read since the last read, reset."""
        if not self._ahead_bytes:  # (read without the lock first: warm, it is 0)
            return 0
        with self._ahead_lock:
            ahead, self._ahead_bytes = self._ahead_bytes, 0
        return ahead

    def _looks_cold(self, offs: np.ndarray) -> bool:
        """Whether reading rows at offs will wait on the disk: the table is cold and the pages
        of a sample of these rows are not all in the page cache. The sample makes the first
        lookup after a cold phase take the warm path if its rows are resident (reads taking no
        fault then end the cold phase). measured: RESULTS.md "e2e: host gathers"."""
        if not self._cold:
            return False
        vec = ctypes.c_ubyte()
        for page in np.unique((offs[:PROBE_ROWS] + DATA_OFFSET) // _PAGE).tolist():
            addr = self._base + page * _PAGE
            if _libc.mincore(addr, _PAGE, ctypes.byref(vec)) or not vec.value & 1:
                return True  # not resident (or unknown): cold
        return False

    # -- resident-set budget -----------------------------------------------------------------
    def _trim_loop(self) -> None:
        """Rss grows only where a read faults (each fault maps its page and fault-around's
        neighbours): checked 0.25 s after such reads, and after fault-free reads only every
        _RECHECK_S (growth without a fault of ours: khugepaged collapsing a range into a huge
        page). A check reads /proc/self/smaps, which is slow (more so in a CUDA process)."""
        grew, reads, last = -1, -1, 0.0
        while not self._stop.wait(0.25):
            now = time.monotonic()
            if self._grew == grew and (self._reads == reads or now - last < _RECHECK_S):
                continue
            grew, reads, last = self._grew, self._reads, now
            try:
                self.trim()
            except (OSError, ValueError):
                return  # the mapping is gone (closing)

    def trim(self) -> int:
        """Drop the mapping's pages in 1 GiB slices until its Rss is under budget. Returns the
        Rss afterwards."""
        budget = self.options.rss_budget_bytes
        rss = self._rss = mapping_rss(self.path)
        start = 0
        while rss > budget and start < self._size and not self._stop.is_set():
            length = min(_SLICE, self._size - start)
            self.map.madvise(mmap.MADV_DONTNEED, start, length)
            os.posix_fadvise(self.fd, start, length, os.POSIX_FADV_DONTNEED)
            self.trims += 1
            start += length
            time.sleep(0.005)
            rss = self._rss = mapping_rss(self.path)
        return rss

    def drop_cache(self) -> None:
        """Unmap every page and drop the file from the page cache (fadvise alone cannot drop
        pages a live mapping holds)."""
        self._check_open()
        self.map.madvise(mmap.MADV_DONTNEED)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        self._rss = 0
        self._cold, self._clean = True, 0  # every row is on the disk (reads check: mincore)

    def host_bytes(self) -> int:
        return self._rss if self._trimmer.is_alive() else mapping_rss(self.path)

    def host_budget(self) -> int | None:
        return self.options.rss_budget_bytes

    def describe(self) -> dict:
        return {**super().describe(), "trims": self.trims, "willneed": self.options.tuning.willneed}

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self._stop.set()
        self._trimmer.join()
        self._region = None
        try:
            self.map.close()
        except BufferError:
            pass  # a returned view still references the mapping; it closes with it
        os.close(self.fd)
