"""Counters and timers per lookup, aggregated per phase label (prefill, decode, or the caller's),
with JSON and Prometheus text exposition.

GPU times come from CUDA events recorded around the H2D copy and the decode of host-path
lookups; they are resolved lazily when a snapshot is taken, so recording them never synchronises
the lookup path. They are sampled — the first call of a phase and one in `GPU_TIMING_EVERY` —
and scaled to all calls: timing events cost a decode-sized lookup host time, on the critical
path of a decode step (measured: RESULTS.md "host time, part by part").
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field, fields
from typing import Any

from plestore.io.memory import disk_read_bytes

__all__ = ["CallClock", "CallRecord", "Metrics", "PhaseStats", "disk_mark"]

_COUNTERS = (
    "calls",
    "rows",
    "absent",
    "cache_hits",
    "blocks_read",
    "bytes_read",
    "disk_read_bytes",
    "major_faults",
    "minor_faults",
    "gpu_cache_hits",  # ids served from the GPU row cache (no tier read, no PCIe copy)
    "gpu_cache_hit_bytes",  # their packed bytes: what the cache saved the disk / PCIe
)
_TIMERS = ("host_gather_s", "h2d_s", "decode_s", "wait_s", "total_s")
#: host-path calls per timed one (see the module docstring)
GPU_TIMING_EVERY = 16


class PhaseStats(dict):
    """One phase's counters (ints) and timers (float seconds, keys ending in _s): a dict for
    programs, shown for people (`print`) with times in units and the hit rate in percent."""

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{k}: {_shown(k, v)}" for k, v in self.items()) + "}"


def _shown(key: str, value: Any) -> str:
    if key.endswith("_s") and isinstance(value, float):
        if value == 0:
            return "0"
        for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
            if abs(value) >= scale:
                return f"{value / scale:.3g} {unit}"
        return f"{value / 1e-9:.3g} ns"
    if key.endswith("_rate") and isinstance(value, float):
        return f"{value:.1%}"
    return repr(value)


#: calls whose CUDA events wait to be read: past this many, finished ones are read at record()
_RESOLVE_AT = 256


@dataclass
class CallRecord:
    """One lookup. Counts are exact; disk bytes are what the tier's reads took from the disk
    where it counts them itself (direct: its O_DIRECT blocks; mapped on the native core: its
    reading threads' own read_bytes), else a process-wide delta over the call (other threads'
    I/O during it included); faults are those the tier's reading threads took."""

    label: str
    path: str  # "host" (tier read into pinned staging + H2D) or "device" (read on the device)
    route: str = ""  # its plan's route and where it ran (lookup/plan.py's Route, Runs)
    runs: str = ""
    rows: int = 0  # ids requested
    absent: int = 0  # ids outside this rank's range (zeros, no I/O)
    cache_hits: int = 0
    blocks_read: int = 0
    bytes_read: int = 0  # bytes the tier read from storage (exact for direct)
    disk_read_bytes: int = 0  # the tier's own count, else the /proc/self/io read_bytes delta
    major_faults: int = 0
    minor_faults: int = 0
    gpu_cache_hits: int = 0
    gpu_cache_hit_bytes: int = 0
    host_gather_s: float = 0.0  # the tier's read (a chunked one with its copies queued)
    decode_s: float = 0.0  # host decode (CPU device); GPU decode time comes from `events`
    total_s: float = 0.0  # submit -> GPU work enqueued (host path) or launched (device path)
    #: a staged lookup's host half: "native" or "reference" (the host core's step), else ""
    host_step: str = ""
    events: list = field(default_factory=list, repr=False)  # (name, start, end) CUDA events

    def add_read(self, st: Any) -> None:
        """Count a tier read's `ReadStats` into this call."""
        self.cache_hits += st.cache_hits
        self.blocks_read += st.blocks_read
        self.bytes_read += st.bytes_read
        self.major_faults += st.major_faults
        self.minor_faults += st.minor_faults


def disk_mark(tier: Any) -> int | None:
    """/proc/self/io read_bytes now, where a lookup's disk bytes are worth that read (a storage
    tier that does not count its own bytes exactly); else None."""
    return disk_read_bytes() if tier.reads_storage and not tier.exact_disk_bytes else None


class CallClock:
    """One host lookup's bookkeeping, started now: its record (counts, host phases as they end,
    GPU phases by events on the sampled calls), then its disk bytes and total time, kept."""

    __slots__ = ("io0", "metrics", "rec", "t0", "tier")

    def __init__(
        self,
        tier: Any,
        metrics: Metrics,
        label: str,
        rows: int,
        io0: int | None = None,
        plan: Any = None,
        t0: float | None = None,
    ) -> None:
        self.t0 = time.perf_counter() if t0 is None else t0
        self.tier, self.metrics = tier, metrics
        self.io0 = disk_mark(tier) if io0 is None else io0  # (a prefetch's: where reads began)
        route, runs = (plan.route.value, plan.runs.value) if plan is not None else ("", "")
        self.rec = CallRecord(label, "host", route, runs, rows=rows)

    def read(self, stats: Any, since: float) -> float:
        """A tier read since `since` counted: its ReadStats, its time; returns now."""
        self.rec.add_read(stats)
        now = time.perf_counter()
        self.rec.host_gather_s += now - since
        return now

    def done(self) -> None:
        rec = self.rec
        if self.io0 is not None:
            rec.disk_read_bytes = disk_read_bytes() - self.io0
        elif self.tier.exact_disk_bytes:
            rec.disk_read_bytes = rec.bytes_read
        rec.total_s = time.perf_counter() - self.t0
        self.metrics.record(rec)


