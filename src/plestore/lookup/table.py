"""The user-facing `Table`: row ids in, bf16 rows out on the device — from any tier, exactly
(fp16 / fp32 tables deliver float16 / float32: `Table.dtype`).

    ids [..., k] -> validate -> this rank's? -> tier: device read | host read into staging
                                (others: zeros, no I/O)        -> gather_decode -> out [..., k*dim]

`lookup(ids)` waits at once and takes the fastest path. `prefetch(ids)` starts the lookup as
soon as the ids exist and returns a `Pending`: large host work runs on the table's worker
thread, GPU work on its stream, and `result()` orders the caller's stream after it by an event
(no GPU sync). Decode-sized host lookups (≤ `inline_ids`) run in the caller's thread at
`result()` instead: a worker would wait for the GIL from a thread busy launching kernels;
their cold reads still start at `prefetch`. `prefetch(defer=True)` + `Pending.run_now()` runs a
lookup a step ahead, beside the step the caller queued (on the table's stream).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from plestore import native
from plestore.formats import get_format
from plestore.kernels.gather_decode import gather_decode
from plestore.lookup.gpucache import open_gpu_cache
from plestore.lookup.hostpath import HostPath
from plestore.lookup.metrics import CallRecord, Metrics
from plestore.lookup.pending import Pending
from plestore.lookup.staged import StagedLookup
from plestore.options import TableOptions
from plestore.tablefile import TableFile
from plestore.tiers import RowRange, choose_tier, make_tier

__all__ = ["Pending", "Table", "open_table"]

log = logging.getLogger("plestore")

#: pinned, gather=auto: the GPU reads lookups of at most this many ids from pinned memory; the
#: host gathers larger ones. measured: RESULTS.md "lookup: GPU vs host gather"
GPU_GATHER_MAX_IDS = 16384
#: pinned, gather=auto: a lookup run a step ahead is host-gathered past this many ids (beside
#: the step). measured: RESULTS.md "e2e: pinned gather, host or GPU"
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

    #: a staged lookup's decode() can be captured in a CUDA graph (a group's over gloo cannot)
    graph_capturable = True

    def __init__(self, file: TableFile, options: TableOptions) -> None:
        self.file = file
        self.spec = file.spec
        self.options = options
        self.format = get_format(self.spec.format)
        self.dim = self.spec.dim
        self.dtype = self.format.torch_dtype  # what lookups deliver: bf16, or fp16 / fp32 rows
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
        self.gpu_cache = open_gpu_cache(self, options)  # None unless asked for (or a cascade)
        self._native = native.load(options.native)  # None: the pure-Python host path
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
        """bf16 [..., k * dim] on the table's device for row ids [..., k]: the last axis is
        one token's k rows (its hash heads) end to end, so 1-D ids [k] give [k * dim]; for a
        row per id as nn.Embedding gives ([..., dim]), look up ids[..., None]. timeout (or the
        table's timeout_s): seconds the wait for a storage tier's reads of more than
        `inline_ids` ids may take before TimeoutError (such a lookup then runs on the table's
        worker); smaller lookups, and a memory tier's, run in this thread unbounded."""
        return self._start(row_ids, label, None, sync=True, timeout=timeout).result(timeout)

    def lookup_into(
        self, row_ids: Any, out: torch.Tensor, label: str = "lookup", timeout: float | None = None
    ) -> torch.Tensor:
        """Like lookup, writing into a caller-owned bf16 [..., k * dim] buffer (fixed addresses
        for CUDA graphs)."""
        return self._start(row_ids, label, out, sync=True, timeout=timeout).result(timeout)

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
        self,
        row_ids: Any,
        label: str,
        out: torch.Tensor | None,
        sync: bool,
        defer: bool = False,
        timeout: float | None = None,
    ) -> Pending:
        """sync: the caller waits right away (lookup), so nothing overlaps the host work: the
        fastest path wins, and the host path runs in the caller's thread at any size — on the
        worker only where a timeout bounds a storage tier's lookup of more than `inline_ids`
        ids (a memory copy cannot hang; a hung read then holds the worker, not the caller).
        The handoff, the worker's stream and event cost a 65,536-row warm mapped lookup
        250-400 us (H200). measured: RESULTS.md "host time, part by part". defer: see
        prefetch."""
        if self._closed:
            raise RuntimeError(f"table {self.spec.name} is closed")
        ids, shape = self._validate(row_ids)
        if self._path(ids, ahead=defer) == "device":
            return self._device_lookup(ids, self._output(shape, out), shape, label, side=not sync)
        ids_np = ids.cpu().numpy() if isinstance(ids, torch.Tensor) else ids
        bounded = self.tier.reads_storage and (
            timeout is not None or self.options.timeout_s is not None
        )
        inline = defer or ids_np.size <= self.options.inline_ids or (sync and not bounded)
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
            if not sync or self.tier.prefetch_before_read:  # e.g. mapped: WILLNEED now
                rows = self._this_ranks(ids_np)
                if self.gpu_cache is not None:  # not the rows the GPU cache serves
                    rows = self.gpu_cache.misses(rows)
                self.tier.prefetch(rows)
            if sync:  # waited for at once: run now, on the caller's current stream
                t0 = time.perf_counter()
                self._host.job(ids_np, out, label, io0=io0)
                self.metrics.add_wait(label, time.perf_counter() - t0)  # (the caller waited)
                return Pending(self, out, shape, label)
            stream = torch.cuda.current_stream(self.device) if self._cuda else None
            deferred = functools.partial(self._deferred, ids_np, out, label, stream, consumer, io0)
            return Pending(self, out, shape, label, deferred=deferred, owned=own)
        ready = None
        if self._cuda:
            out.record_stream(self._stream)
            ready = torch.cuda.Event()
        with self._lock:  # close() marks the table closed under it before the worker stops
            if self._closed:
                raise RuntimeError(f"table {self.spec.name} is closed")
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
        """Release the tier and its buffers. Lookups in flight end first: a host job already
        running finishes (its rows exact); one not yet started (queued on the worker, or
        deferred to result()) raises a RuntimeError saying the table was closed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._worker.shutdown(wait=True)
        if self._stream is not None:
            self._stream.synchronize()
        with self._host.lock:  # no host job is reading the tier or the staging now
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
            if row_ids.device.type not in ("cpu", self.device.type):
                raise ValueError(
                    f"row ids must be on the cpu or {self.device}, got {row_ids.device}"
                )
            ids = row_ids.reshape(-1).to(torch.int64).contiguous()  # (a strided 1-D view stays one)
            shape = tuple(row_ids.shape)
        else:
            arr = np.asarray(row_ids)
            if arr.dtype.kind not in "iu":
                raise ValueError(f"row ids must be integers, got dtype {arr.dtype}")
            ids = np.ascontiguousarray(arr.reshape(-1), dtype=np.int64)  # the native core's layout
            shape = arr.shape
        if len(shape) == 0:
            raise ValueError("row ids must have at least one dimension ([..., k])")
        out_shape = (*shape[:-1], shape[-1] * self.dim)
        on_device = isinstance(ids, torch.Tensor) and ids.device.type != "cpu"
        if ids.numel() if isinstance(ids, torch.Tensor) else ids.size:
            if on_device and not self.options.check_ids:
                return ids, out_shape
            if self._native is not None and not isinstance(ids, torch.Tensor):
                bad = self._native.check_ids(ids, self.spec.rows) >= 0  # one pass
            elif isinstance(ids, torch.Tensor):
                lo, hi = torch.stack(torch.aminmax(ids)).tolist()  # one sync for device ids
                bad = lo < 0 or hi >= self.spec.rows
            else:
                bad = int(ids.min()) < 0 or int(ids.max()) >= self.spec.rows
            if bad:
                flat = ids.cpu().numpy() if isinstance(ids, torch.Tensor) else ids
                bad = int(np.flatnonzero((flat < 0) | (flat >= self.spec.rows))[0])
                where = tuple(int(i) for i in np.unravel_index(bad, shape))
                raise IndexError(
                    f"row id {int(flat[bad])} at position {where} is outside table "
                    f"{self.spec.name} [0, {self.spec.rows})"
                )
        return ids, out_shape

    def _output(self, shape: tuple, out: torch.Tensor | None, stream: Any = None) -> torch.Tensor:
        """The lookup's [n, dim] rows (self.dtype): the caller's `out` checked, or a new tensor
        (made on `stream` when given: the stream that writes it)."""
        n = math.prod(shape) // self.dim if shape else 0  # (np.prod: ~4 us a call)
        if out is None:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                return torch.empty((n, self.dim), dtype=self.dtype, device=self.device)
        if out.dtype != self.dtype or out.device != self.device:
            raise ValueError(
                f"out must be {_short(self.dtype)} on {self.device}, got {_short(out.dtype)} on "
                f"{out.device}"
            )
        if tuple(out.shape) != shape or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous tensor of shape {shape}, got {tuple(out.shape)}"
            )
        return out.view(n, self.dim)

    def _path(self, ids: Any, staged: bool = False, ahead: bool = False) -> str:
        """device (the GPU reads the tier) or host (the tier reads into staging), per options:
        gather=auto reads on the device up to GPU_GATHER_MAX_IDS ids, except a staged lookup
        (the captured kernel then reads contiguous staging, not scattered rows over PCIe) and a
        lookup run a step ahead past AHEAD_GPU_MAX_IDS ids (the copy engine leaves the SMs to
        the step it runs beside). measured: RESULTS.md "e2e: pinned gather, host or GPU"."""
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

    def _device_lookup(
        self, ids: Any, out: torch.Tensor, shape: tuple, label: str, side: bool = True
    ) -> Pending:
        """One fused kernel reads the rows where the tier keeps them (HBM, or pinned host memory
        through UVA) and decodes them into out; other ranks' ids are never read. A prefetch
        (`side`) runs on the table's stream behind an event; a lookup waited for at once runs
        on the caller's stream: nothing could overlap it, and a decode step of transformers
        pays for every stream switch and event (two per step)."""
        t0 = time.perf_counter()
        src = self.tier.device_source()
        ready = None
        side = side and self._cuda
        if side:
            ready = torch.cuda.Event()
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            # Tensors made on the caller's stream and read on ours must be recorded on ours:
            # else the caching allocator may hand their memory to the caller's next allocation
            # while this lookup still reads it (seen on the H200 as run-to-run drift at batch 64).
            out.record_stream(self._stream)
            if isinstance(ids, torch.Tensor) and ids.device == self.device:
                ids.record_stream(self._stream)
        with torch.cuda.stream(self._stream) if side else contextlib.nullcontext():
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


def _short(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )


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
