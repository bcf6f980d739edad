"""One tier's timed decode steps for `plestore bench vllm` (bench/vllm_step.py says what is timed
and how): the step as CUDA graphs around its lookups, the variants (plain, a busy main thread,
after idle, woken or not), every step's rows checked, the tier's feeds' host time and memory."""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from plestore.bench.vllm_model import StepTier
from plestore.lookup.graphfeed import wake_feeds

__all__ = ["PAUSED", "TimedSteps", "drop_caches", "step_graphs"]

IDLE = -1.0  # TimedSteps.times' key of the steps after a pause
UNWOKEN = -2.0  # ... and of those after a pause that do not wake the feeds first
#: the after-pause variants by key (unwoken: the host side finds the post on its own, after a
#: sleep between polls — what a step after idle cost before the engine woke it)
PAUSED = {IDLE: "after-idle", UNWOKEN: "after-idle-unwoken"}


class TimedSteps:
    """One tier's steps at one batch: built and warmed up once, then timed in blocks (the tiers'
    blocks interleaved, so a drift of the machine is every tier's); every step's rows checked
    against `refs` (warm: after a pass over the id sets; cold: fresh ids every step)."""

    def __init__(self, tier: StepTier, refs, a, batch: int, cold: bool, seed: int = 0) -> None:
        sets = (a.steps + a.id_sets + 8) if cold else a.id_sets
        self.s = s = a.step_class(tier, a, batch, sets, seed=batch * 1000 + seed)
        self.tier, self.refs, self.a, self.cold = tier, refs, a, cold
        self.cuda = tier.cuda
        self.plan = (
            step_graphs(s.segments, tier.placement) if self.cuda else [f for _, f in s.segments]
        )
        for _ in range(2 if cold else a.id_sets):  # warm-up: every id set's rows read once
            for fn in self.plan:
                fn()
        if self.cuda:  # (the warm-up's replays done: its first reads are not the timed steps')
            torch.cuda.synchronize()
        self.times: dict[float, list[float]] = {}  # by the main thread's busy µs
        self.idle_cpu: float | None = None  # the host threads' CPU share, idle (after_idle)
        self.fed0 = _fed_steps(tier)  # the feeds' (steps, host seconds) before timing
        self.fed1: tuple | None = None  # ... and after the timed steps (before after_idle's)
        self.bad = 0
        self.failed = False

    def time(self, steps: int, busy_us: float = 0.0) -> None:
        s, cuda = self.s, self.cuda
        for _ in range(steps if not self.failed else 0):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            if busy_us != UNWOKEN:  # (as vLLM's runner does as a step begins: vllm/steps.py)
                wake_feeds()
            for fn in self.plan:
                fn()
                _busy(max(busy_us, 0.0))
            if cuda:
                torch.cuda.synchronize()
            self.times.setdefault(busy_us, []).append(time.perf_counter() - t0)
            self.bad += not s.exact(self.refs)
            if _feed_failed(self.tier):  # (each further step would wait out the timeout too)
                self.bad, self.failed = self.bad + 1, True

    def after_idle(self, pause_s: float, steps: int = 5) -> None:
        """Steps each after `pause_s` of nothing (an engine between requests: the host side
        sleeps between polls by then), woken and unwoken in turn (the variants of `PAUSED`);
        the tier's host threads' CPU share over each pause's second half (their spin after a
        step long over) in idle_cpu."""
        cpu = wall = 0.0
        self.fed1 = _fed_steps(self.tier)  # (the timed steps' host time, not these)
        for _ in range(steps):
            for key in PAUSED:
                time.sleep(pause_s / 2)
                c0, t0 = _feeder_cpu_s(self.tier), time.perf_counter()
                time.sleep(pause_s / 2)
                c1 = _feeder_cpu_s(self.tier)
                if c0 is not None and c1 is not None:
                    cpu, wall = cpu + c1 - c0, wall + time.perf_counter() - t0
                self.time(1, key)
        self.idle_cpu = cpu / wall if wall else None

    def result(self, busy_us: float = 0.0) -> dict:
        t = sorted(self.times.get(busy_us, [])) or [float("nan")]
        variant = PAUSED.get(busy_us) or ("busy-main-thread" if busy_us else "plain")
        idle = {"idle_host_thread_cpu": self.idle_cpu} if busy_us in PAUSED else {}
        (n0, s0), (n1, s1) = self.fed0, self.fed1 or _fed_steps(self.tier)
        return {
            **idle,
            "host_bytes": _host_bytes(self.tier),
            "host_step_us": 1e6 * (s1 - s0) / (n1 - n0) if n1 > n0 else None,
            "step_us": 1e6 * statistics.median(t),
            "p90_us": 1e6 * t[int(0.9 * (len(t) - 1))],
            "placement": self.tier.placement if self.cuda else "eager",
            "steps": len(t),
            "host_busy_us": max(busy_us, 0.0),
            "variant": variant,
            "steps_with_wrong_rows": self.bad,
        }