class Metrics:
    def __init__(self, table: str, tier: str) -> None:
        self.table = table
        self.tier = tier
        self._lock = threading.Lock()
        self._agg: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._pending: list[tuple[str, list]] = []
        self._last: CallRecord | None = None
        self._sources: list = []  # callables bringing counts kept elsewhere in (add_source)
        self.host_bytes = 0
        self.host_budget: int | None = None

    def add_source(self, fold) -> None:
        """`fold()` records calls counted elsewhere (a graph feed's native steps, in C
        counters) before every snapshot, so each reader sees them (stats(), vLLM's /metrics)."""
        self._sources.append(fold)

    def record(self, rec: CallRecord) -> None:
        with self._lock:
            agg = self._agg[rec.label]
            for k in _COUNTERS[1:]:
                v = getattr(rec, k)
                if v:  # (most are 0 in a warm lookup: no dict write)
                    agg[k] += v
            agg["calls"] += 1
            agg["host_gather_s"] += rec.host_gather_s
            agg["decode_s"] += rec.decode_s
            agg["total_s"] += rec.total_s
            if rec.events:
                self._pending.append((rec.label, rec.events))
                if len(self._pending) >= _RESOLVE_AT:  # bounded, however rarely stats() runs
                    self._resolve(wait=False)
            self._last = rec

    def record_many(self, rec: CallRecord, calls: int) -> None:
        """`calls` lookups counted at once (rec holds their sums): a graph feed's native host
        side counts its steps in C, and they come here when stats are read."""
        if calls <= 0:
            return
        with self._lock:
            agg = self._agg[rec.label]
            for k in _COUNTERS[1:]:
                agg[k] += getattr(rec, k)
            agg["calls"] += calls
            agg["host_gather_s"] += rec.host_gather_s
            agg["total_s"] += rec.total_s

    def time_gpu(self, label: str) -> bool:
        """Whether this host-path call of `label` records GPU timing events (a sample)."""
        with self._lock:
            agg = self._agg[label]
            agg["gpu_calls"] += 1
            if (agg["gpu_calls"] - 1) % GPU_TIMING_EVERY:
                return False
            agg["gpu_timed"] += 1
            return True

    def add_wait(self, label: str, seconds: float) -> None:
        with self._lock:
            self._agg[label]["wait_s"] += seconds

    def _resolve(self, wait: bool = True) -> None:
        """Add the GPU times of finished calls (all calls if `wait`) to their phase."""
        keep = []
        for label, events in self._pending:
            if not wait and not events[-1][2].query():  # the call's last event: still queued
                keep.append((label, events))
                continue
            for name, start, end in events:
                end.synchronize()
                self._agg[label][name] += start.elapsed_time(end) / 1e3
        self._pending = keep

    def snapshot(self) -> dict[str, Any]:
        """{phase: {counter: value, timer_s: seconds, ...}} plus totals and memory."""
        self._fold_sources()
        with self._lock:
            self._resolve()
            phases = {
                label: PhaseStats((k, agg.get(k, 0.0)) for k in _COUNTERS + _TIMERS)
                for label, agg in self._agg.items()
            }
            for label, ph in phases.items():
                for k in _COUNTERS:
                    ph[k] = int(ph[k])
                present = ph["rows"] - ph["absent"]
                ph["gpu_cache_hit_rate"] = ph["gpu_cache_hits"] / present if present else 0.0
                agg = self._agg[label]
                if agg.get("gpu_timed"):  # sampled GPU times, scaled to every call
                    for k in ("h2d_s", "decode_s"):
                        ph[k] *= agg["gpu_calls"] / agg["gpu_timed"]
            last = None
            if self._last is not None:  # (asdict would try to deep-copy the CUDA events)
                last = {f.name: getattr(self._last, f.name) for f in fields(self._last)}
                last.pop("events")
        return {
            "table": self.table,
            "tier": self.tier,
            "phases": phases,
            "last_call": last,
            "host_bytes": self.host_bytes,
            "host_budget": self.host_budget,
        }

    def _fold_sources(self) -> None:
        for fold in self._sources:
            fold()

    def reset(self) -> None:
        self._fold_sources()  # (counted before the reset: gone with it)
        with self._lock:
            self._resolve()
            self._agg.clear()
            self._last = None

    def prometheus(self, prefix: str = "plestore") -> str:
        """Prometheus text exposition (counters per phase, a host-memory gauge)."""
        snap = self.snapshot()
        lines = []
        base = f'table="{self.table}",tier="{self.tier}"'
        for name in _COUNTERS + _TIMERS:
            metric = (
                f"{prefix}_{name.removesuffix('_s')}_seconds_total"
                if name.endswith("_s")
                else f"{prefix}_{name}_total"
            )
            lines.append(f"# TYPE {metric} counter")
            for label, ph in snap["phases"].items():
                lines.append(f'{metric}{{{base},phase="{label}"}} {ph[name]}')
        lines.append(f"# TYPE {prefix}_gpu_cache_hit_rate gauge")
        for label, ph in snap["phases"].items():
            lines.append(
                f'{prefix}_gpu_cache_hit_rate{{{base},phase="{label}"}} {ph["gpu_cache_hit_rate"]}'
            )
        lines.append(f"# TYPE {prefix}_host_bytes gauge")
        lines.append(f"{prefix}_host_bytes{{{base}}} {snap['host_bytes']}")
        if snap["host_budget"] is not None:
            lines.append(f"# TYPE {prefix}_host_budget_bytes gauge")
            lines.append(f"{prefix}_host_budget_bytes{{{base}}} {snap['host_budget']}")
        return "\n".join(lines) + "\n"
