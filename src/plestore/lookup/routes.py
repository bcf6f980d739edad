"""The body of each host route (lookup/plan.py's `Route`): one plan's host work and the GPU work
it queues. `Executor` (lookup/executor.py) calls the route's body with the plan's stream and
holds the lock and the stagings; nothing here decides a route.

    tier_one_read      tier.read -> staging [n, stride], in output order -> gather_decode
                       reading the staging in place (CPU: decoding it) -> out
    tier_in_place      the same with an index: another rank's ids come out zeros
    tier_copy          tier.read -> staging -> one H2D -> gather_decode -> out
    tier_chunked_copy  the read handed over a chunk at a time, each chunk's H2D queued as soon
                       as it is read (the copy of chunk k overlaps the read of chunk k+1)
    gpu_cache          per piece of at most SCRATCH_ROWS ids: directory -> the misses read into
                       staging -> one H2D into the cache's scratch rows (+ the index and
                       admissions, one copy) -> one gather_decode over the cache's data ->
                       admitted misses copied scratch -> slot

A staged lookup's stage() has no route here: the compiled host step fills its fixed staging
(lookup/executor.py); its decode() is the GPU half (lookup/staged.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from plestore.kernels.gather_decode import gather_decode
from plestore.lookup.gpucache import SCRATCH_ROWS
from plestore.lookup.plan import Route
from plestore.lookup.staging import fill_index, scatter_index

if TYPE_CHECKING:
    from plestore.lookup.executor import Executor
    from plestore.lookup.metrics import CallClock
    from plestore.lookup.plan import Call

__all__ = ["HOST_ROUTES"]


def tier_one_read(ex: Executor, call: Call, gpu: Any, side: bool, clock: CallClock) -> None:
    """Every row this rank's, read into staging in output order in one read: no index, no copy
    (on CUDA the kernel reads the pinned staging), one launch. A decode step's route: its
    bookkeeping kept to the least (measured: RESULTS.md "host time, part by part")."""
    tier = ex.context.tier
    rows_to_read, out = call.ids, call.out
    u, rb = rows_to_read.size, tier.staging_stride
    staging = ex.next_staging()
    staging.ensure(u * rb, 0)
    tg = time.perf_counter()
    td = clock.read(tier.read(rows_to_read, staging.rows_array(u, rb)), tg)
    src = staging.rows_tensor(u, rb)  # [u, stride]
    if gpu is None:
        ex.decode(src, ex.iota(u), out)
        clock.rec.decode_s = time.perf_counter() - td
    else:
        timed = ex.context.metrics.time_gpu(call.label)
        with ex.on(gpu, side):
            start = _timing_event(timed)
            ex.decode(src, ex.iota(u), out)
            staging.last_use = staging.done()
            staging.last_use.record(gpu)
        if timed:
            end = torch.cuda.Event(enable_timing=True)
            end.record(gpu)
            clock.rec.events = [("decode_s", start, end)]
    clock.done()


def _timing_event(timed: bool) -> Any:
    """A timing event recorded now on the current stream, where this call is sampled."""
    if not timed:
        return None
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def tier_in_place(ex: Executor, call: Call, gpu: Any, side: bool, clock: CallClock) -> None:
    """Tier reads into pinned staging and an index places them; the kernel reads the staging
    in place (on CPU the same kernel's reference decodes it)."""
    _through_staging(ex, call, gpu, side, clock, copy=False, chunked=False)


def tier_copy(ex: Executor, call: Call, gpu: Any, side: bool, clock: CallClock) -> None:
    """Tier reads into pinned staging, one copy to the device, one kernel decodes it."""
    _through_staging(ex, call, gpu, side, clock, copy=True, chunked=False)


def tier_chunked_copy(ex: Executor, call: Call, gpu: Any, side: bool, clock: CallClock) -> None:
    """tier_copy with the read handed over a chunk at a time, each chunk's copy queued as soon
    as it is read, so reading chunk k+1 overlaps copying chunk k."""
    _through_staging(ex, call, gpu, side, clock, copy=True, chunked=True)


def _through_staging(
    ex: Executor, call: Call, gpu: Any, side: bool, clock: CallClock, copy: bool, chunked: bool
) -> None:
    """The tier's read into staging, copied (chunk by chunk) or not, then one gather+decode
    kernel scatters the rows to their positions; other ranks' ids come out zeros."""
    t, ids, out = ex.context, call.ids, call.out
    n = ids.size
    inr, present, rows_to_read = ex.rows_to_read(ids)
    clock.rec.absent = n - present
    u, rb = rows_to_read.size, t.tier.staging_stride
    timed = gpu is not None and t.metrics.time_gpu(call.label)
    identity = present == n  # row i in staging is output row i: the cached iota is the index
    staging = ex.next_staging()
    staging.ensure(u * rb, 0 if identity else n)
    rows = staging.rows_array(u, rb)  # [u, staging_stride]
    if not identity:
        fill_index(staging.index.array[: n * 8].view(np.int64), inr, present)
    if gpu is not None and timed:  # around the copy and the decode
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2 + copy)]
    elif gpu is not None:  # one: the GPU is done
        ev = [staging.done()]
    on = ex.on(gpu, side)  # (entered once per GPU step below)
    raw = None
    if copy:
        with on:
            raw = torch.empty((u, rb), dtype=torch.uint8, device=t.device)
            if timed:
                ev[0].record()
    _read_copying(ex, rows_to_read, rows, staging, raw, on, clock, chunked)
    index = ex.iota(n) if identity else staging.index_tensor(n)  # [n]: pinned on CUDA
    src = raw if copy else staging.rows_tensor(u, rb)  # [u, stride]
    if gpu is None:
        td = time.perf_counter()
        ex.decode(src, index, out)
        clock.rec.decode_s = time.perf_counter() - td
    else:
        with on:
            if copy and not identity:
                index = index.to(t.device, non_blocking=True)
            if timed:
                ev[-2].record()
            ex.decode(src, index, out)
            ev[-1].record(gpu)
        staging.last_use = ev[-1]  # the GPU is done with the rows and index in staging
        if timed:
            clock.rec.events = [("h2d_s", ev[0], ev[1])] if copy else []
            clock.rec.events.append(("decode_s", ev[-2], ev[-1]))
    clock.done()


