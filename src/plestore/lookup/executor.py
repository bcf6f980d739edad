"""The executor: runs every lookup's plan (lookup/plan.py) — `lookup`, `prefetch`, and a staged
lookup's `stage()` — its host work where the plan says, its GPU work on the plan's stream.

    start(plan)  device source: the kernel is launched now (a prefetch's on the table's stream,
                 behind an event); where=now: run here; caller: a Pending that runs it at
                 result() (or run_now()); worker: handed to the table's worker thread
    run(plan)    the host job under the lock host jobs take turns under: the source's reader
                 (lookup/sources.py) on the stream gpu_stream() names
    stage(...)   a staged lookup's host half, under the same lock

It holds what host jobs share: the table's stream and worker, two stagings used in turn (each
reused only after the GPU finished with it), the device iota, and the lock.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from plestore.kernels import triton_available
from plestore.kernels.gather_decode import gather_decode
from plestore.lookup.metrics import CallClock, CallRecord, disk_mark
from plestore.lookup.pending import Pending
from plestore.lookup.plan import Plan, this_ranks
from plestore.lookup.sources import from_cache, from_staging, stage_cache, stage_staging
from plestore.lookup.staging import Staging, cached_view

if TYPE_CHECKING:
    from plestore.lookup.table import Table

__all__ = ["Executor"]


class Executor:
    """Runs the plans of one table's lookups (see the module docstring)."""

    def __init__(self, table: Table) -> None:
        self.table = table
        self.cuda = table.device.type == "cuda"
        self.stream = torch.cuda.Stream(table.device) if self.cuda else None
        self.worker = ThreadPoolExecutor(1, thread_name_prefix=f"plestore-{table.spec.name}")
        self.staging = [Staging(self.cuda) for _ in range(2)]
        self._turn = 0
        self._iota_ids: torch.Tensor | None = None  # 0, 1, 2, ... on the device (see iota)
        self._iota_views: dict[int, torch.Tensor] = {}  # n -> its first n
        self.lock = threading.Lock()  # host jobs (worker or caller) take turns: the staging
        self.closing = threading.Lock()  # close() marks closed under it before the worker stops
        self.closed = False

    # -- starting a plan ---------------------------------------------------------------------
    def start(self, plan: Plan) -> Pending:
        t = self.table
        if plan.source == "device":
            return self.device(plan)
        if plan.where == "worker":
            ready = None
            if self.cuda:
                plan.out.record_stream(self.stream)
                ready = torch.cuda.Event()
            with self.closing:  # close() marks the table closed under it before the worker stops
                if self.closed:
                    raise RuntimeError(f"table {t.spec.name} is closed")
                fut = self.worker.submit(self.run, plan, ready)
            return Pending(self, plan, future=fut, ready=ready)
        plan.io0 = disk_mark(t.tier)  # (reads may start below: a caller plan counts from here)
        if plan.where == "caller" or t.tier.prefetch_before_read:  # e.g. mapped: WILLNEED now
            rows = this_ranks(t, plan.ids)
            if t.gpu_cache is not None:  # not the rows the GPU cache serves
                rows = t.gpu_cache.misses(rows)
            t.tier.prefetch(rows)
        if plan.where == "caller":
            return Pending(self, plan, deferred=True)
        t0 = time.perf_counter()  # waited for at once: run now, on the caller's current stream
        self.run(plan)
        t.metrics.add_wait(plan.label, time.perf_counter() - t0)  # (the caller waited)
        return Pending(self, plan)

    def run_deferred(self, plan: Plan, ahead: bool) -> Any:
        """A caller plan's host job, in the caller's thread. At result() its GPU work goes on
        the caller's stream (no events: a decode step pays for launches); run ahead
        (`Pending.run_now`, a step early), on the table's, so the copy and the kernel run beside
        the step the caller queued instead of after it. Returns the ready event or None."""
        if not (ahead and self.cuda):
            if plan.own:  # out was made on the table's stream: its block's last use comes first
                torch.cuda.current_stream(self.table.device).wait_stream(self.stream)
            self.run(plan)
            return None
        ready = torch.cuda.Event()
        self.run(plan, ready)
        return ready

    def run(self, plan: Plan, ready: Any = None) -> None:
        """A host job (ready given: its GPU work on the table's stream, recorded there). Where
        rows are decoded by torch ops (the CPU, the GPU row cache's path) in inference mode:
        rows are data, never differentiated, and `out` may be an inference tensor; entered only
        where the caller is not in it already. The staging source on CUDA writes `out` through
        one Triton kernel, which autograd never sees: it needs no mode (entering one costs a
        decode lookup)."""
        modeless = self.cuda and plan.source == "staging" and triton_available()
        if modeless or torch.is_inference_mode_enabled():
            self._run(plan, ready)
        else:
            with torch.inference_mode():
                self._run(plan, ready)

    def _run(self, plan: Plan, ready: Any) -> None:
        t = self.table
        with self.lock:
            if self.closed:  # (close() takes this lock before it frees the tier)
                raise RuntimeError(
                    f"table {t.spec.name} was closed before this lookup ran; no rows were read"
                )
            clock = CallClock(t.tier, t.metrics, plan.label, plan.ids.size, plan.io0)
            gpu = self.gpu_stream(plan.stream if ready is None else None, ready, plan.out)
            read = from_cache if plan.source == "cache" else from_staging
            read(self, plan, gpu, ready, clock)

    def device(self, plan: Plan) -> Pending:
        """The device source: one fused kernel reads the rows where the tier keeps them (HBM,
        or pinned host memory through UVA) and decodes them into out; other ranks' ids are never
        read. A prefetch (`side`) runs on the table's stream behind an event; a lookup waited
        for at once runs on the caller's stream: nothing could overlap it, and a decode step of
        transformers pays for every stream switch and event (two per step)."""
        t, ids, out = self.table, plan.ids, plan.out
        t0 = time.perf_counter()
        src = t.tier.device_source()
        ready = None
        if plan.side:
            ready = torch.cuda.Event()
            self.stream.wait_stream(torch.cuda.current_stream(t.device))
            # Tensors made on the caller's stream and read on ours must be recorded on ours:
            # else the caching allocator may hand their memory to the caller's next allocation
            # while this lookup still reads it (seen as run-to-run drift at batch 64).
            out.record_stream(self.stream)
            if isinstance(ids, torch.Tensor) and ids.device == t.device:
                ids.record_stream(self.stream)
        with torch.cuda.stream(self.stream) if plan.side else contextlib.nullcontext():
            ids = torch.as_tensor(ids).to(t.device, non_blocking=True)  # a host copy lands here
            start, count = t.row_range.start, t.row_range.rows
            gather_decode(src, ids, start, count, t.format, t.dim, t.spec.scale, out)
            if ready is not None:
                ready.record(self.stream)
        rec = CallRecord(plan.label, "device", rows=ids.numel())
        rec.total_s = time.perf_counter() - t0
        t.metrics.record(rec)
        return Pending(self, plan, ready=ready)

    def stage(self, staged: Any, ids: np.ndarray, label: str, t0: float) -> None:
        """A staged lookup's host half (lookup/staged.py): a device-read one's ids copied to its
        pinned buffer; else, under the host lock, its rows read into its fixed staging."""
        t = self.table
        if staged.source == "device":
            staged.ids_host.numpy()[:] = ids
            rec = CallRecord(label, "device", rows=ids.size)
            rec.total_s = time.perf_counter() - t0
            t.metrics.record(rec)
            return
        with self.lock:
            if self.closed:  # (close() takes this lock before the table frees the tier)
                raise RuntimeError(f"table {t.spec.name} is closed")
            clock = CallClock(t.tier, t.metrics, label, ids.size, t0=t0)
            if staged.source == "cache":
                stage_cache(self, staged, ids, clock)
            else:
                stage_staging(self, staged.fixed, ids, clock)
            clock.done()

    # -- what host jobs share ----------------------------------------------------------------
    def next_staging(self) -> Staging:
        """The staging whose turn it is (they alternate)."""
        staging = self.staging[self._turn]
        self._turn = (self._turn + 1) % len(self.staging)
        return staging

    def rows_to_read(self, ids: np.ndarray) -> tuple:
        """(this rank's mask or None if all are, how many are, the rows to read: this rank's
        ids in order, repeats included: a repeated row costs a second copy from memory, and
        the direct tier reads each block once anyway; a dedup sort costs more (measured:
        RESULTS.md "e2e: warm host gathers")."""
        t, n = self.table, ids.size
        if t.row_range.rows == t.spec.rows:  # every (validated) id is this rank's
            return None, n, ids
        inr = t.row_range.holds(ids)
        present = int(inr.sum())
        return inr, present, ids if present == n else ids[inr]

    def iota(self, n: int) -> torch.Tensor:
        """[0, n) on the table's device, made once and read from any stream: on CUDA the device
        is synchronised when it is (re)made, so no stream reads it unfinished or freed."""
        view = self._iota_views.get(n)
        if view is not None:
            return view
        if self._iota_ids is None or self._iota_ids.numel() < n:
            iota = torch.arange(max(n, 1 << 16), device=self.table.device)
            if self.cuda:  # the new one is written, and no kernel reads the old one any more
                torch.cuda.synchronize(self.table.device)
            self._iota_ids = iota
            self._iota_views.clear()
        return cached_view(self._iota_views, n, lambda: self._iota_ids[:n])

    def decode(self, src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
        """out[j] = the table's decode of staged row src[index[j]] (src: uint8 [u, stride])."""
        t = self.table
        gather_decode(src, index, 0, src.shape[0], t.format, t.dim, t.spec.scale, out)

    def gpu_stream(self, stream: Any, ready: Any, out: torch.Tensor) -> Any:
        """The stream a host job's GPU work goes on (None on CPU): a worker or ahead job's
        (`ready` given) on the table's; a caller one on the caller's current stream, made to
        follow `stream` (where prefetch was called) when result() is asked on another."""
        if not self.cuda:
            return None
        gpu = self.stream if ready is not None else torch.cuda.current_stream(self.table.device)
        if ready is None and stream is not None and gpu != stream:
            gpu.wait_stream(stream)
            out.record_stream(gpu)
        return gpu

    def on(self, gpu: Any, ready: Any) -> Any:
        """The context a host job's GPU work is queued in: `gpu`'s, but none where that is the
        caller's current stream already (a caller job on the table's device: a decode lookup
        then pays for no stream switch)."""
        if gpu is None:
            return contextlib.nullcontext()
        if ready is None and torch.cuda.current_device() == self.table.device.index:
            return contextlib.nullcontext()
        return torch.cuda.stream(gpu)

    def close(self) -> bool:
        """Let jobs in flight end (a running one finishes exactly; one not yet started raises
        "closed"), then free the stagings (the table frees the tier). False: closed already."""
        with self.closing:
            if self.closed:
                return False
            self.closed = True
        self.worker.shutdown(wait=True)
        if self.stream is not None:
            self.stream.synchronize()
        with self.lock:  # no host job is reading the tier or the staging now
            for s in self.staging:
                s.close()
        return True
