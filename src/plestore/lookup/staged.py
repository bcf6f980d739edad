"""`StagedLookup`: a fixed-shape lookup whose GPU half can be captured in a CUDA graph.

Engines replay decode steps as CUDA graphs. A per-step `Table.lookup_into` is a host call
between two graphs that launches its kernel from Python; a decode step's host chain (tokens,
hash, lookup, launch) then fills the time layer 0 gives it at batch 1 (measured: RESULTS.md
"e2e warm"). A staged lookup splits the lookup at fixed addresses:

    stage(ids)  host, before the replay: validate; a host tier reads the rows' packed bytes
                into pinned staging and writes the index into it (the host core's step, a
                graph feed's: lookup/executor.py); a device-read tier (the resident table,
                pinned gather="gpu" or device_read) only copies the ids to a pinned buffer
    decode()    GPU, capturable: one kernel turns the staging into bf16 rows in `out` (reading
                pinned memory through UVA, or the table after an H2D of the ids)

so the rows' kernel is part of the graph, and the host's work per step is the tier read. Its
plan (lookup/plan.py's `choose_staged_plan`: a staged_* route) is made once, here.
Ids computed on the device (hashed inside the captured step, as engines do) can be given as
`ids`: a device-read tier's decode() then reads them where they are and the host has no part
in the step at all (`needs_stage` False; `replayed()` accounts the replays); a host tier still
needs each step's ids on the host for stage() — the only host work of its step.
Rows are bit-identical to `Table.lookup` (the same kernel and staging layout). The caller
stages again only after the GPU has run the previous decode() — nothing here checks it: a sync
on any later output of the same stream (the sampled tokens) implies it. Like other
caller-thread lookups, a storage read here has no timeout. Closing the table synchronises the
device before it frees the staging a captured graph may still read.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from plestore.kernels.gather_decode import gather_decode
from plestore.lookup.metrics import CallRecord
from plestore.lookup.plan import (
    Place,
    Route,
    RowSource,
    choose_staged_plan,
    output_buffer,
    validate_ids,
)
from plestore.lookup.staging import FixedStaging

if TYPE_CHECKING:
    from plestore.lookup.executor import Executor

__all__ = ["StagedLookup"]


class StagedLookup:
    """Lookups of row ids of one shape [..., k] into a fixed bf16 `out` [..., k * dim]."""

    def __init__(
        self,
        executor: Executor,
        shape: tuple[int, ...],
        out: torch.Tensor | None = None,
        ids: torch.Tensor | None = None,
        device_read: bool = False,
    ):
        if len(shape) == 0 or any(s < 1 for s in shape):
            raise ValueError(f"a staged lookup needs a non-empty shape [..., k], got {shape}")
        context = executor.context  # what it takes from its table (lookup/context.py)
        if ids is not None and (
            ids.dtype != torch.int64
            or ids.device != context.device
            or tuple(ids.shape) != tuple(shape)
            or not ids.is_contiguous()
        ):
            raise ValueError(
                f"ids must be a contiguous int64 {tuple(shape)} tensor on {context.device}, got "
                f"{ids.dtype} {tuple(ids.shape)} on {ids.device}"
            )
        self.context, self.shape, self._executor = context, tuple(shape), executor
        n = int(np.prod(shape))
        self.n = n
        out_shape = (*shape[:-1], shape[-1] * context.dim)
        self._flat = output_buffer(context, out_shape, out)  # [n, dim]
        self.out = self._flat.view(out_shape)
        #: how it runs (a staged_* route); `source`: where its rows come from (a RowSource)
        self.plan = choose_staged_plan(context, n, ids is not None, device_read)
        self.source = self.plan.route.source
        #: stage() runs before each decode(); False: decode() reads the device `ids` as they are
        self.needs_stage = self.plan.route is not Route.STAGED_DEVICE_IDS
        self.fixed: FixedStaging | None = None
        #: [n]: the GPU row cache's dynamic slot each id of the last stage() holds (-1: none;
        #: written by the host step, so no admission evicts a row decode() reads), or None
        self.held: np.ndarray | None = None
        if self.source is not RowSource.DEVICE_READ:
            rb = context.tier.staging_stride  # (the GPU row cache's stride too)
            copies = self.plan.route.copies
            self.fixed = FixedStaging(n, rb, context.cuda, context.device, copies)
            if self.source is RowSource.GPU_CACHE:
                self.held = np.full(n, -1, np.int64)
                context.gpu_cache.hold_array(self, self.held)
            return
        self._src = context.tier.device_rows()  # the kernel reads the table where it lives
        if ids is not None:
            self._ids = ids.view(-1)
        else:  # stage() copies the ids here, decode() on to the device
            self.ids_host = torch.zeros(n, dtype=torch.int64, pin_memory=context.cuda)
            self._ids = torch.zeros(n, dtype=torch.int64, device=context.device)

    def stage(self, row_ids, label: str = "decode") -> None:
        """Host half: ids [..., k] of this lookup's shape; raises like Table.lookup on bad ids,
        and as the host step's state names a failed read (a moved file, a corrupt block)."""
        t = self.context
        if self._executor.closed:
            raise RuntimeError(f"table {t.name} is closed")
        ids, shape = validate_ids(t, row_ids)
        if tuple(shape) != tuple(self.out.shape):
            k = shape[-1] // t.dim
            raise ValueError(f"row ids of shape {self.shape} expected, got {(*shape[:-1], k)}")
        if isinstance(ids, torch.Tensor):
            ids = ids.cpu().numpy()
        if not self.needs_stage:
            raise RuntimeError("this staged lookup reads its ids on the device: no stage()")
        self._executor.stage(self, ids, label, time.perf_counter())

    def replayed(self, label: str = "decode", t0: float | None = None) -> None:
        """Account one lookup of a device-read tier in the table's metrics (for decode()
        replays that had no stage(): the ids were on the device)."""
        rec = CallRecord(label, "device", self.plan.route.value, self.plan.runs.value, self.n)
        rec.total_s = 0.0 if t0 is None else time.perf_counter() - t0
        self.context.metrics.record(rec)

    def decode(self) -> torch.Tensor:
        """GPU half (capturable; on CPU it runs at once): its staging decoded into `out`."""
        t, route = self.context, self.plan.route
        fmt, dim, scale = t.format, t.dim, t.scale
        if route.place is Place.IDS:  # the kernel reads the tier by id
            if self.needs_stage:  # (the ids staged on the host: copied to the device)
                self._ids.copy_(self.ids_host, non_blocking=True)
            start, count = t.row_range.start, t.row_range.rows
            gather_decode(self._src, self._ids, start, count, fmt, dim, scale, self._flat)
        elif route.source is RowSource.GPU_CACHE:  # hits from the cache, misses staged
            c, (rows, index) = t.gpu_cache, self.fixed.kernel_inputs()
            gather_decode(
                c.data, index, 0, c.base + self.n, fmt, dim, scale, self._flat, rows, c.base
            )
        else:  # the staging: pinned (the kernel reads it by UVA), or its device copy
            rows, index = self.fixed.kernel_inputs()
            gather_decode(rows, index, 0, self.n, fmt, dim, scale, self._flat)
        return self.out

    def close(self) -> None:
        if self.held is not None:
            self.context.gpu_cache.hold_array(self, None)
        if self.fixed is not None:
            self.fixed.close()
