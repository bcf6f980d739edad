"""A lookup, planned once: every decision of how it runs, made in one function (`choose_plan`;
`choose_staged_plan` for a staged lookup), held in a frozen `Plan`; `Executor`
(lookup/executor.py) carries plans out and decides nothing.

    Route  how the rows reach `out`; its fields: `source` (a RowSource), `copies`, `place` (a
           Place: by id, in order, by an index), `staged`
      device_read            the kernel reads the tier where it lives (HBM, or pinned by UVA)
      tier_one_read          the tier reads every row into pinned staging in output order; the
                             kernel reads the staging in place (a decode step's: no copy, no index)
      tier_in_place          the same with an index (another rank's ids: zeros)
      tier_copy              staging copied to the device in one copy, then decoded
      tier_chunked_copy      read and copied a chunk at a time (a chunk's copy overlaps the
                             next's read)
      gpu_cache              the GPU row cache's hits; the tier reads the misses into staging
      staged_*               a staged lookup's (lookup/staged.py): device_read (host ids),
                             device_ids (ids on the device: no host work), in_place, copy (the
                             staging copied inside the decode), gpu_cache, gpu_cache_copy
    Runs   where the host work runs, and so which stream the GPU work goes on
      now         the caller's thread, at once, on the caller's stream (a lookup waited for)
      at_result   the caller's thread at result(), on the caller's stream (a small prefetch)
      ahead       the caller's thread at run_now(), on the table's stream behind an event
      worker      the table's worker thread, on the table's stream behind an event
      side        no host work: a device read launched now on the table's stream (a prefetch)

A deferred prefetch's plan runs at_result, and names the plan `run_now()` carries out instead
(`ahead`). Plans depend on a lookup's size and kind only, so the executor keeps them by those.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from plestore.lookup.metrics import disk_mark

if TYPE_CHECKING:
    from plestore.lookup.context import TableContext

__all__ = [
    "AHEAD_GPU_MAX_IDS",
    "GPU_GATHER_MAX_IDS",
    "UVA_MAX_BYTES",
    "Call",
    "Place",
    "Plan",
    "Route",
    "RowSource",
    "Runs",
    "choose_plan",
    "choose_staged_plan",
    "id_outside",
    "output_buffer",
    "plan_lookup",
    "validate_ids",
]

#: pinned, gather=auto: the GPU reads lookups of at most this many ids from pinned memory; the
#: host gathers larger ones. measured: RESULTS.md "lookup: GPU vs host gather"
GPU_GATHER_MAX_IDS = 16384
#: pinned, gather=auto: a lookup run a step ahead is host-gathered past this many ids (beside
#: the step). measured: RESULTS.md "e2e: host gathers"
AHEAD_GPU_MAX_IDS = 4096
#: caller-thread lookups staging at most this many bytes let the kernel read them from pinned
#: memory (one launch); larger ones, and every lookup on the table's stream, are copied first
UVA_MAX_BYTES = 256 << 10


class RowSource(Enum):
    """Where a lookup's rows come from."""

    DEVICE_READ = "device_read"  # the tier's rows, read by the kernel where they live
    TIER_READ = "tier_read"  # the tier's read into pinned staging
    GPU_CACHE = "gpu_cache"  # the GPU row cache, the tier's read for its misses


class Place(Enum):
    """How the kernel finds each output row."""

    IDS = "ids"  # by its id, where the tier keeps it (HBM, or pinned memory by UVA)
    ORDER = "order"  # staging row i is output row i: no index
    INDEX = "index"  # an index places each row (a staging row, a cache slot; -1: zeros)


