"""The user-facing `Table`: row ids in, bf16 rows out on the device — from any tier, exactly.

    ids [..., k] -> validate -> this rank's? -> index -> tier.read -> pinned staging
                                (others: zeros, no I/O)                        | H2D, copy stream
    out [..., k*dim] bf16 <- caller's stream waits on an event <- decode + scatter

`prefetch(ids)` starts this as soon as the ids exist and returns a `Pending`; host work runs on
the table's worker thread, GPU work on its own stream. `Pending.result()` makes the caller's
stream wait on an event: the consumer's host thread blocks only while the tier's host work is
unfinished, and never synchronises the GPU. Tiers that read on the device (the resident table,
or the GPU reading pinned memory) skip the host steps and launch straight onto the stream.

Decode-sized host lookups (at most `inline_ids`) run in the caller's thread instead, when their
result is asked for: by then the caller has queued the GPU work in between (layer 0), which
runs while the host gathers; one kernel then reads the staged rows from pinned memory onto the
caller's stream (no copies, no cross-stream events: a decode step pays for launches). A worker
thread is no help at this size: it needs the GIL from a caller busy launching kernels and waits
up to the interpreter's 5 ms switch interval per handoff — on the H200 that cost mapped and
direct decode steps 30-45% (plestore bench e2e, 2026-11-29). Their cold reads still start at
`prefetch` (`Tier.prefetch`: direct submits them, a cold mapped table advises WILLNEED).
`lookup()` waits at once, so it takes the fastest path rather than the one that overlaps best.
`prefetch(defer=True)` leaves any size to the caller's thread (`Pending.run_now()`), for a
caller that knows the next step's ids a whole step ahead and would idle until the GPU finishes;
run so, its GPU work goes on the table's stream, beside the step the caller queued.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from plestore.formats import get_format
from plestore.kernels.gather_decode import gather_decode
from plestore.lookup.hostpath import HostPath
from plestore.lookup.metrics import CallRecord, Metrics
from plestore.lookup.pending import Pending
from plestore.lookup.staged import StagedLookup
from plestore.options import TableOptions
from plestore.tablefile import TableFile
from plestore.tiers import RowRange, choose_tier, make_tier

__all__ = ["Pending", "Table", "open_table"]

log = logging.getLogger("plestore")

#: pinned tier, gather="auto": lookups of at most this many ids let the GPU read pinned memory
#: directly; larger ones gather on the host and copy once. Alone, the GPU read is faster up to
#: ~32,768 ids (H200, 2 GiB table: 16,384 ids 0.48 GPU vs 0.62 ms host, 32,768 0.88 vs 0.83,
#: 65,536 1.47 vs 1.18; benchmarks/probe_gather.py, 2026-11-29); beside a running step, past it
#: the host path's copy engine leaves the SMs to the step: a batch-64 prefill's first chunk of
#: 131,072 ids read by the GPU cost its steps 0.990 of the resident's, host-gathered 0.997
#: (plestore bench e2e, H200, 2026-12-01; gather=cpu beside auto).
GPU_GATHER_MAX_IDS = 32768
#: gather=auto: a lookup run a step ahead is gathered on the host past this many ids (below,
#: the GPU reads it). At 2,048 ids (a batch-1 prefill chunk) the host path put a 1.5-1.9 ms
#: slower step into 1-3 of 8 repetitions (pinned 0.973-0.991 of the resident's), the GPU read
#: into none (0.997-1.000); at 16,384 the host path wins (0.988 -> 1.002). H200, plestore
#: bench e2e, 2026-12-01 (benchmarks/RESULTS.md, seventh session).
AHEAD_GPU_MAX_IDS = 4096


def open_table(
    path: str,
    tier: str | None = None,
    device: str | None = None,
    table: str | None = None,
    **options: Any,
) -> Table:
    """Open a packed table (its .json, its .rows, or the directory holding it) on a tier.

    tier: auto | device | pinned | mapped | direct (AUTO: the fastest that fits, logged).
    device: where rows are delivered (default: cuda if available, else cpu).
    options: any `TableOptions` field (row_start/row_end for this rank's rows, threads,
    queue_depth, cache_bytes, rss_budget_bytes, timeout_s, ...); PLESTORE_* env vars too.
    """
    opts = TableOptions.from_env(tier=tier, device=device, **options)
    return Table(TableFile.open(path, table), opts)


class Table:
    """A table opened on a tier. Thread-safe; use as a context manager or call close()."""

    def __init__(self, file: TableFile, options: TableOptions) -> None:
        self.file = file
        self.spec = file.spec
        self.options = options
        self.format = get_format(self.spec.format)
        self.dim = self.spec.dim
        self.device = _resolve_device(options.device)
        end = self.spec.rows if options.row_end is None else options.row_end
        self.row_range = RowRange(options.row_start or 0, end)
        if self.row_range.end > self.spec.rows:
            raise ValueError(
                f"row range ends at {end}, table {self.spec.name} has {self.spec.rows} rows"
            )
        self.tier_choice = choose_tier(file, self.row_range, self.device, options)
        log.info(
            "plestore: table %s on tier %s (%s)",
            self.spec.name,
            self.tier_choice.name,
            self.tier_choice.reason,
        )
        self.tier = make_tier(self.tier_choice.name, file, self.row_range, self.device, options)
        self.metrics = Metrics(self.spec.name, self.tier.name)
        self.gpu_cache = _gpu_cache(self, options)
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"plestore-{self.spec.name}")
        self._host = HostPath(self)  # tier reads into pinned staging, then one kernel
        self._staged: list[StagedLookup] = []
        self._lock = threading.Lock()
        self._closed = False

    # -- public API --------------------------------------------------------------------------
    def lookup(
        self, row_ids: Any, label: str = "lookup", timeout: float | None = None
    ) -> torch.Tensor:
        """bf16 [..., k * dim] on the table's device for row ids [..., k]."""
        return self._start(row_ids, label, None, sync=True).result(timeout)

    def lookup_into(
        self, row_ids: Any, out: torch.Tensor, label: str = "lookup", timeout: float | None = None
    ) -> torch.Tensor:
        """Like lookup, writing into a caller-owned bf16 [..., k * dim] buffer (fixed addresses
        for CUDA graphs)."""
        return self._start(row_ids, label, out, sync=True).result(timeout)

    def prefetch(
        self,
        row_ids: Any,
        label: str = "lookup",
        out: torch.Tensor | None = None,
        defer: bool = False,
    ) -> Pending:
        """Start a lookup now; wait for it with `.result()` where the rows are consumed.

        defer: leave the host work, whatever its size, to this thread — `Pending.run_now()`
        once the caller has queued GPU work it would otherwise sit idle behind (an engine
        between launching step k and syncing on it, with step k+1's ids known), or result().
        No worker thread then contends for the GIL. Its storage reads still start now."""
        return self._start(row_ids, label, out, sync=False, defer=defer)

    def _start(
        self, row_ids: Any, label: str, out: torch.Tensor | None, sync: bool, defer: bool = False
    ) -> Pending:
        """sync: the caller waits right away (lookup), so nothing overlaps the host work: the
        fastest path wins, and a memory tier's host path runs in the caller's thread at any
        size (no worker handoff; a memory copy cannot hang, so no timeout is lost). defer: see
        prefetch."""
        if self._closed:
            raise RuntimeError(f"table {self.spec.name} is closed")
        ids, shape = self._validate(row_ids)
        if self._path(ids, ahead=defer) == "device":
            return self._device_lookup(ids, self._output(shape, out), shape, label)
        ids_np = ids.cpu().numpy() if isinstance(ids, torch.Tensor) else ids
        inline = (
            defer
            or ids_np.size <= self.options.inline_ids
            or (sync and not self.tier.reads_storage)
        )
        # worker and deferred lookups may put their GPU work on the table's stream: a buffer of
        # ours is made there, so that work need not wait for what the caller queued meanwhile
        # (a step run ahead would wait for the whole step); a caller's buffer is waited for
        side = self._cuda and (defer or not inline)
        own = side and out is None
        out = self._output(shape, out, self._stream if own else None)
        consumer = None
        if side and not own:
            consumer = torch.cuda.Event()
            consumer.record(torch.cuda.current_stream(self.device))
        if inline:  # runs at result() (or run_now()), in the caller's thread
            io0 = self._host.disk_mark()
            if not sync or self.tier.prefetch_before_read:  # e.g. direct: reads start now
                rows = self._this_ranks(ids_np)
                if self.gpu_cache is not None:  # not the rows the GPU cache serves
                    rows = self.gpu_cache.misses(rows)
                self.tier.prefetch(rows)
            stream = torch.cuda.current_stream(self.device) if self._cuda else None
            deferred = functools.partial(self._deferred, ids_np, out, label, stream, consumer, io0)
            return Pending(self, out, shape, label, deferred=deferred, owned=own)
        ready = None
        if self._cuda:
            out.record_stream(self._stream)
            ready = torch.cuda.Event()
        fut = self._worker.submit(self._host.job, ids_np, out, label, None, consumer, ready)
        return Pending(self, out, shape, label, future=fut, ready=ready, owned=own)

    def _deferred(self, ids, out, label, stream, consumer, io0, ahead: bool) -> Any:
        """An inline lookup's host job, run in the caller's thread. At result() its GPU work
        goes on the caller's stream (no events: a decode step pays for launches); run ahead
        (`Pending.run_now`, a step early), on the table's, so the copy and the kernel run
        beside the step the caller queued instead of after it. Returns the ready event or
        None."""
        if not (ahead and self._cuda):
            self._host.job(ids, out, label, stream, io0=io0)
            return None
        ready = torch.cuda.Event()
        self._host.job(ids, out, label, None, consumer, ready, io0=io0)
        return ready

    def staged(
        self,
        shape: tuple[int, ...],
        out: torch.Tensor | None = None,
        ids: torch.Tensor | None = None,
    ) -> StagedLookup:
        """A lookup of ids shaped `shape` ([..., k]) split into a host `stage(ids)` and a GPU
        `decode()` at fixed addresses, so the decode can be captured in a CUDA graph (see
        `plestore.lookup.staged`). `ids`: an int64 device tensor of that shape whose values decode()
        reads where the tier allows (ids computed on the device; unchecked). Closed with the
        table."""
        if self._closed:
            raise RuntimeError(f"table {self.spec.name} is closed")
        lookup = StagedLookup(self, shape, out, ids)
        self._staged.append(lookup)
        return lookup

    def drop_caches(self) -> None:
        """Forget the rows the tier keeps cached (direct's row cache, mapped's pages and their
        page cache) so the next lookups read storage — a cold start without reopening."""
        with self._host.lock:
            self.tier.drop_cache()
            if self.gpu_cache is not None:
                self.gpu_cache.clear()

    def stats(self) -> dict:
        """Metrics per phase, what the tier holds, and how it was chosen."""
        self.metrics.host_bytes = self.tier.host_bytes()
        self.metrics.host_budget = self.tier.host_budget()
        snap = self.metrics.snapshot()
        snap["tier_detail"] = self.tier.describe()
        snap["tier_reason"] = self.tier_choice.reason
        if self.gpu_cache is not None:
            snap["gpu_cache"] = self.gpu_cache.describe()
        snap["device"] = str(self.device)
        return snap

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._worker.shutdown(wait=True)
        if self._stream is not None:
            self._stream.synchronize()
        self.tier.close()
        self._host.close()
        if self._staged and self._cuda:  # a captured graph may still read their staging
            torch.cuda.synchronize(self.device)
        for lookup in self._staged:
            lookup.close()

    def __enter__(self) -> Table:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Table({self.spec.name!r}, {self.spec.rows} x {self.dim} {self.spec.format}, "
            f"tier={self.tier.name}, device={self.device})"
        )

    # -- internals ---------------------------------------------------------------------------
    def _validate(self, row_ids: Any) -> tuple[Any, tuple]:
        """Flat int64 ids (numpy, or a tensor on the table's device) and the output shape."""
        if isinstance(row_ids, torch.Tensor):
            if row_ids.is_floating_point() or row_ids.is_complex() or row_ids.dtype == torch.bool:
                raise ValueError(f"row ids must be integers, got {row_ids.dtype}")
            ids = row_ids.reshape(-1).to(torch.int64)
            shape = tuple(row_ids.shape)
        else:
            arr = np.asarray(row_ids)
            if arr.dtype.kind not in "iu":
                raise ValueError(f"row ids must be integers, got dtype {arr.dtype}")
            ids = arr.reshape(-1).astype(np.int64, copy=False)
            shape = arr.shape
        if len(shape) == 0:
            raise ValueError("row ids must have at least one dimension ([..., k])")
        out_shape = (*shape[:-1], shape[-1] * self.dim)
        on_device = isinstance(ids, torch.Tensor) and ids.device.type != "cpu"
        if ids.numel() if isinstance(ids, torch.Tensor) else ids.size:
            if on_device and not self.options.check_ids:
                return ids, out_shape
            lo, hi = (int(ids.min()), int(ids.max()))  # one sync for device ids
            if lo < 0 or hi >= self.spec.rows:
                flat = ids.cpu().numpy() if isinstance(ids, torch.Tensor) else ids
                bad = int(np.flatnonzero((flat < 0) | (flat >= self.spec.rows))[0])
                where = tuple(int(i) for i in np.unravel_index(bad, shape))
                raise IndexError(
                    f"row id {int(flat[bad])} at position {where} is outside table "
                    f"{self.spec.name} [0, {self.spec.rows})"
                )
        return ids, out_shape

    def _output(self, shape: tuple, out: torch.Tensor | None, stream: Any = None) -> torch.Tensor:
        """The lookup's [n, dim] bf16 rows: the caller's `out` checked, or a new tensor (made on
        `stream` when given: the stream that writes it)."""
        n = int(np.prod(shape)) // self.dim if shape else 0
        if out is None:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                return torch.empty((n, self.dim), dtype=torch.bfloat16, device=self.device)
        if out.dtype != torch.bfloat16 or out.device != self.device:
            raise ValueError(f"out must be bf16 on {self.device}, got {out.dtype} on {out.device}")
        if tuple(out.shape) != shape or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous tensor of shape {shape}, got {tuple(out.shape)}"
            )
        return out.view(n, self.dim)

    def _path(self, ids: Any, staged: bool = False, ahead: bool = False) -> str:
        """device (the GPU reads the tier) or host (the tier reads into staging), per options:
        gather=auto reads on the device up to GPU_GATHER_MAX_IDS ids, except for a staged
        lookup: inside a captured step a kernel reading the contiguous staging costs the step
        less than one reading scattered rows over PCIe (batch-64 decode steps 0.995 -> 0.999 of
        the resident's; H200, plestore bench e2e, 2026-12-01), and for one deferred to be run
        a step ahead past AHEAD_GPU_MAX_IDS ids: the host gathers it while the GPU runs that
        step, and its copy engine leaves the SMs to the step, which a kernel reading scattered
        rows would share (with the copy on the table's stream, batch-8 prefill steps 0.988 ->
        1.002 of the resident's, side by side; H200, 2026-12-01)."""
        tier = self.tier
        if not tier.can_read_host:
            return "device"
        if not tier.can_read_device or self.gpu_cache is not None:
            return "host"
        gather = self.options.gather
        n = ids.numel() if isinstance(ids, torch.Tensor) else ids.size
        near = not (staged or (ahead and n > AHEAD_GPU_MAX_IDS))
        if gather == "gpu" or (gather == "auto" and near and n <= GPU_GATHER_MAX_IDS):
            return "device"
        return "host"

    def _device_lookup(self, ids: Any, out: torch.Tensor, shape: tuple, label: str) -> Pending:
        """One fused kernel reads the rows where the tier keeps them (HBM, or pinned host memory
        through UVA) and decodes them into out; other ranks' ids are never read."""
        t0 = time.perf_counter()
        src = self.tier.device_source()
        ready = None
        if self._cuda:
            ready = torch.cuda.Event()
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            # Tensors made on the caller's stream and read on ours must be recorded on ours:
            # else the caching allocator may hand their memory to the caller's next allocation
            # while this lookup still reads it (seen on the H200 as run-to-run drift at batch 64).
            out.record_stream(self._stream)
            if isinstance(ids, torch.Tensor) and ids.device == self.device:
                ids.record_stream(self._stream)
        with torch.cuda.stream(self._stream) if self._cuda else contextlib.nullcontext():
            ids = torch.as_tensor(ids).to(self.device, non_blocking=True)  # a host copy lands here
            gather_decode(
                src,
                ids,
                self.row_range.start,
                self.row_range.rows,
                self.format,
                self.dim,
                self.spec.scale,
                out,
            )
            if ready is not None:
                ready.record(self._stream)
        n = ids.numel()
        self.metrics.record(
            CallRecord(label=label, path="device", rows=n, total_s=time.perf_counter() - t0)
        )
        return Pending(self, out, shape, label, ready=ready)

    def _this_ranks(self, ids: np.ndarray) -> np.ndarray:
        if self.row_range.rows == self.spec.rows:
            return ids
        return ids[self.row_range.holds(ids)]


