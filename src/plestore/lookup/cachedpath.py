"""A host lookup through the GPU row cache: hits decoded from HBM, only misses read by the tier.

`cached_steps` replaces `HostPath.steps` when the table has a `GpuRowCache`: per piece of at
most SCRATCH_ROWS ids, the directory names each row's slot, the tier reads the misses into
pinned staging, one copy puts them in the cache's scratch rows, one `gather_decode` over the
cache's data writes every output row (another rank's ids: zeros), and the admitted misses are
copied from scratch into their slots on the device (the index and the admissions reach it in one
copy from pinned staging: a pageable copy would make the host wait for the stream, and with it
for the layer that frees `out`). `CachedStage` does the same for a staged
lookup (fixed shapes, capturable decode; its kernel reads the misses from pinned staging; no
admissions: see `plestore.lookup.gpucache`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from plestore.io.memory import HostBuffer
from plestore.kernels.gather_decode import gather_decode
from plestore.lookup.gpucache import SCRATCH_ROWS
from plestore.lookup.hostpath import UVA_MAX_BYTES
from plestore.lookup.metrics import CallRecord

if TYPE_CHECKING:
    from plestore.lookup.hostpath import HostPath

__all__ = ["CachedStage", "cached_steps"]


def _read(tier, rows: np.ndarray, out: np.ndarray, rec: CallRecord) -> None:
    """The misses in one read (no copy to queue per chunk: the cache copies them whole)."""
    tg = time.perf_counter()
    rec.add_read(tier.read(rows, out))
    rec.host_gather_s += time.perf_counter() - tg


def cached_steps(
    hp: HostPath,
    ids: np.ndarray,
    out: torch.Tensor,
    label: str,
    stream: Any = None,
    consumer: Any = None,
    ready: Any = None,
    io0: int | None = None,
) -> None:
    """HostPath.steps through the table's GPU row cache (same arguments)."""
    t0, t = time.perf_counter(), hp.table
    cache = t.gpu_cache
    if io0 is None:
        io0 = hp.disk_mark()
    n = ids.size
    inr, present, _ = hp.rows_to_read(ids)
    rec = CallRecord(label=label, path="host", rows=n, absent=n - present)
    gpu = hp.gpu_stream(stream, ready, out)
    rb, dev = cache.stride, t.device
    for a in range(0, max(n, 1), SCRATCH_ROWS):
        b = min(n, a + SCRATCH_ROWS)
        piece = ids[a:b]
        mask = None if inr is None else inr[a:b]
        rows = piece if mask is None else piece[mask]
        slot, misses = cache.plan(rows)
        m = misses.size
        staging = hp.staging[hp._turn]
        hp._turn = (hp._turn + 1) % len(hp.staging)
        staging.ensure(m * rb, (b - a) + 4 * m)  # the index, then up to m admissions
        staged = staging.rows.array[: m * rb].reshape(m, rb)  # [m, stride]
        missed = rows[misses]  # [m] the rows the tier reads
        _read(t.tier, missed, staged, rec)
        adm_slots, adm_pos = cache.admissions(missed)
        k = adm_slots.size
        index_np = staging.index.array[: (b - a + 4 * k) * 8].view(np.int64)  # [b - a + 4k]
        idx = cache.index(slot, misses, cache.base)
        if mask is None:
            index_np[: b - a] = idx
        else:
            index_np[: b - a].fill(-1)
            index_np[: b - a][mask] = idx
        cache.admission_plan(adm_slots, adm_pos, missed[adm_pos], index_np[b - a :])
        rec.gpu_cache_hits += rows.size - m
        both = staging.index_tensor(b - a + 4 * k)
        with hp.on(gpu, ready):
            if gpu is not None:
                cache.begin(gpu)
                if consumer is not None:
                    gpu.wait_event(consumer)  # out's memory is free to write
            if m:
                src = staging.rows.tensor[: m * rb].view(m, rb)
                cache.data[cache.base : cache.base + m].copy_(src, non_blocking=True)
            both = both.to(dev, non_blocking=True)
            td = time.perf_counter()
            fmt, dim, scale = t.format, t.dim, t.spec.scale
            gather_decode(cache.data, both[: b - a], 0, cache.trash, fmt, dim, scale, out[a:b])
            if gpu is None:
                rec.decode_s += time.perf_counter() - td
            if k:  # (a lookup the cache served whole admits nothing: no copies)
                cache.apply(both[b - a :].view(4, k))
            if gpu is not None:
                cache.end(gpu)
                staging.last_use = cache._last  # the GPU is done with staging and index
    if ready is not None:
        ready.record(gpu)
    rec.gpu_cache_hit_bytes = rec.gpu_cache_hits * t.tier.row_bytes
    hp.record(rec, t0, io0)


class CachedStage:
    """The cache half of a staged lookup of n ids: pinned staging of its misses and index (the
    kernel reads hits from the cache's data and misses from the staging, where it is up to
    UVA_MAX_BYTES, else from a device copy made in decode(), as the host path does), the
    dynamic slots it holds until the next stage()."""

    def __init__(self, cache, n: int, cuda: bool) -> None:
        self.cache, self.n = cache, n
        rb = cache.stride
        self._rows = HostBuffer(n * rb, pin=cuda, hugepages=False)
        self._index = HostBuffer(n * 8, pin=cuda, hugepages=False)
        self._rows_t = self._rows.tensor.view(n, rb)
        self._index_t = self._index.tensor.view(torch.int64)
        self._dev = None  # device copies of both, where a kernel would read too much pinned memory
        if cuda and n * rb > UVA_MAX_BYTES:
            self._dev = (
                torch.empty((n, rb), dtype=torch.uint8, device=cache.device),  # [n, stride]
                torch.empty(n, dtype=torch.int64, device=cache.device),  # [n]
            )

    def stage(self, tier, inr, rows: np.ndarray, rec: CallRecord) -> None:
        cache = self.cache
        slot, misses = cache.plan(rows)
        rb = cache.stride
        missed = rows[misses]
        if tier.prefetch_before_read and misses.size:  # e.g. mapped, cold: reads in flight
            tier.prefetch(missed)
        _read(tier, missed, self._rows.array[: misses.size * rb].reshape(-1, rb), rec)
        idx = cache.index(slot, misses, cache.base)  # misses: base + their staged row
        index = self._index.array.view(np.int64)
        if inr is None:
            index[:] = idx
        else:
            index.fill(-1)
            index[inr] = idx
        cache.hold(self, slot)  # (the previous decode() has run: the caller's promise)
        rec.gpu_cache_hits += rows.size - misses.size
        rec.gpu_cache_hit_bytes = rec.gpu_cache_hits * tier.row_bytes
        if cache._cuda:  # the replay reads slots the cache's last lookup may have written
            cache.begin(torch.cuda.current_stream(cache.device))

    def decode(self, fmt, dim: int, scale: float, out: torch.Tensor) -> None:
        c, rows, index = self.cache, self._rows_t, self._index_t
        if self._dev is not None:  # (fixed addresses and sizes: still capturable)
            self._dev[0].copy_(rows, non_blocking=True)
            self._dev[1].copy_(index, non_blocking=True)
            rows, index = self._dev
        gather_decode(c.data, index, 0, c.base + self.n, fmt, dim, scale, out, rows, c.base)

    def close(self) -> None:
        self.cache.hold(self, np.zeros(0, np.int64))
        self._rows.close()
        self._index.close()
