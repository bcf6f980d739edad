"""A host step's plan (native hoststep.c's): the rank's rows, the tier's host parts, the GPU row
cache's directory — what the core needs to run a host-fed lookup's step without Python. Built
once, and again only when what it was built from changes (the tier's parts: a source replaced,
a mapping's clean state or file identity; the GPU row cache), so a feed's loop rebuilds nothing.

It keeps references, never buffer exports: the core takes the buffers it names for one call
and releases them, so the tier closes its mapping while a plan is alive.

Also here: a host step's counters (native FEED_COUNTERS) as a metrics record and as the tier's
FedReads.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from plestore.lookup.metrics import CallRecord
from plestore.native.constants import C
from plestore.tiers.base import FedReads, GatherSource, HostPart

if TYPE_CHECKING:
    from plestore.lookup.table import Table

__all__ = ["HostPlan", "counted_reads", "counted_record"]


@dataclass(frozen=True, eq=False)
class HostPlan:
    """One table's host step plan; `args` is what the core's step takes (hoststep.c's tuple)."""

    parts: tuple[HostPart, ...]  # the tier's host parts it was built from
    cache: Any  # the table's GpuRowCache, or None
    streaming: bool  # the parts' stores bypass the CPU's caches (rows go on by DMA)
    args: tuple  # (rows, start, end, described parts, the cache's directory or None)

    @classmethod
    def current(cls, table: Table, plan: HostPlan | None = None) -> HostPlan | None:
        """`plan` where it still describes the table's host step, else a new one; None where
        the tier's read needs Python (no host parts, or the tier closed)."""
        parts = table.tier.host_parts()
        if parts is None:
            return None
        streaming = table.tier.stream_stores
        if plan is not None and plan._describes(parts, table.gpu_cache, streaming):
            return plan
        cache = table.gpu_cache
        args = (
            table.spec.rows,
            table.row_range.start,
            table.row_range.end,
            tuple(_described(p, streaming) for p in parts),
            cache.feed_plan() if cache is not None else None,
        )
        return cls(parts, cache, streaming, args)

    def _describes(self, parts: tuple[HostPart, ...], cache: Any, streaming: bool) -> bool:
        if cache is not self.cache or streaming != self.streaming or len(parts) != len(self.parts):
            return False
        return all(_same_part(a, b) for a, b in zip(parts, self.parts, strict=True))


def _same_part(a: HostPart, b: HostPart) -> bool:
    """The same rows from the same source in the same state (a source's buffer by identity: a
    buffer's == may compare its bytes)."""
    if (a.lo, a.hi) != (b.lo, b.hi) or type(a.source) is not type(b.source):
        return False
    if not isinstance(a.source, GatherSource):
        return a.source is b.source
    return all(
        getattr(a.source, f.name) is getattr(b.source, f.name)
        if f.name == "src"
        else getattr(a.source, f.name) == getattr(b.source, f.name)
        for f in fields(GatherSource)
    )


def _described(p: HostPart, streaming: bool) -> tuple:
    """A host part as hoststep.c takes it: (lo, hi, streaming, a gather's arguments or the
    direct tier's core)."""
    g = p.source
    if not isinstance(g, GatherSource):
        return (p.lo, p.hi, streaming, g)
    gather = (
        g.src, g.src_offset, g.row_bytes, g.base, *g.rule, g.threads, g.cold_threads, g.clean,
        g.file,
    )  # fmt: skip
    return (p.lo, p.hi, streaming, gather)


def counted_record(d: np.ndarray, label: str, row_bytes: int, plan: Any = None) -> CallRecord:
    """Host steps' counter deltas `d` as one step's metrics record (totals: record it with the
    steps' count, d[C.STEPS]); `plan`: the lookup's (its route and where it ran), if any."""
    route, runs = (plan.route.value, plan.runs.value) if plan is not None else ("", "")
    rec = CallRecord(label, "host", route, runs, int(d[C.ROWS]), int(d[C.ABSENT]))
    rec.major_faults, rec.minor_faults = int(d[C.MAJOR]), int(d[C.MINOR])
    rec.bytes_read = rec.disk_read_bytes = int(d[C.DISK])
    rec.cache_hits, rec.blocks_read = int(d[C.HOST_HITS]), int(d[C.BLOCKS])
    rec.gpu_cache_hits = int(d[C.GPU_HITS])
    rec.gpu_cache_hit_bytes = rec.gpu_cache_hits * row_bytes
    rec.host_gather_s = float(d[C.GATHER_NS]) * 1e-9  # the parts' reads
    rec.total_s = float(d[C.STEP_NS]) * 1e-9  # each fed step's post seen -> READY
    return rec


def counted_reads(d: np.ndarray, now: np.ndarray) -> FedReads:
    """Host steps' counter deltas `d` (the counters `now`) as the tier's FedReads."""
    hits, misses = int(d[C.HOST_HITS]), int(d[C.DIRECT_ROWS] - d[C.HOST_HITS])
    faulted = bool(d[C.MAJOR] or d[C.MINOR])
    clean = int(now[C.CLEAN]) if now[C.CLEAN] >= 0 else None
    return FedReads(int(d[C.STEPS]), faulted, hits, misses, int(d[C.BLOCKS]), clean)