def _gpu_cache(table: Table, options: TableOptions):
    """The table's GPU row cache (`gpu_cache_bytes` > 0 on a tier that reads into host memory),
    filled with the profile's hot rows (`plestore profile`), or None."""
    resident = getattr(table.tier, "resident", (0, 0))  # a cascade's device budget
    if not (options.gpu_cache_bytes or resident[1] > resident[0]) or not table.tier.can_read_host:
        return None
    from plestore.lookup.gpucache import GpuRowCache, load_profile

    hot = load_profile(table.file)
    cache = GpuRowCache(
        table.tier,
        table.device,
        options.gpu_cache_bytes,
        hot,
        options.gpu_cache_static,
        resident=resident,
    )
    log.info(
        "plestore: table %s: GPU row cache of %.2f GiB, %d resident rows, %d static (%s), "
        "%d dynamic",
        table.spec.name,
        cache.nbytes / 2**30,
        cache.directory.resident_rows,
        cache.directory.static_rows,
        "profiled" if hot is not None else "no profile",
        cache.directory.dynamic_capacity,
    )
    return cache


def _resolve_device(device: str | None) -> torch.device:
    if device is None:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {device!r} requested but CUDA is not available; use device='cpu'"
            )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"unsupported device {device!r}: use 'cuda[:N]' or 'cpu'")
    return dev
