"""`StagedLookup`: a fixed-shape lookup whose GPU half can be captured in a CUDA graph.

Engines replay decode steps as CUDA graphs. A per-step `Table.lookup_into` is a host call
between two graphs that launches its kernel from Python; a decode step's host chain (tokens,
hash, lookup, launch) then fills the time layer 0 gives it at batch 1 (measured: RESULTS.md
"e2e warm"). A staged lookup splits the lookup at fixed addresses:

    stage(ids)  host, before the replay: validate; a host tier reads the rows' packed bytes
                into pinned staging and writes the index into it; a device-read tier (the
                resident table, pinned gather="gpu"/auto) only copies the ids to a pinned buffer
    decode()    GPU, capturable: one kernel turns the staging into bf16 rows in `out` (reading
                pinned memory through UVA, or the table after an H2D of the ids)

so the rows' kernel is part of the graph, and the host's work per step is the tier read.
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
from plestore.lookup.plan import choose_source, output_buffer, validate_ids
from plestore.lookup.staging import FixedStaging

if TYPE_CHECKING:
    from plestore.lookup.executor import Executor
    from plestore.lookup.table import Table

__all__ = ["StagedLookup"]


class StagedLookup:
    """Lookups of row ids of one shape [..., k] into a fixed bf16 `out` [..., k * dim]."""

    def __init__(
        self,
        table: Table,
        executor: Executor,
        shape: tuple[int, ...],
        out: torch.Tensor | None = None,
        ids: torch.Tensor | None = None,
        device_read: bool = False,
    ):
        if len(shape) == 0 or any(s < 1 for s in shape):
            raise ValueError(f"a staged lookup needs a non-empty shape [..., k], got {shape}")
        if ids is not None and (
            ids.dtype != torch.int64
            or ids.device != table.device
            or tuple(ids.shape) != tuple(shape)
            or not ids.is_contiguous()
        ):
            raise ValueError(
                f"ids must be a contiguous int64 {tuple(shape)} tensor on {table.device}, got "
                f"{ids.dtype} {tuple(ids.shape)} on {ids.device}"
            )
        self.table, self.shape, self._executor = table, tuple(shape), executor
        n = int(np.prod(shape))
        self.n = n
        out_shape = (*shape[:-1], shape[-1] * table.dim)
        self._flat = output_buffer(table, out_shape, out)  # [n, dim]
        self.out = self._flat.view(out_shape)
        cuda = table.device.type == "cuda"
        #: device (the kernel reads the table where it lives), staging or cache (the host
        #: stages rows into `fixed`: the table's rows, or the GPU row cache's misses)
        self.source = choose_source(table, n, staged=True)
        if device_read and self.source != "device":
            if not table.device_readable:
                raise ValueError(
                    f"table {table.spec.name}: the GPU cannot read the {table.tier.name} tier "
                    "itself" + (" behind a GPU row cache" if table.gpu_cache is not None else "")
                )
            self.source = "device"
        #: stage() runs before each decode(); False: decode() reads the device `ids` as they are
        self.needs_stage = self.source != "device" or ids is None
        self.fixed: FixedStaging | None = None
        if self.source != "device":
            rb = table.tier.staging_stride  # (the GPU row cache's stride too)
            self.fixed = FixedStaging(n, rb, cuda, table.device)
            return
        self._src = table.tier.device_source()  # the kernel reads the table where it lives
        if ids is not None:
            self._ids = ids.view(-1)
        else:  # stage() copies the ids here, decode() on to the device
            self.ids_host = torch.zeros(n, dtype=torch.int64, pin_memory=cuda)
            self._ids = torch.zeros(n, dtype=torch.int64, device=table.device)

    def stage(self, row_ids, label: str = "decode") -> None:
        """Host half: ids [..., k] of this lookup's shape; raises like Table.lookup on bad ids."""
        t = self.table
        if t.closed:
            raise RuntimeError(f"table {t.spec.name} is closed")
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
        rec = CallRecord(label, "device", rows=self.n)
        rec.total_s = 0.0 if t0 is None else time.perf_counter() - t0
        self.table.metrics.record(rec)

    def decode(self) -> torch.Tensor:
        """GPU half (capturable; on CPU it runs at once): the staged rows, decoded, in `out`."""
        t = self.table
        fmt, dim, scale = t.format, t.dim, t.spec.scale
        if self.source == "device":
            if self.needs_stage:
                self._ids.copy_(self.ids_host, non_blocking=True)
            start, count = t.row_range.start, t.row_range.rows
            gather_decode(self._src, self._ids, start, count, fmt, dim, scale, self._flat)
        elif self.source == "cache":  # hits from the cache's data, misses from the staging
            c, (rows, index) = t.gpu_cache, self.fixed.sources()
            gather_decode(
                c.data, index, 0, c.base + self.n, fmt, dim, scale, self._flat, rows, c.base
            )
        else:  # the staging: pinned (the kernel reads it by UVA), or its device copy
            rows, index = self.fixed.sources()
            gather_decode(rows, index, 0, self.n, fmt, dim, scale, self._flat)
        return self.out

    def close(self) -> None:
        if self.source == "cache":
            self.table.gpu_cache.hold(self, np.zeros(0, np.int64))
        if self.fixed is not None:
            self.fixed.close()
