"""A host step's plan (native hoststep.c's): the rank's rows, the tier's host parts, the GPU row
cache's directory — what the core needs to run a host-fed lookup's step without Python. Built
once, and again only when what it was built from changes (the tier's parts: a source replaced,
a mapping's clean state or file identity; the GPU row cache), so a feed's loop rebuilds nothing.

It keeps references, never buffer exports: the core takes the buffers it names for one call
and releases them, so the tier closes its mapping while a plan is alive.

Also here: a host step's counters (native FEED_COUNTERS) as a metrics record and as the tier's
FedReads, and a step the core refused as its error (`step_error`: the state and detail say what
failed).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from plestore import native
from plestore.lookup.metrics import CallRecord
from plestore.lookup.plan import id_outside
from plestore.native.constants import C
from plestore.native.plans import GatherPlan
from plestore.tiers.base import FedReads, GatherSource, HostPart

if TYPE_CHECKING:
    from plestore.lookup.context import TableContext

__all__ = [
    "HostPlan",
    "core_name",
    "counted_reads",
    "counted_record",
    "reset_counters",
    "step_counters",
    "step_error",
]


def core_name(core: Any) -> str:
    """Which host core runs a step: "native" (the compiled one) or "reference" (numpy)."""
    return "reference" if core is native.load("off") else "native"


def step_counters() -> np.ndarray:
    """A host step's counters (native FEED_COUNTERS), as before any step."""
    return reset_counters(np.zeros(len(native.FEED_COUNTERS), np.int64))


def reset_counters(counters: np.ndarray) -> np.ndarray:
    """counters as before any step: zero, but CLEAN (a state, not a total) -1: no fed read
    of a mapping yet."""
    counters[:] = 0
    counters[C.CLEAN] = -1
    return counters


@dataclass(frozen=True, eq=False)
class HostPlan:
    """One table's host step plan; `args` is what the core's step takes (hoststep.c's tuple)."""

    key: tuple  # what it was built from: the tier's parts (a source's buffer by identity)
    cache: Any  # the table's GpuRowCache, or None
    parts: tuple[HostPart, ...]  # the tier's host parts
    args: tuple  # (rows, start, end, described parts, the cache's directory or None)

    @classmethod
    def current(cls, ctx: TableContext, plan: HostPlan | None = None) -> HostPlan | None:
        """`plan` where it still describes the table's host step, else a new one; None where
        the tier has no host parts (it closed)."""
        parts = ctx.tier.host_parts()
        if parts is None:
            return None
        streaming = ctx.tier.stream_stores
        key = (streaming, *(_key(p) for p in parts))
        cache = ctx.gpu_cache
        if plan is not None and plan.key == key and plan.cache is cache:
            return plan
        args = (
            ctx.rows,
            ctx.row_range.start,
            ctx.row_range.end,
            tuple(_described(p, streaming) for p in parts),
            cache.feed_plan() if cache is not None else None,
        )
        return cls(key, cache, parts, args)


def _key(p: HostPart) -> tuple:
    """A part as a plan depends on it: its rows, its source in its state (a source's buffer by
    identity: a buffer's == may compare its bytes)."""
    g = p.source
    if not isinstance(g, GatherSource):
        return (p.lo, p.hi, id(g))
    return (p.lo, p.hi, id(g.src), g.src_offset, g.row_bytes, g.base, g.rule, g.threads,
            g.cold_threads, g.file, g.clean, g.checks is not None)  # fmt: skip


def _described(p: HostPart, streaming: bool) -> tuple:
    """A host part as hoststep.c takes it: (lo, hi, streaming, a gather's arguments or the
    direct tier's core)."""
    g = p.source
    if not isinstance(g, GatherSource):
        return (p.lo, p.hi, streaming, g)
    rows_per_block, block, stride = g.rule
    gather = GatherPlan(
        src=g.src, src_offset=g.src_offset, row_bytes=g.row_bytes, base=g.base,
        rows_per_block=rows_per_block, block=block, stride=stride, threads=g.threads,
        cold_threads=g.cold_threads, clean=g.clean, file=g.file, checks=g.checks,
    )  # fmt: skip
    return (p.lo, p.hi, streaming, gather)


def counted_record(d: list[int], label: str, row_bytes: int, plan: Any = None) -> CallRecord:
    """Host steps' counter deltas `d` (native FEED_COUNTERS' words) as one step's metrics record
    (totals: record it with the steps' count, d[C.STEPS]); `plan`: the lookup's (its route and
    where it ran), if any."""
    route, runs = (plan.route.value, plan.runs.value) if plan is not None else ("", "")
    rec = CallRecord(label, "host", route, runs, d[C.ROWS], d[C.ABSENT])
    rec.major_faults, rec.minor_faults = d[C.MAJOR], d[C.MINOR]
    rec.bytes_read = rec.disk_read_bytes = d[C.DISK]
    rec.cache_hits, rec.blocks_read = d[C.HOST_HITS], d[C.BLOCKS]
    rec.gpu_cache_hits = d[C.GPU_HITS]
    rec.gpu_cache_hit_bytes = rec.gpu_cache_hits * row_bytes
    rec.host_gather_s = d[C.GATHER_NS] * 1e-9  # the parts' reads
    rec.total_s = d[C.STEP_NS] * 1e-9  # each fed step's post seen -> READY
    return rec


def counted_reads(d: list[int], clean: int) -> FedReads:
    """Host steps' counter deltas `d` as the tier's FedReads; `clean`: the counters' CLEAN now
    (a state, not a total; -1: no mapping read)."""
    hits = d[C.HOST_HITS]
    faulted = bool(d[C.MAJOR] or d[C.MINOR])
    misses, state = d[C.DIRECT_ROWS] - hits, clean if clean >= 0 else None
    return FedReads(d[C.STEPS], faulted, hits, misses, d[C.BLOCKS], state)


def step_error(ctx: TableContext, what: str, detail: int, ids: np.ndarray) -> Exception:
    """The error of a step the core refused, naming the table and the cause: `what` its state's
    name (native FEED_STATES), `detail` its detail (constants.h's SHARED_STATES), `ids` the
    step's ids [n] (a bad id's or row's position is `detail`)."""
    name, path = ctx.name, ctx.tier.table.data_path
    if what == "bad_id":
        return id_outside(ctx, ids, detail)
    if what == "bad_row":
        return IndexError(
            f"row {int(ids.reshape(-1)[detail])} lies outside table {name}'s host copy"
        )
    if what == "corrupt":  # (a tier checks blocks only with verify_reads: checks are set)
        return ctx.tier.checks.mismatch(detail)
    if what == "read_failed" and detail > 0:
        cause = os.strerror(detail)
        if detail == errno.EIO:
            cause += " (a failed or short read: the file truncated?)"
        return OSError(detail, f"table {name}: reading {path} failed: {cause}")
    if what == "read_failed":  # -1: the tier's core closed, -2: the staging too small
        if detail == -1:
            return RuntimeError(f"table {name}: its tier's core is closed")
        return ValueError(f"table {name}: a host step's staging is too small for its rows")
    if what == "file_changed":  # (a second time after the tier found the file its own)
        return OSError(
            errno.ESTALE, f"table {name}: data file {path} keeps changing under its mapping "
            f"(file state {detail}); reopen the table",
        )  # fmt: skip
    return RuntimeError(f"table {name}: the host step refused a step ({what}, {detail})")