class Route(Enum):
    """How a lookup's rows reach `out` (the module docstring): each route's value (its name in
    records), where its rows come from, whether staging is copied to the device before the
    kernel reads it, how the kernel places them, and whether it is a staged lookup's."""

    DEVICE_READ = ("device_read", RowSource.DEVICE_READ, False, Place.IDS, False)
    TIER_ONE_READ = ("tier_one_read", RowSource.TIER_READ, False, Place.ORDER, False)
    TIER_IN_PLACE = ("tier_in_place", RowSource.TIER_READ, False, Place.INDEX, False)
    TIER_COPY = ("tier_copy", RowSource.TIER_READ, True, Place.INDEX, False)
    TIER_CHUNKED_COPY = ("tier_chunked_copy", RowSource.TIER_READ, True, Place.INDEX, False)
    GPU_CACHE = ("gpu_cache", RowSource.GPU_CACHE, False, Place.INDEX, False)
    STAGED_DEVICE_READ = ("staged_device_read", RowSource.DEVICE_READ, False, Place.IDS, True)
    STAGED_DEVICE_IDS = ("staged_device_ids", RowSource.DEVICE_READ, False, Place.IDS, True)
    STAGED_IN_PLACE = ("staged_in_place", RowSource.TIER_READ, False, Place.INDEX, True)
    STAGED_COPY = ("staged_copy", RowSource.TIER_READ, True, Place.INDEX, True)
    STAGED_GPU_CACHE = ("staged_gpu_cache", RowSource.GPU_CACHE, False, Place.INDEX, True)
    STAGED_GPU_CACHE_COPY = ("staged_gpu_cache_copy", RowSource.GPU_CACHE, True, Place.INDEX, True)

    source: RowSource  # where the rows come from
    copies: bool  # staging copied to the device before the kernel reads it
    place: Place
    staged: bool  # a staged lookup's (lookup/staged.py)

    def __new__(cls, value: str, source: RowSource, copies: bool, place: Place, staged: bool):
        route = object.__new__(cls)
        route._value_ = value
        route.source, route.copies, route.place, route.staged = source, copies, place, staged
        return route


class Runs(Enum):
    """Where a lookup's host work runs (the module docstring)."""

    NOW = "now"
    AT_RESULT = "at_result"
    AHEAD = "ahead"
    WORKER = "worker"
    SIDE = "side"


@dataclass(frozen=True)
class Plan:
    """How a lookup runs: every decision, made by choose_plan (or choose_staged_plan)."""

    route: Route
    runs: Runs
    side: bool = False  # the GPU work goes on the table's stream, behind an event
    make_out: bool = False  # out is made at prefetch on the table's stream (none was given)
    after_table: bool = False  # made there, written on the caller's: that stream waits first
    consumer: bool = False  # the caller's out: the table's stream waits for it (an event)
    hint: bool = False  # tier.prefetch(rows) as it starts (its reads begin early)
    ahead: Plan | None = None  # a deferred prefetch's: the plan run_now() carries out


class Call(NamedTuple):
    """One lookup: its plan and what it carries the plan out on."""

    plan: Plan
    ids: Any  # int64 [n]: numpy for the host routes; numpy or a tensor for a device read
    out: torch.Tensor  # [n, dim] of the table's dtype
    shape: tuple  # what the caller gets: [..., k * dim]
    label: str
    consumer: Any = None  # plan.consumer: an event on the caller's stream at prefetch
    stream: Any = None  # at_result on CUDA: the caller's stream at prefetch (result() follows it)
    io0: int | None = None  # the disk mark from where this lookup's reads may have started


def choose_plan(
    ctx: TableContext, n: int, sync: bool, defer: bool, bounded: bool, own: bool
) -> Plan:
    """The plan of a lookup of n ids. sync: waited for at once (lookup); defer: a prefetch whose
    host work waits for run_now() or result(); bounded: a timeout bounds its wait; own: no
    `out` given.

    Rows: a tier the GPU cannot read, or that a GPU row cache fronts, is read by the host;
    gather=auto has the kernel read pinned memory up to GPU_GATHER_MAX_IDS ids, except a lookup
    run ahead past AHEAD_GPU_MAX_IDS (the copy engine leaves the SMs to the step beside it).
    measured: RESULTS.md "e2e: host gathers". Host work: in the caller's thread
    at any size when waited for at once, unless a timeout bounds a storage tier's read of more
    than `inline_ids` ids (a hung read then holds the worker, not the caller: the handoff, the
    worker's stream and event cost a large warm lookup, RESULTS.md "host time, part by part");
    a prefetch's up to `inline_ids` at result(), larger ones on the worker. GPU work of the
    worker and of a lookup run ahead goes on the table's stream into a buffer made there, so
    it need not wait for what the caller queued meanwhile; a caller's buffer is waited for."""
    tier, cuda, gather = ctx.tier, ctx.cuda, ctx.tuning.gather
    near = not (defer and n > AHEAD_GPU_MAX_IDS)
    if not tier.can_read_host or (
        ctx.device_readable
        and (gather == "gpu" or (gather == "auto" and near and n <= GPU_GATHER_MAX_IDS))
    ):
        side = cuda and not sync
        return Plan(Route.DEVICE_READ, Runs.SIDE if side else Runs.NOW, side=side)
    inline = defer or n <= ctx.tuning.inline_ids or (sync and not bounded)
    runs = Runs.WORKER if not inline else Runs.NOW if sync else Runs.AT_RESULT
    off_caller = cuda and (defer or runs is Runs.WORKER)  # may go on the table's stream
    hint = runs is Runs.AT_RESULT or (runs is Runs.NOW and tier.prefetch_before_read)
    made = dict(make_out=off_caller and own, consumer=off_caller and not own, hint=hint)
    ahead = None
    if defer:  # run_now(): on the table's stream (on CUDA), beside the step the caller queued
        ahead = Plan(_host_route(ctx, n, cuda), Runs.AHEAD, side=cuda, **made)
    route = _host_route(ctx, n, runs is Runs.WORKER and cuda)
    on_table = runs is Runs.WORKER and cuda
    after = made["make_out"] and not on_table
    return Plan(route, runs, side=on_table, after_table=after, ahead=ahead, **made)