def _busy(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while us and time.perf_counter() < end:
        pass


def _stats(tier: StepTier) -> list[dict]:
    """The stats() of the tier's plestore tables (none for a vLLM baseline)."""
    return [lk.table.stats() for lk in tier.lookups if hasattr(lk.table, "stats")]


def _fed_steps(tier: StepTier) -> tuple[int, float]:
    """The steps the tier's graph feeds served (phase graph; a step of two layers counts a
    feed's step each) and their host time (each step's post seen -> its rows ready)."""
    graphs = [st["phases"].get("graph", {}) for st in _stats(tier)]
    return sum(g.get("calls", 0) for g in graphs), sum(g.get("total_s", 0.0) for g in graphs)


def _host_bytes(tier: StepTier) -> int | None:
    """The host memory the tier's plestore tables hold (pinned: the rows; direct: its cache and
    staging; mapped: the resident pages it keeps), None for a vLLM baseline."""
    held = [st.get("host_bytes") for st in _stats(tier)]
    return sum(held) if held and None not in held else None


def _feeder_cpu_s(tier: StepTier) -> float | None:
    """The CPU time of the tier's graph-feed host threads (None: none, or no /proc)."""
    feeds = [st.get("feed") or {} for st in _stats(tier)]
    cpu = [f["thread_cpu_s"] for f in feeds if f.get("thread_cpu_s") is not None]
    return sum(cpu) if cpu else None


def _feed_failed(tier: StepTier) -> bool:
    for lookup in tier.lookups:
        check = getattr(lookup.table, "check_feed", None)
        try:
            if check is not None:
                check()
        except RuntimeError as e:
            print(f"  {e}", file=sys.stderr)
            return True
    return False


def drop_caches(tier: StepTier) -> None:
    """Cold: the tier's caches dropped and its files evicted (no mapping of them lives here)."""
    for lookup in tier.lookups:
        t = lookup.table
        if hasattr(t, "drop_caches"):
            t.drop_caches()
            path = t.file.data_path
        else:
            path = lookup.tf.data_path
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def step_graphs(segments: list, placement: str) -> list:
    """The step as CUDA graphs: one whole graph; the model's work between graphs around eager
    starts and finishes (breaks); or the hash's graph, the host's starts, the model's graph
    (before)."""
    for _, fn in segments:  # warm up before any capture
        fn()
    torch.cuda.synchronize()
    parts: list = []  # a tuple of captured fns, or an eager fn
    for kind, fn in segments:
        eager = kind != "gpu" and (
            placement == "breaks" or (placement == "before" and kind == "start")
        )
        if eager:
            parts.append(fn)
        elif parts and isinstance(parts[-1], tuple):
            parts[-1] += (fn,)
        else:
            parts.append((fn,))
    plan = []
    for part in parts:
        if callable(part):
            plan.append(part)
            continue
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for fn in part:
                fn()
        plan.append(g.replay)
    return plan
