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

from plestore.io.memory import HostBuffer
from plestore.kernels.gather_decode import gather_decode
from plestore.lookup.hostpath import UVA_MAX_BYTES, fill_index
from plestore.lookup.metrics import CallRecord

if TYPE_CHECKING:
    from plestore.lookup import Table

__all__ = ["StagedLookup"]


class StagedLookup:
    """Lookups of row ids of one shape [..., k] into a fixed bf16 `out` [..., k * dim]."""

    def __init__(
        self,
        table: Table,
        shape: tuple[int, ...],
        out: torch.Tensor | None = None,
        ids: torch.Tensor | None = None,
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
        self.table, self.shape = table, tuple(shape)
        n = int(np.prod(shape))
        self.n = n
        out_shape = (*shape[:-1], shape[-1] * table.dim)
        self._flat = table._output(out_shape, out)  # [n, dim]
        self.out = self._flat.view(out_shape)
        cuda = table.device.type == "cuda"
        self.path = table._path(np.empty(n, np.int64), staged=True)
        self._cached = None  # through the table's GPU row cache (its own scratch rows there)
        #: stage() runs before each decode(); False: decode() reads the device `ids` as they are
        self.needs_stage = self.path != "device" or ids is None
        if self.path == "device":  # the kernel reads the table where it lives
            self._src = table.tier.device_source()
            if ids is not None:
                self._ids = ids.view(-1)
            else:  # stage() copies the ids here, decode() on to the device
                self._ids_host = torch.zeros(n, dtype=torch.int64, pin_memory=cuda)
                self._ids = torch.zeros(n, dtype=torch.int64, device=table.device)
            return
        if table.gpu_cache is not None:
            from plestore.lookup.cachedpath import CachedStage

            self._cached = CachedStage(table.gpu_cache, n, cuda)
            return
        rb = table.tier.staging_stride
        self._rows = HostBuffer(n * rb, pin=cuda, hugepages=False)  # staged row i
        self._index = HostBuffer(n * 8, pin=cuda, hugepages=False)  # out row j <- staged row
        self._rows_t = self._rows.tensor.view(n, rb)
        self._index_t = self._index.tensor.view(torch.int64)
        self._copy = cuda and n * rb > UVA_MAX_BYTES  # else the kernel reads pinned memory
        if self._copy:
            self._rows_dev = torch.empty((n, rb), dtype=torch.uint8, device=table.device)
            self._index_dev = torch.empty(n, dtype=torch.int64, device=table.device)

    def stage(self, row_ids, label: str = "decode") -> None:
        """Host half: ids [..., k] of this lookup's shape; raises like Table.lookup on bad ids."""
        t = self.table
        if t._closed:
            raise RuntimeError(f"table {t.spec.name} is closed")
        ids, shape = t._validate(row_ids)
        if tuple(shape) != tuple(self.out.shape):
            k = shape[-1] // t.dim
            raise ValueError(f"row ids of shape {self.shape} expected, got {(*shape[:-1], k)}")
        if isinstance(ids, torch.Tensor):
            ids = ids.cpu().numpy()
        t0 = time.perf_counter()
        if self.path == "device":
            if not self.needs_stage:
                raise RuntimeError("this staged lookup reads its ids on the device: no stage()")
            self._ids_host.numpy()[:] = ids
            self.replayed(label, t0)
            return
        with t._host.lock:
            self._stage_rows(ids, label, t0)

    def replayed(self, label: str = "decode", t0: float | None = None) -> None:
        """Account one lookup of a device-read tier in the table's metrics (for decode()
        replays that had no stage(): the ids were on the device)."""
        rec = CallRecord(label, "device", rows=self.n)
        rec.total_s = 0.0 if t0 is None else time.perf_counter() - t0
        self.table.metrics.record(rec)

    def _stage_rows(self, ids: np.ndarray, label: str, t0: float) -> None:
        t, n = self.table, self.n
        io0 = t._host.disk_mark()
        inr, present, rows = t._host.rows_to_read(ids)
        u = rows.size
        rec = CallRecord(label, "host", rows=n, absent=n - present)
        if self._cached is not None:
            self._cached.stage(t.tier, inr, rows, rec)
        else:
            fill_index(self._index.array.view(np.int64), inr, present)  # [n]
            if t.tier.prefetch_before_read:  # e.g. mapped, cold: every page's read in flight
                t.tier.prefetch(rows)
            rb = self._rows_t.shape[1]
            tg = time.perf_counter()
            rec.add_read(t.tier.read(rows, self._rows.array[: u * rb].reshape(u, rb)))
            rec.host_gather_s = time.perf_counter() - tg
        t._host.record(rec, t0, io0)

    def decode(self) -> torch.Tensor:
        """GPU half (capturable; on CPU it runs at once): the staged rows, decoded, in `out`."""
        t = self.table
        if self._cached is not None:
            self._cached.decode(t.format, t.dim, t.spec.scale, self._flat)
            return self.out
        if self.path == "device":
            if self.needs_stage:
                self._ids.copy_(self._ids_host, non_blocking=True)
            src, index, start, count = self._src, self._ids, t.row_range.start, t.row_range.rows
        elif self._copy:
            self._rows_dev.copy_(self._rows_t, non_blocking=True)
            self._index_dev.copy_(self._index_t, non_blocking=True)
            src, index, start, count = self._rows_dev, self._index_dev, 0, self.n
        else:  # the kernel reads staging and index from pinned memory
            src, index, start, count = self._rows_t, self._index_t, 0, self.n
        gather_decode(src, index, start, count, t.format, t.dim, t.spec.scale, self._flat)
        return self.out

    def close(self) -> None:
        if self._cached is not None:
            self._cached.close()
        elif self.path != "device":
            self._rows.close()
            self._index.close()