def _host_route(ctx: TableContext, n: int, side: bool) -> Route:
    """A host tier's route for n ids: through the GPU row cache where there is one; else copied
    first on the table's stream always, in the caller's thread past UVA_MAX_BYTES (a kernel
    reading much pinned memory is slower than a copy and a decode: RESULTS.md "host time, part
    by part"), a chunk at a time past the tier's read_chunk_rows; else read in place."""
    tier = ctx.tier
    if ctx.gpu_cache is not None:
        return Route.GPU_CACHE
    if ctx.cuda and (side or n * tier.staging_stride > UVA_MAX_BYTES):
        return Route.TIER_CHUNKED_COPY if n > tier.read_chunk_rows else Route.TIER_COPY
    return Route.TIER_ONE_READ if ctx.whole else Route.TIER_IN_PLACE  # (whole: no index)


def choose_staged_plan(ctx: TableContext, n: int, device_ids: bool, device_read: bool) -> Plan:
    """A staged lookup's plan (lookup/staged.py): the kernel reads the tier where it lives
    where the GPU can and gather allows (never pinned gather=auto: the captured kernel then
    reads contiguous staging, not scattered rows over PCIe), or where asked (`device_read`);
    else the host stages the rows (through the GPU row cache where there is one), copied to the
    device inside the decode past UVA_MAX_BYTES."""
    tier, gather = ctx.tier, ctx.tuning.gather
    if not tier.can_read_host or (ctx.device_readable and (gather == "gpu" or device_read)):
        return Plan(Route.STAGED_DEVICE_IDS if device_ids else Route.STAGED_DEVICE_READ, Runs.NOW)
    if device_read:
        raise ValueError(
            f"table {ctx.name}: the GPU cannot read the {tier.name} tier itself"
            + (" behind a GPU row cache" if ctx.gpu_cache is not None else "")
        )
    copy = ctx.cuda and n * tier.staging_stride > UVA_MAX_BYTES
    if ctx.gpu_cache is not None:
        return Plan(Route.STAGED_GPU_CACHE_COPY if copy else Route.STAGED_GPU_CACHE, Runs.NOW)
    return Plan(Route.STAGED_COPY if copy else Route.STAGED_IN_PLACE, Runs.NOW)


