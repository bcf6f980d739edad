"""The one interface every storage tier implements.

A tier holds (or reaches) the packed rows of one table and copies the bytes of requested rows
into a buffer. It never decodes: rows stay bytes until the GPU (or the CPU fallback) decodes
them. `read` takes this rank's global row ids in the lookup's order, repeats included (the
lookup has dropped other ranks' ids; nothing sorts them).
"""

from __future__ import annotations

import threading
from abc import ABC
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

import numpy as np
import torch

from plestore import native
from plestore.native.constants import WARM_READS
from plestore.options import TableOptions
from plestore.tablefile import TableFile
from plestore.tablefile.checksums import checks_for

__all__ = [
    "check_fits",
    "FedReads", "GatherSource", "HostPart", "PooledReading", "ReadStats", "Reading", "RowRange",
    "Tier",
]  # fmt: skip


@dataclass(frozen=True)
class RowRange:
    """The global rows [start, end) this process serves; other rows are absent (zeros, no I/O).

    The only place global row ids become local ones (tiers that hold a slice index it with
    `local`)."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"row range [{self.start}, {self.end}) is not a valid range")

    @property
    def rows(self) -> int:
        return self.end - self.start

    def local(self, rows: Any) -> Any:
        return rows - self.start

    def holds(self, rows: np.ndarray) -> np.ndarray:
        """Boolean mask: which global row ids are this range's."""
        return (rows >= self.start) & (rows < self.end)

    @staticmethod
    def for_rank(total_rows: int, rank: int, world: int) -> RowRange:
        """Vocab-parallel split as the engines do it: ceil(rows / world) rows per rank."""
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in [0, {world})")
        per = -(-total_rows // world)
        return RowRange(min(rank * per, total_rows), min((rank + 1) * per, total_rows))


@dataclass
class ReadStats:
    """What one `read` did (host tiers fill what applies to them)."""

    rows: int = 0
    cache_hits: int = 0
    blocks_read: int = 0
    bytes_read: int = 0  # bytes this tier read from storage
    major_faults: int = 0  # page faults taken by the threads that read (mapped)
    minor_faults: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def add(self, other: ReadStats) -> None:
        for k in _READ_STATS:  # (asdict deep-copies: slow)
            setattr(self, k, getattr(self, k) + getattr(other, k))


_READ_STATS = tuple(f.name for f in fields(ReadStats))


class Reading:
    """A tier's read of rows into out, handed over a prefix at a time (`Tier.start_read`), so
    the host path copies each prefix to the GPU while the rest is read: ready(k) returns once
    out's first k rows are written, done() once all are (the read's ReadStats), close() ends a
    read given up on (nothing writes out after it). This one reads `chunk` rows at a time (the
    tier's `read_chunk_rows`), as they are asked for."""

    def __init__(
        self, tier: Tier, rows: np.ndarray, out: np.ndarray, chunk: int | None = None
    ) -> None:
        self.tier, self.rows, self.out = tier, rows, out
        self.chunk = max(1, chunk or tier.read_chunk_rows)
        self.stats = ReadStats()
        self._upto = 0  # rows [0, _upto) are in out

    def ready(self, k: int) -> None:
        chunk, n = self.chunk, len(self.rows)
        while self._upto < min(k, n):
            a, b = self._upto, min(n, self._upto + chunk)
            self.stats.add(self.tier.read(self.rows[a:b], self.out[a:b]))
            self._upto = b

    def done(self) -> ReadStats:
        self.ready(len(self.rows))
        return self.stats

    def close(self) -> None:
        """Nothing runs between calls here."""

    def copy_to(self, raw: torch.Tensor, staged: torch.Tensor, chunk: int) -> None:
        """Queue out's rows for their copy to raw (uint8 [n, stride], on the GPU as a lookup's
        is) on the current stream, `chunk` rows at a time, each chunk as soon as it is ready: a
        chunk's copy overlaps the read of the next. staged: out's bytes as a (pinned) tensor."""
        n, rb = raw.shape
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            self.ready(b)
            raw[a:b].copy_(staged[a * rb : b * rb].view(b - a, rb), non_blocking=True)


class PooledReading(Reading):
    """A read as one native gather begun on the pool (`gather_start`, pieces of GRAIN rows, so
    the first chunk is done early): ready(k) waits for its first k rows; `finish` makes the
    gather's result (bad, major, minor, bytes) the read's ReadStats, raising for a bad row."""

    GRAIN = 512

    def __init__(
        self,
        tier: Tier,
        rows: np.ndarray,
        out: np.ndarray,
        job: Any,
        finish: Callable[[tuple], ReadStats],
    ) -> None:
        super().__init__(tier, rows, out)
        self._job, self._finish = job, finish
        self._stats: ReadStats | None = None

    def ready(self, k: int) -> None:
        if self._job.wait(k) >= 0:  # a bad row so far: done() raises naming it
            self.done()

    def done(self) -> ReadStats:
        if self._stats is None:  # (the tier's bookkeeping once)
            self._stats = self._finish(self._job.finish())
        return self._stats

    def close(self) -> None:
        self._job.finish()

    def copy_to(self, raw: torch.Tensor, staged: torch.Tensor, chunk: int) -> None:
        """Reading.copy_to in one native call where CUDA's copy function is found
        (`GatherJob.copy`): no Python between chunks, where each copy queued from Python cost
        the caller's thread time while the pool gathered. measured: RESULTS.md "host time, part
        by part"."""
        h2d = native.cuda_h2d() if raw.is_cuda else None
        if h2d is None:
            return super().copy_to(raw, staged, chunk)
        if raw.numel() < len(self.rows) * self.out.shape[1] or not raw.is_contiguous():
            raise ValueError("copy_to: raw must be contiguous and hold every staged row")
        stream = torch.cuda.current_stream(raw.device).cuda_stream
        bad, err = self._job.copy(raw.data_ptr(), stream, chunk, h2d)
        if bad >= 0:
            self.done()  # (raises, naming the row)
        if err:
            raise RuntimeError(
                f"queueing a copy of staged rows to the GPU failed: {native.cuda_error(err)}"
            )


@dataclass(frozen=True)
class GatherSource:
    """A tier whose read() is one native gather from host memory, as the gather's arguments (a
    graph feed's host side runs it in C without the GIL: native feed_serve). `file`: (fd, size,
    link count, change time) checked before each read (a mapping), or None; `checks`:
    verify_reads' (crcs uint32, check unit, data bytes) the blocks of each read's rows are
    checked against in `src`, or None."""

    src: Any  # the buffer the rows lie in (a file's mapping, pinned DRAM)
    src_offset: int
    row_bytes: int  # bytes copied a row (a padded tier's whole stride)
    base: int  # ids are global; row (id - base) of the layout
    rule: tuple[int, int, int]  # native.layout_rule's (rows per block, block, stride)
    threads: int  # a warm read's
    cold_threads: int  # a read that faults (a mapping's)
    file: tuple | None = None
    #: reads in a row that needed no disk: below WARM_READS the source is cold (a mapping's
    #: pages advised first); the fed steps' count comes back in FedReads.clean
    clean: int = WARM_READS
    checks: tuple | None = None


@dataclass(frozen=True)
class HostPart:
    """Rows [lo, hi) of a read the host core runs whole without Python (a graph feed's host
    step): a plain gather (`GatherSource`) or the direct tier's `DirectCore` (its row cache,
    block reads and checks, under its own lock)."""

    lo: int
    hi: int
    source: Any  # a GatherSource or a DirectCore (either host core's)


@dataclass(frozen=True)
class FedReads:
    """Reads a graph feed's host steps made outside read() since they were last counted."""

    steps: int
    faulted: bool  # some took page faults
    hits: int = 0  # the direct core's row cache hits and misses, and its block reads
    misses: int = 0
    blocks: int = 0
    #: a mapping's reads in a row that needed no disk after the last fed step (None: no file)
    clean: int | None = None


class Tier(ABC):
    """Base of the four tiers: device, pinned, mapped, direct."""

    name: ClassVar[str]
    #: read(rows_np, out_np) fills a host buffer (then staged to the device by the engine)
    can_read_host: ClassVar[bool] = True
    #: rows per read() of a large lookup: the host path copies each chunk to the GPU while the
    #: tier reads the next
    read_chunk_rows: ClassVar[int] = 16384
    #: reads go to storage (disk bytes and page faults are worth measuring per lookup)
    reads_storage: ClassVar[bool] = True
    #: read() counts every byte it takes from storage (direct: O_DIRECT, no page cache, no
    #: readahead; mapped: each reading thread's own read_bytes), so a lookup's disk bytes need
    #: no read of /proc/self/io (two per lookup)
    exact_disk_bytes: ClassVar[bool] = False
    #: prefetch() helps even right before read() (a lookup the caller waits on at once)
    prefetch_before_read: ClassVar[bool] = False

    def __init__(
        self, table: TableFile, row_range: RowRange, device: torch.device, options: TableOptions
    ) -> None:
        self.table = table
        self.spec = table.spec
        self.row_bytes = table.layout.row_bytes
        #: bytes per row of the host buffer read() fills (a tier may pad rows, e.g. to 16 B)
        self.staging_stride = self.row_bytes
        self.row_range = row_range
        self.device = device
        #: read()'s rows go to the device by DMA, not to the CPU: the native gather stores them
        #: past the CPU's caches (measured: RESULTS.md "host time, part by part")
        self.stream_stores = device.type == "cuda"
        self.options = options
        self._closed = False
        self._lock = threading.Lock()
        #: the block checksums reads are checked with (options.verify_reads), else None
        self.checks = checks_for(table, options)

    def gather_source(self) -> GatherSource | None:
        """read() as one plain native gather from host memory (its blocks' checks with it), or
        None (a tier whose read is more: block reads, a row cache)."""
        return None

    def host_parts(self) -> tuple[HostPart, ...] | None:
        """read() as parts the host core runs without Python, a row read by the first part
        holding it; None: none (a closed tier)."""
        g = self.gather_source()
        return None if g is None else (HostPart(self.row_range.start, self.row_range.end, g),)

    def fed_reads(self, reads: FedReads) -> None:
        """Reads of host_parts() that ran outside read() (a graph feed's), for a tier that
        counts or watches its reads."""
        return None

    def check_file(self) -> None:
        """Raise, naming the file and what happened to it, where the file a host part checks
        before each read (a mapping's) was truncated, removed or replaced since open; a file
        only touched is taken as still the tier's (its host parts then describe it anew)."""
        return None

    def read(self, rows: np.ndarray, out: np.ndarray) -> ReadStats:
        """Copy rows' packed bytes into out[i] (host uint8 [>= n, staging_stride]); rows are numpy
        int64 global ids in this tier's range, repeats possible. Raises
        OSError on any I/O failure; never leaves a row silently unwritten."""
        raise NotImplementedError(f"the {self.name} tier does not read into host memory")

    def start_read(self, rows: np.ndarray, out: np.ndarray) -> Reading:
        """read(rows, out), handed over a prefix at a time (see `Reading`)."""
        return Reading(self, rows, out)

    def device_rows(self) -> torch.Tensor | None:
        """The rows as uint8 [rows, stride] that the lookup's GPU kernel may read directly
        (device memory, or registered host memory), or None."""
        return None

    @property
    def can_read_device(self) -> bool:
        return self.device_rows() is not None

    def on_storage(self, rows: np.ndarray) -> np.ndarray:
        """Mask of the rows a read takes from storage (not from this tier's memory)."""
        return np.full(len(rows), self.reads_storage)

    def prefetch(self, rows: np.ndarray) -> None:  # noqa: B027 - optional hint, default: none
        """Hint that rows will be read soon (e.g. start their I/O). Optional."""

    def drop_cache(self) -> None:  # noqa: B027 - memory tiers hold no cache
        """Forget every row this tier cached (row cache, the mapping's pages), so the next
        reads go to storage: for cold measurements."""

    def host_bytes(self) -> int:
        """Host memory this tier holds now (buffers, cache, mapping resident set)."""
        return 0

    def host_budget(self) -> int | None:
        """The bound host_bytes is held to, where the tier has one."""
        return None

    def device_bytes(self) -> int:
        return 0

    def describe(self) -> dict:
        return {
            "tier": self.name,
            "reads_host": self.can_read_host,
            "reads_device": self.can_read_device,
            "row_range": [self.row_range.start, self.row_range.end],
            "host_bytes": self.host_bytes(),
            "host_budget": self.host_budget(),
            "device_bytes": self.device_bytes(),
        }

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name} tier of table {self.spec.name} is closed")

    def close(self) -> None:
        self._closed = True

    # -- shared helpers ------------------------------------------------------------------------
    def _progress_bar(self, what: str):
        """A callable progress(nbytes) drawing a byte-rate bar on stderr, or None."""
        if not self.options.progress:
            return None
        from tqdm import tqdm

        bar = tqdm(
            total=self.row_range.rows * self.row_bytes,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=f"{self.spec.name}: {what}",
            leave=False,
        )
        self._bars = getattr(self, "_bars", []) + [bar]
        return bar.update

    def _stream_range(self, sink, progress=None) -> None:
        """Stream this tier's row range from the table file in order (`TableFile.stream`: the
        page cache let go behind): sink(first_local, rows)."""
        start = self.row_range.start
        try:
            self.table.stream(
                start,
                self.row_range.end,
                lambda f, rows: sink(f - start, rows),
                self.checks,
                progress,
            )
        finally:
            for bar in getattr(self, "_bars", []):
                bar.close()


def check_fits(
    name: str, tier: str, row_range, nbytes: int, available: int, where: str, remedy: str = ""
) -> None:
    """Refused before any row is loaded: a range larger than the memory available to hold it
    (a host fill would be killed part-way). available 0: unknown, nothing to refuse by."""
    if available and nbytes > available:
        raise MemoryError(
            f"table {name}: the {tier} tier needs {nbytes / 2**30:.1f} GiB of {where} memory for "
            f"rows [{row_range.start}, {row_range.end}) and {available / 2**30:.1f} GiB is "
            "available: "
            + (
                remedy
                or "choose tier 'direct', 'cascade' or 'auto' (which picks one that fits), or "
                "split the rows over more ranks"
            )
        )