def _read_copying(ex: Executor, rows_to_read, rows, staging, raw, on, clock, chunked) -> None:
    """The tier's read of rows_to_read into rows, and, with raw (the device copy), its copy:
    chunked, each chunk's copy queued as soon as it is read (a Reading); else one read() (a
    Reading costs a decode lookup more)."""
    tier = ex.context.tier
    u, rb = rows.shape
    tg = time.perf_counter()
    reading = tier.start_read(rows_to_read, rows) if chunked else None
    try:
        if reading is None:
            clock.read(tier.read(rows_to_read, rows), tg)
            if raw is not None:
                with on:
                    raw.copy_(staging.rows_tensor(u, rb), non_blocking=True)
        else:
            with on:
                reading.copy_to(raw, staging.rows.tensor, tier.read_chunk_rows)
            clock.read(reading.done(), tg)  # (its copies queued meanwhile)
    except BaseException:
        if reading is not None:
            reading.close()  # nothing writes the staging any more
        if raw is not None:  # chunks already queued read the staging: its next use waits
            with on:
                staging.done().record()
            staging.last_use = staging.done()
        raise


def gpu_cache(ex: Executor, call: Call, gpu: Any, side: bool, clock: CallClock) -> None:
    """The rows through the table's GPU row cache, a piece of at most SCRATCH_ROWS ids at
    a time (the module docstring): the index and the admissions reach the device in one copy
    from pinned staging (a pageable copy would make the host wait for the stream, and with it
    for the layer that frees `out`)."""
    t, ids, out = ex.context, call.ids, call.out
    cache = t.gpu_cache
    n = ids.size
    inr, present, _ = ex.rows_to_read(ids)
    clock.rec.absent = n - present
    rb, dev = cache.stride, t.device
    for a in range(0, max(n, 1), SCRATCH_ROWS):
        b = min(n, a + SCRATCH_ROWS)
        piece = ids[a:b]
        mask = None if inr is None else inr[a:b]
        rows = piece if mask is None else piece[mask]
        slot, misses = cache.locate(rows)
        m = misses.size
        staging = ex.next_staging()
        staging.ensure(m * rb, (b - a) + 4 * m)  # the index, then up to m admissions
        missed = rows[misses]  # [m] the rows the tier reads
        tg = time.perf_counter()  # the misses in one read (the cache copies them whole)
        clock.read(t.tier.read(missed, staging.rows.array[: m * rb].reshape(m, rb)), tg)
        adm_slots, adm_pos = cache.admissions(missed)
        k = adm_slots.size
        index_np = staging.index.array[: (b - a + 4 * k) * 8].view(np.int64)  # [b - a + 4k]
        scatter_index(index_np[: b - a], mask, cache.index(slot, misses, cache.base))
        cache.admission_index(adm_slots, adm_pos, missed[adm_pos], index_np[b - a :])
        clock.rec.gpu_cache_hits += rows.size - m
        both = staging.index_tensor(b - a + 4 * k)
        with ex.on(gpu, side):
            if gpu is not None:
                cache.begin(gpu)
            if m:
                src = staging.rows.tensor[: m * rb].view(m, rb)
                cache.data[cache.base : cache.base + m].copy_(src, non_blocking=True)
            both = both.to(dev, non_blocking=True)
            td = time.perf_counter()
            fmt, dim, scale = t.format, t.dim, t.scale
            gather_decode(cache.data, both[: b - a], 0, cache.trash, fmt, dim, scale, out[a:b])
            if gpu is None:
                clock.rec.decode_s += time.perf_counter() - td
            if k:  # (a lookup the cache served whole admits nothing: no copies)
                cache.apply(both[b - a :].view(4, k))
            if gpu is not None:
                cache.end(gpu)
                staging.last_use = cache.last  # the GPU is done with staging and index
    clock.rec.gpu_cache_hit_bytes = clock.rec.gpu_cache_hits * t.tier.row_bytes
    clock.done()


#: each host route's body
HOST_ROUTES = {
    Route.TIER_ONE_READ: tier_one_read,
    Route.TIER_IN_PLACE: tier_in_place,
    Route.TIER_COPY: tier_copy,
    Route.TIER_CHUNKED_COPY: tier_chunked_copy,
    Route.GPU_CACHE: gpu_cache,
}