def plan_lookup(
    ctx: TableContext,
    plans: dict,
    stream: Any,
    row_ids: Any,
    out: torch.Tensor | None,
    label: str,
    sync: bool,
    defer: bool = False,
    timeout: float | None = None,
) -> Call:
    """A lookup as a Call: its ids validated, its plan (choose_plan's, kept in `plans` by its
    inputs: a decode step's repeat), and what the plan needs made now: out (on the table's
    stream `stream` where the plan says), the caller's stream's event, the disk mark."""
    ids, shape = validate_ids(ctx, row_ids)
    n = ids.numel() if isinstance(ids, torch.Tensor) else ids.size
    bounded = ctx.tier.reads_storage and (timeout is not None or ctx.timeout_s is not None)
    key = (n, sync, defer, bounded, out is None)
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= 64:
            plans.clear()
        plan = plans[key] = choose_plan(ctx, n, sync, defer, bounded, out is None)
    out = output_buffer(ctx, shape, out, stream if plan.make_out else None)
    if plan.route is Route.DEVICE_READ:
        return Call(plan, ids, out, shape, label)
    ids = ids.cpu().numpy() if isinstance(ids, torch.Tensor) else ids
    consumer = caller = None
    if plan.consumer:
        consumer = torch.cuda.Event()
        consumer.record(torch.cuda.current_stream(ctx.device))
    if plan.runs is Runs.AT_RESULT and ctx.cuda:
        caller = torch.cuda.current_stream(ctx.device)
    io0 = None if plan.runs is Runs.WORKER else disk_mark(ctx.tier)
    return Call(plan, ids, out, shape, label, consumer, caller, io0)


def validate_ids(ctx: TableContext, row_ids: Any) -> tuple[Any, tuple]:
    """Flat int64 ids (numpy, or a tensor on the table's device) and the output shape; ids
    outside the table raise IndexError naming the first (device ids: one sync, unless
    check_ids is off)."""
    if isinstance(row_ids, torch.Tensor):
        if row_ids.is_floating_point() or row_ids.is_complex() or row_ids.dtype == torch.bool:
            raise ValueError(f"row ids must be integers, got {row_ids.dtype}")
        if row_ids.device.type not in ("cpu", ctx.device.type):
            raise ValueError(f"row ids must be on the cpu or {ctx.device}, got {row_ids.device}")
        ids = row_ids.reshape(-1).to(torch.int64).contiguous()  # (a strided 1-D view stays one)
        shape = tuple(row_ids.shape)
    else:
        arr = np.asarray(row_ids)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"row ids must be integers, got dtype {arr.dtype}")
        ids = np.ascontiguousarray(arr.reshape(-1), dtype=np.int64)  # the host core's layout
        shape = arr.shape
    if len(shape) == 0:
        raise ValueError("row ids must have at least one dimension ([..., k])")
    out_shape = (*shape[:-1], shape[-1] * ctx.dim)
    rows = ctx.rows
    if not (ids.numel() if isinstance(ids, torch.Tensor) else ids.size):
        return ids, out_shape
    if isinstance(ids, torch.Tensor):
        if ids.device.type != "cpu" and not ctx.tuning.check_ids:
            return ids, out_shape
        lo, hi = torch.stack(torch.aminmax(ids)).tolist()  # one sync for device ids
        bad = lo < 0 or hi >= rows
    else:
        bad = ctx.core.check_ids(ids, rows) >= 0  # one pass
    if bad:
        flat = ids.cpu().numpy() if isinstance(ids, torch.Tensor) else ids
        at = int(np.flatnonzero((flat < 0) | (flat >= rows))[0])
        raise id_outside(ctx, np.asarray(flat).reshape(shape), at)
    return ids, out_shape


def id_outside(ctx: TableContext, ids: np.ndarray, at: int) -> IndexError:
    """The error of ids[at] (flat position) outside the table, naming its value and position."""
    where = tuple(int(i) for i in np.unravel_index(at, ids.shape))
    v = int(ids.reshape(-1)[at])
    return IndexError(f"row id {v} at position {where} is outside table {ctx.name} [0, {ctx.rows})")


def output_buffer(
    ctx: TableContext, shape: tuple, out: torch.Tensor | None, stream: Any = None
) -> torch.Tensor:
    """A lookup's [n, dim] rows (the table's dtype): the caller's `out` checked, or a new
    tensor (made on `stream` when given: the stream that writes it)."""
    n = math.prod(shape) // ctx.dim if shape else 0  # (np.prod: more a call)
    if out is None:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            return torch.empty((n, ctx.dim), dtype=ctx.dtype, device=ctx.device)
    if out.dtype != ctx.dtype or out.device != ctx.device:
        raise ValueError(
            f"out must be {_short(ctx.dtype)} on {ctx.device}, got {_short(out.dtype)} on "
            f"{out.device}"
        )
    if tuple(out.shape) != shape or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous tensor of shape {shape}, got {tuple(out.shape)}"
        )
    return out.view(n, ctx.dim)


def _short(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )
