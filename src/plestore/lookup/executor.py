"""The executor: carries out every lookup's plan (lookup/plan.py) — `lookup`, `prefetch`, and
a staged lookup's `stage()` — deciding nothing: the plan says where the host work runs, which
stream the GPU work goes on, and the route whose body (lookup/routes.py) does the work.

    start(call)  device_read: the kernel launched now (runs=side: on the table's stream, behind
                 an event); runs=now: the route run here; at_result: a Pending that runs it at
                 result(), or its `ahead` plan at run_now(); worker: handed to the worker thread
    run(call)    the host job under the lock host jobs take turns under, on the plan's stream
    stage(...)   a staged lookup's host half, under the same lock: the compiled host step
                 (a graph feed's, on the fixed staging; its numpy reference where the core is
                 not built), a refused step raised from its state (hostplan.step_error)

It holds what host jobs share: the table's stream and worker, two stagings used in turn (each
reused only after the GPU finished with it), the device iota, the plans by kind, and the lock.
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
from plestore.lookup.hostplan import (
    HostPlan,
    core_name,
    counted_reads,
    counted_record,
    reset_counters,
    step_counters,
    step_error,
)
from plestore.lookup.metrics import CallClock, CallRecord
from plestore.lookup.pending import Pending
from plestore.lookup.plan import Route, RowSource, Runs
from plestore.lookup.routes import HOST_ROUTES
from plestore.lookup.staging import Staging, cached_view
from plestore.native.constants import STATES, C, S

if TYPE_CHECKING:
    from plestore.lookup.context import TableContext
    from plestore.lookup.plan import Call, Plan

__all__ = ["Executor"]


class Executor:
    """Carries out the plans of one table's lookups (see the module docstring)."""

    def __init__(self, context: TableContext) -> None:
        self.context = context
        self.stream = torch.cuda.Stream(context.device) if context.cuda else None
        self.worker = ThreadPoolExecutor(1, thread_name_prefix=f"plestore-{context.name}")
        self.staging = [Staging(context.cuda) for _ in range(2)]
        self.plans: dict = {}  # a lookup's kind -> its plan (plan_lookup keeps them here)
        self._turn = 0
        self._iota_ids: torch.Tensor | None = None  # 0, 1, 2, ... on the device (see iota)
        self._iota_views: dict[int, torch.Tensor] = {}  # n -> its first n
        self.lock = threading.Lock()  # host jobs (worker or caller) take turns: the staging
        self.closing = threading.Lock()  # close() marks closed under it before the worker stops
        self.closed = False
        self._step_core = core_name(context.core)
        self._host_plan: HostPlan | None = None  # the host step's, kept while it holds
        self._counters = step_counters()  # one host step's (reset each step, under the lock)

    # -- carrying a plan out -----------------------------------------------------------------
    def start(self, call: Call) -> Pending:
        t, plan = self.context, call.plan
        if plan.route is Route.DEVICE_READ:
            return self.device(call)
        if plan.runs is Runs.WORKER:
            if t.cuda:
                call.out.record_stream(self.stream)
            with self.closing:  # close() marks the table closed under it before the worker stops
                if self.closed:
                    raise RuntimeError(f"table {t.name} is closed")
                return Pending(self, call, future=self.worker.submit(self.run, call, plan))
        if plan.hint:  # reads in flight now (e.g. mapped: WILLNEED)
            rows = self.rows_to_read(call.ids)[2]  # this rank's
            if t.gpu_cache is not None:  # not the rows the GPU cache serves
                rows = t.gpu_cache.misses(rows)
            t.tier.prefetch(rows)
        if plan.runs is Runs.AT_RESULT:
            return Pending(self, call, deferred=True)
        t0 = time.perf_counter()  # waited for at once: run now, on the caller's current stream
        self.run(call, plan)
        t.metrics.add_wait(call.label, time.perf_counter() - t0)  # (the caller waited)
        return Pending(self, call)

    def run(self, call: Call, plan: Plan) -> Any:
        """A host job: `plan` (the call's, or its ahead plan) carried out, its GPU work on the
        plan's stream; returns the event its GPU work ends with on the table's stream (or
        None). Where rows are decoded by torch ops (the CPU, the GPU row cache's route) in
        inference mode: rows are data, never differentiated, and `out` may be an inference
        tensor; entered only where the caller is not in it already. A tier route on CUDA writes
        `out` through one Triton kernel, which autograd never sees: it needs no mode (entering
        one costs a decode lookup)."""
        cuda = self.context.cuda
        modeless = cuda and plan.route is not Route.GPU_CACHE and triton_available()
        if modeless or torch.is_inference_mode_enabled():
            return self._run(call, plan)
        with torch.inference_mode():
            return self._run(call, plan)

    def _run(self, call: Call, plan: Plan) -> Any:
        t = self.context
        with self.lock:
            if self.closed:  # (close() takes this lock before the table frees the tier)
                raise RuntimeError(
                    f"table {t.name} was closed before this lookup ran; no rows were read"
                )
            clock = CallClock(t.tier, t.metrics, call.label, call.ids.size, call.io0, plan)
            gpu = self.gpu_stream(call, plan)
            HOST_ROUTES[plan.route](self, call, gpu, plan.side, clock)
            if not plan.side:
                return None
            ready = torch.cuda.Event()
            ready.record(gpu)
            return ready

    def gpu_stream(self, call: Call, plan: Plan) -> Any:
        """The stream the plan's GPU work goes on (None on CPU), ordered after what it must
        follow: the table's (side), after the caller's out is free (its event at prefetch);
        else the caller's current one, after the stream prefetch was called on (result() asked
        on another) and after the table's where out was made there."""
        if not self.context.cuda:
            return None
        if plan.side:
            if call.consumer is not None:
                self.stream.wait_event(call.consumer)  # out's memory is free to write
            return self.stream
        gpu = torch.cuda.current_stream(self.context.device)
        if call.stream is not None and gpu != call.stream:
            gpu.wait_stream(call.stream)
            call.out.record_stream(gpu)
        if plan.after_table:  # out's block may still be in use on the table's stream
            gpu.wait_stream(self.stream)
        return gpu

    def device(self, call: Call) -> Pending:
        """The device_read route: one fused kernel reads the rows where the tier keeps them
        (HBM, or pinned host memory through UVA) and decodes them into out; other ranks' ids
        are never read. A prefetch (runs=side) runs on the table's stream behind an event; a
        lookup waited for at once runs on the caller's stream: nothing could overlap it, and a
        decode step of transformers pays for every stream switch and event (two per step)."""
        t, ids, out = self.context, call.ids, call.out
        t0 = time.perf_counter()
        src = t.tier.device_rows()
        ready = None
        if call.plan.side:
            ready = torch.cuda.Event()
            self.stream.wait_stream(torch.cuda.current_stream(t.device))
            # Tensors made on the caller's stream and read on ours must be recorded on ours:
            # else the caching allocator may hand their memory to the caller's next allocation
            # while this lookup still reads it (seen as run-to-run drift at batch 64).
            out.record_stream(self.stream)
            if isinstance(ids, torch.Tensor) and ids.device == t.device:
                ids.record_stream(self.stream)
        with torch.cuda.stream(self.stream) if call.plan.side else contextlib.nullcontext():
            ids = torch.as_tensor(ids).to(t.device, non_blocking=True)  # a host copy lands here
            start, count = t.row_range.start, t.row_range.rows
            gather_decode(src, ids, start, count, t.format, t.dim, t.scale, out)
            if ready is not None:
                ready.record(self.stream)
        plan = call.plan
        rec = CallRecord(call.label, "device", plan.route.value, plan.runs.value, ids.numel())
        rec.total_s = time.perf_counter() - t0
        t.metrics.record(rec)
        return Pending(self, call, ready=ready)

    def stage(self, staged: Any, ids: np.ndarray, label: str, t0: float) -> None:
        """A staged lookup's host half (lookup/staged.py), by its plan's route: a device read's
        ids copied to its pinned buffer; else, under the host lock, its rows read into its
        fixed staging by the host step."""
        t, route = self.context, staged.plan.route
        if route.source is RowSource.DEVICE_READ:  # (ids on the device have no stage())
            staged.ids_host.numpy()[:] = ids
            rec = CallRecord(label, "device", route.value, staged.plan.runs.value, ids.size)
            rec.total_s = time.perf_counter() - t0
            t.metrics.record(rec)
            return
        with self.lock:
            if self.closed:  # (close() takes this lock before the table frees the tier)
                raise RuntimeError(f"table {t.name} is closed")
            self.host_step(staged, ids, label, t0)

    def host_step(self, staged: Any, ids: np.ndarray, label: str, t0: float) -> None:
        """A staged lookup's host half by the compiled host step (native host_step: a graph
        feed's, without the GIL), its counters as the call's record and the tier's FedReads.
        A step the core refused raises from its state and detail (hostplan.step_error); one
        whose mapping's file changed first asks the tier (which raises naming the file, or
        takes a touched file as its own: the step runs again on a new plan). Under the host
        lock."""
        t = self.context
        box = np.ascontiguousarray(ids, np.int64).reshape(-1)
        state, detail, counters = self._step(staged, box)
        if state == S.FILE_CHANGED:
            t.tier.check_file()
            state, detail, counters = self._step(staged, box)
        if state:
            raise step_error(t, STATES[state], detail, ids)
        d = counters.tolist()
        rec = counted_record(d, label, t.tier.row_bytes, staged.plan)
        rec.total_s, rec.host_step = time.perf_counter() - t0, self._step_core
        t.metrics.record(rec)
        t.tier.fed_reads(counted_reads(d, d[C.CLEAN]))
        if staged.held is not None and t.cuda:  # the replay reads slots the cache's last
            t.gpu_cache.begin(torch.cuda.current_stream(t.device))  # lookup may have written

    def _step(self, staged: Any, box: np.ndarray) -> tuple[int, int, np.ndarray]:
        """One host step of box [n] into the staged lookup's staging by the table's current
        plan: (state, detail, the step's counters)."""
        t = self.context
        self._host_plan = plan = HostPlan.current(t, self._host_plan)
        if plan is None:  # (no host parts: the tier closed)
            raise RuntimeError(f"table {t.name} is closed")
        counters = reset_counters(self._counters)
        fixed = staged.fixed
        feed = (box, fixed.rows_array, fixed.index_array, staged.held)
        state, detail = t.core.host_step(plan.args, feed, counters)
        return state, detail, counters

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
        RESULTS.md "e2e: host gathers")."""
        t, n = self.context, ids.size
        if t.whole:  # every (validated) id is this rank's
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
            iota = torch.arange(max(n, 1 << 16), device=self.context.device)
            if self.context.cuda:  # the new one is written, no kernel reads the old one
                torch.cuda.synchronize(self.context.device)
            self._iota_ids = iota
            self._iota_views.clear()
        return cached_view(self._iota_views, n, lambda: self._iota_ids[:n])

    def decode(self, src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
        """out[j] = the table's decode of row src[index[j]] in staging (src: uint8 [u, stride])."""
        t = self.context
        gather_decode(src, index, 0, src.shape[0], t.format, t.dim, t.scale, out)

    def on(self, gpu: Any, side: bool) -> Any:
        """The context a host job's GPU work is queued in: `gpu`'s, but none where that is the
        caller's current stream already (a caller job on the table's device: a decode lookup
        then pays for no stream switch)."""
        if gpu is None:
            return contextlib.nullcontext()
        if not side and torch.cuda.current_device() == self.context.device.index:
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
            self._host_plan = None
        return True
