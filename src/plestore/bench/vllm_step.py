"""`plestore bench vllm TABLE`: a decode step's PLE lookup as vLLM's Qwen4Exp runs it through the
plugin, per tier, beside the device tier's and beside vLLM 0.34's own offload paths — the time a
vLLM user pays for each, as µs added to a step sized like the real model.

vLLM's step, as the plugin sees it (one PLE layer, on decoder layer 1):

    segment 1   embed + hash: the step's ids written into the model's fixed id buffer
    start       the PLE layer's lookup starts (layer 1's prefetch, before layer 0 runs)
    segment 2   layer 0 (attention projections + MLP of --hidden / --q-dim / --kv-dim / --ffn)
    finish      the rows, where the PLE layer consumes them
    segment 3   the PLE layer's kv projection of the rows, then --layers decoder layers

Where a lookup runs (`placement`): every plestore tier on CUDA runs the whole step as ONE graph
— the GPU reads the device and pinned tiers itself; a host tier's graph posts the ids to the
table's host thread and waits for its rows on the GPU (lookup/graphfeed.py), in the step's own
stream where start and finish are ('+beside': on a side stream beside layer 0). '+eager' runs
a plestore tier's start and finish between three graphs instead (vLLM's eager breaks: the way
before graph feeding). vllm-pinned-uva is captured; vllm-disk-offload stages on the host between
the hash's graph and the model's (bench/vllm_baselines.py).

--caches warm: steps cycle over --id-sets sets of ids, read once before timing. cold: every step
fresh ids, the table file evicted (posix_fadvise DONTNEED, no live mapping) and the tier's caches
dropped before each timed block; beside it the step's blocks read alone (O_DIRECT, QD 64) and
layer 0's time (what a read can hide behind). Every tier is open at once and the tiers' steps
are timed in --rounds blocks, round-robin (a drift of the machine is every tier's). Every step's
rows are checked bit for bit against the resident table; a host-fed step whose rows did not
come counts as wrong.

Variants, timed in the same run: plain; busy-main-thread (--host-busy-us: the engine's main
thread runs Python after each launch, as vLLM's scheduler does while the GPU runs a step — a
host side that needs the GIL waits for it); after-idle (warm: steps each after --idle-s of
nothing — the feed's host thread sleeps between polls by then; each step wakes it as it begins,
as the vLLM plugin's runner does, `wake_feeds`), and after-idle-unwoken (the same without the
wake: the host side finds the post after a sleep between polls).

    plestore bench vllm TABLE --tiers device,pinned,mapped,direct,vllm-disk-offload --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

import plestore
from plestore import native
from plestore.bench.limits import random_read_floor_s
from plestore.bench.methods import split_labels, tier_options
from plestore.bench.report import append_csv, machine
from plestore.bench.vllm_baselines import BASELINES, open_baseline
from plestore.bench.vllm_model import DecodeStep
from plestore.integrations.layerlookup import PleLayerLookup
from plestore.lookup.graphfeed import wake_feeds

__all__ = ["main"]

_DEFAULT_TIERS = (
    "device,pinned,vllm-pinned-uva,mapped,direct,"
    "cascade:device_budget_bytes=1000000000,pinned_budget_bytes=1000000000,"
    "direct:gpu_cache_bytes=268435456,vllm-disk-offload,mapped+eager,direct+eager"
)
_COLD = ("mapped", "direct", "cascade", "vllm-disk-offload")  # tiers with a cold state
_IDLE = -1.0  # _Run.times' key of the steps after a pause
_UNWOKEN = -2.0  # ... and of those after a pause that do not wake the feeds first
#: the after-pause variants by key (unwoken: the host side finds the post on its own, after a
#: sleep between polls — what a step after idle cost before the engine woke it)
_PAUSED = {_IDLE: "after-idle", _UNWOKEN: "after-idle-unwoken"}
_FEED_TIMEOUT_S = 3.0  # a captured step's wait for its rows (a cold b64 step reads in ~12 ms)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="plestore bench vllm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("table", help="a packed Qwen4Exp table (its .json, or the directory)")
    p.add_argument(
        "--tiers",
        default=_DEFAULT_TIERS,
        help="plestore tiers, with table options after ':' (pinned:gather=cpu); '+beside': its "
        "captured lookup on a side stream beside layer 0; '+eager': its "
        "lookups between graphs; vLLM 0.34's paths: " + ", ".join(BASELINES),
    )
    p.add_argument("--caches", default="warm,cold", help="warm and/or cold")
    p.add_argument("--id-sets", type=int, default=8, help="warm steps cycle over this many id sets")
    p.add_argument("--batches", default="1,8,64,128,256", help="decode batch sizes (tokens a step)")
    p.add_argument("--steps", type=int, default=200, help="timed steps per tier and batch")
    p.add_argument("--rounds", type=int, default=4, help="blocks the steps are timed in")
    p.add_argument("--hidden", type=int, default=2560, help="the model's hidden size")
    p.add_argument("--q-dim", type=int, default=4096, help="attention query width")
    p.add_argument("--kv-dim", type=int, default=1024, help="attention key (= value) width")
    p.add_argument("--ffn", type=int, default=9728, help="MLP intermediate size")
    p.add_argument("--layers", type=int, default=8, help="decoder layers after the PLE's rows")
    p.add_argument(
        "--host-busy-us",
        default="0,200",
        help="variants, each timed in the same run: the engine's main thread runs Python this "
        "long after each launch (its scheduler: the GIL a host side in Python would wait for)",
    )
    p.add_argument(
        "--idle-s",
        type=float,
        default=0.3,
        help="warm: 5 steps more, each after this long of nothing (the variant after-idle; "
        "and 5 that do not wake the feeds first: after-idle-unwoken; 0: none)",
    )
    p.add_argument(
        "--switch-interval-us",
        type=float,
        default=None,
        help="sys.setswitchinterval: how long a thread asking for the GIL waits before the "
        "holder must give it up (Python's default 5000)",
    )
    p.add_argument("--csv", default="benchmarks/bench.csv", help="append rows here ('' off)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def _placement(lookup) -> str:
    return getattr(lookup, "placement", None) or ("graph" if lookup.captures else "breaks")


class _Run:
    """One tier's steps at one batch: built and warmed up once, then timed in blocks (the tiers'
    blocks interleaved, so a drift of the machine is every tier's); every step's rows checked
    against `ref` (warm: after a pass over the id sets; cold: fresh ids every step)."""

    def __init__(self, lookup, ref, a, batch: int, cold: bool, seed: int = 0) -> None:
        sets = (a.steps + a.id_sets + 8) if cold else a.id_sets
        self.s = s = DecodeStep(lookup, a, batch, sets, seed=batch * 1000 + seed)
        self.lookup, self.ref, self.a, self.cold = lookup, ref, a, cold
        self.cuda = lookup.table.device.type == "cuda"
        eager = [s.hash, s.start, s.layer0, s.finish, s.rest]
        self.plan = _graphs(s, _placement(lookup)) if self.cuda else eager
        for _ in range(2 if cold else a.id_sets):  # warm-up: every id set's rows read once
            for fn in self.plan:
                fn()
        if self.cuda:  # (the warm-up's replays done: its first reads are not the timed steps')
            torch.cuda.synchronize()
        self.times: dict[float, list[float]] = {}  # by the main thread's busy µs
        self.idle_cpu: float | None = None  # the host thread's CPU share, idle (after_idle)
        self.fed0 = _fed_steps(lookup)  # the feed's (steps, host seconds) before timing
        self.fed1: tuple | None = None  # ... and after the timed steps (before after_idle's)
        self.bad = 0
        self.failed = False

    def time(self, steps: int, busy_us: float = 0.0) -> None:
        s, cuda = self.s, self.cuda
        for _ in range(steps if not self.failed else 0):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            if busy_us != _UNWOKEN:  # (as vLLM's runner does as a step begins: vllm/steps.py)
                wake_feeds()
            for fn in self.plan:
                fn()
                _busy(max(busy_us, 0.0))
            if cuda:
                torch.cuda.synchronize()
            self.times.setdefault(busy_us, []).append(time.perf_counter() - t0)
            want = self.ref.lookup(s.ids).view(torch.int16)
            self.bad += not torch.equal(s.rows.view(torch.int16), want)
            if _feed_failed(self.lookup):  # (each further step would wait out the timeout too)
                self.bad, self.failed = self.bad + 1, True

    def after_idle(self, pause_s: float, steps: int = 5) -> None:
        """Steps each after `pause_s` of nothing (an engine between requests: the host side
        sleeps between polls by then), woken and unwoken in turn (the variants of `_PAUSED`);
        the table's host thread's CPU share over each pause's second half (its spin after a
        step long over) in idle_cpu."""
        cpu = wall = 0.0
        self.fed1 = _fed_steps(self.lookup)  # (the timed steps' host time, not these)
        for _ in range(steps):
            for key in _PAUSED:
                time.sleep(pause_s / 2)
                c0, t0 = _feeder_cpu_s(self.lookup), time.perf_counter()
                time.sleep(pause_s / 2)
                c1 = _feeder_cpu_s(self.lookup)
                if c0 is not None and c1 is not None:
                    cpu, wall = cpu + c1 - c0, wall + time.perf_counter() - t0
                self.time(1, key)
        self.idle_cpu = cpu / wall if wall else None

    def result(self, busy_us: float = 0.0) -> dict:
        t = sorted(self.times.get(busy_us, [])) or [float("nan")]
        variant = _PAUSED.get(busy_us) or ("busy-main-thread" if busy_us else "plain")
        idle = {"idle_host_thread_cpu": self.idle_cpu} if busy_us in _PAUSED else {}
        (n0, s0), (n1, s1) = self.fed0, self.fed1 or _fed_steps(self.lookup)
        return {
            **idle,
            "host_step_us": 1e6 * (s1 - s0) / (n1 - n0) if n1 > n0 else None,
            "step_us": 1e6 * statistics.median(t),
            "p90_us": 1e6 * t[int(0.9 * (len(t) - 1))],
            "placement": _placement(self.lookup) if self.cuda else "eager",
            "steps": len(t),
            "host_busy_us": max(busy_us, 0.0),
            "variant": variant,
            "steps_with_wrong_rows": self.bad,
        }


def _busy(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while us and time.perf_counter() < end:
        pass


def _fed_steps(lookup) -> tuple[int, float]:
    """The steps the table's graph feed served (phase graph) and their host time (each step's
    post seen -> its rows ready); (0, 0.0) for a table without one."""
    stats = getattr(lookup.table, "stats", None)
    graph = stats()["phases"].get("graph", {}) if stats is not None else {}
    return graph.get("calls", 0), graph.get("total_s", 0.0)


def _feeder_cpu_s(lookup) -> float | None:
    """The CPU time of the table's graph-feed host thread (None: none, or no /proc)."""
    stats = getattr(lookup.table, "stats", None)
    feed = stats().get("feed") if stats is not None else None
    return (feed or {}).get("thread_cpu_s")


def _feed_failed(lookup) -> bool:
    check = getattr(lookup.table, "check_feed", None)
    try:
        if check is not None:
            check()
    except RuntimeError as e:
        print(f"  {e}", file=sys.stderr)
        return True
    return False


def _drop(lookup) -> None:
    """Cold: the tier's caches dropped and the file evicted (no mapping of it lives here)."""
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


def _graphs(s: DecodeStep, placement: str) -> list:
    """The step as CUDA graphs: one whole graph; three around eager start and finish (breaks);
    or the hash's graph, the host's start, the model's graph (before)."""
    for fn in (s.hash, s.start, s.layer0, s.finish, s.rest):  # warm up before any capture
        fn()
    torch.cuda.synchronize()
    segments = {
        "graph": [(s.hash, s.start, s.layer0, s.finish, s.rest)],
        "breaks": [(s.hash,), s.start, (s.layer0,), s.finish, (s.rest,)],
        "before": [(s.hash,), s.start, (s.layer0, s.finish, s.rest)],
    }[placement]
    plan = []
    for part in segments:
        if callable(part):
            plan.append(part)
            continue
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for fn in part:
                fn()
        plan.append(g.replay)
    return plan


def _window_us(lookup, a, batch: int) -> float:
    """Layer 0 alone as a graph: what a read started at the hash can hide behind."""
    s = DecodeStep(lookup, a, batch, 1, seed=0)
    s.layer0()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        s.layer0()
    times = []
    for _ in range(50):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def _open(path: str, spec: str, device: torch.device, max_tokens: int):
    """A tier spec -> its step lookup: a vLLM baseline, or a plestore table's PleLayerLookup."""
    if spec in BASELINES:
        return open_baseline(spec, path, device, max_tokens)
    spec, eager, _ = spec.partition("+eager")
    spec, beside, _ = spec.partition("+beside")
    tier, kw = tier_options(spec)
    kw.setdefault("timeout_s", _FEED_TIMEOUT_S)
    table = plestore.open_table(path, tier=tier, device=str(device), **kw)
    heads = table.spec.heads
    return PleLayerLookup(table, heads, max_tokens, capture=not eager, beside=bool(beside))


def _disk_us(path: str, blocks: int, unit: int) -> float:
    """The step's blocks read alone: O_DIRECT reads at QD 64, median of 15."""
    times = [random_read_floor_s(path, blocks, unit, 64, seed=i) for i in range(15)]
    return 1e6 * float(np.median(times))


def _line(r: dict) -> str:
    names = {"plain": "", "after-idle": " idle", "after-idle-unwoken": " idle-unwoken"}
    busy = names.get(r["variant"], f" busy{r['host_busy_us']:g}")
    text = f"{r['tier']:>24}{busy} {r['cache']:<4} b{r['batch']:<3} {r['step_us']:8.1f} us/step"
    if r.get("added_us") is not None:
        text += f"  +{r['added_us']:7.1f} us ({r['vs_device']:.3f}x device)"
    text += f"  [{r['placement']}]"
    if r.get("disk_us") is not None:
        text += f"  disk alone {r['disk_us']:.0f} us, layer 0 {r['window_us']:.0f} us"
    if r.get("host_step_us") is not None:
        text += f"  host step {r['host_step_us']:.1f} us"
    if r.get("idle_host_thread_cpu") is not None:
        text += f"  idle host thread {r['idle_host_thread_cpu']:.3f} core"
    if r["steps_with_wrong_rows"]:
        text += f"  WRONG ROWS in {r['steps_with_wrong_rows']} steps"
    return text


def _run_all(a, device: torch.device, ref, log) -> tuple[list[dict], list[dict]]:
    """Every tier open at once; per (cache, batch) each tier's run built, then timed in
    --rounds blocks, round-robin (cold: every table's caches and the file dropped before each
    block). A tier that fails is reported; the rest go on."""
    batches = list(map(int, a.batches.split(",")))
    busies = [float(b) for b in str(a.host_busy_us).split(",")]
    rows, errors, lookups = [], [], {}

    def fail(spec, e):
        log(f"  {spec}: FAILED: {type(e).__name__}: {e}")
        errors.append({"tier": spec, "error": f"{type(e).__name__}: {e}"[:500]})

    for k, spec in enumerate(split_labels(a.tiers)):
        try:
            lookups[spec] = (k, _open(a.table, spec, device, max(batches)))
        except Exception as e:  # noqa: BLE001  (the other tiers still run; the exit code says)
            fail(spec, e)
    for cache in a.caches.split(","):
        for batch in batches:
            runs = {}
            for spec, (k, lookup) in lookups.items():
                if cache == "cold" and tier_options(spec.partition("+")[0])[0] not in _COLD:
                    continue
                try:
                    runs[spec] = _Run(lookup, ref, a, batch, cache == "cold", seed=k)
                except Exception as e:  # noqa: BLE001
                    fail(spec, e)
            for r in range(a.rounds):
                for spec, run in list(runs.items()):
                    if cache == "cold":
                        for _, lookup in lookups.values():
                            _drop(lookup)
                    try:
                        for busy in busies:
                            run.time(a.steps // a.rounds + (r < a.steps % a.rounds), busy)
                    except Exception as e:  # noqa: BLE001
                        fail(spec, e)
                        del runs[spec]
            for spec, run in runs.items():
                if cache == "warm" and a.idle_s > 0:
                    run.after_idle(a.idle_s)
                paused = list(_PAUSED) if cache == "warm" and a.idle_s > 0 else []
                for busy in busies + paused:
                    rows.append({"tier": spec, "cache": cache, "batch": batch, **run.result(busy)})
                    log(f"  {spec} {cache} b{batch} busy {busy:g}: {rows[-1]['step_us']:.1f} us")
    for _, lookup in lookups.values():
        lookup.close()
    return rows, errors


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.switch_interval_us:
        sys.setswitchinterval(a.switch_interval_us * 1e-6)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    log = (lambda m: print(m, file=sys.stderr)) if a.json else print
    ref = plestore.open_table(a.table, tier="device", device=str(device))
    rows, errors = _run_all(a, device, ref, log)
    cold_disk: dict[int, tuple] = {}
    for r in rows:  # beside the device tier's (warm) step at the same batch
        base = next(
            (
                b
                for b in rows
                if b["tier"] == "device"
                and (b["batch"], b["variant"]) == (r["batch"], r["variant"])
            ),
            None,
        )
        r["vs_device"] = r["step_us"] / base["step_us"] if base else None
        r["added_us"] = r["step_us"] - base["step_us"] if base else None
        if r["cache"] == "cold" and device.type == "cuda":
            if r["batch"] not in cold_disk:
                probe = PleLayerLookup(ref, ref.spec.heads, r["batch"])
                blocks, unit = r["batch"] * ref.spec.heads, ref.file.layout.block_bytes or 4096
                cold_disk[r["batch"]] = (
                    _disk_us(str(ref.file.data_path), blocks, unit),
                    _window_us(probe, a, r["batch"]),
                )
            r["disk_us"], r["window_us"] = cold_disk[r["batch"]]
    for r in rows:
        log(_line(r))
    ref.close()
    mach = machine()
    if device.type == "cuda":  # the capability graph feeding does without (never assumed)
        mach["stream_mem_ops"] = native.cuda_device_attribute(
            native.STREAM_MEM_OPS, torch.cuda.current_device()
        )
    result = {"machine": mach, "table": a.table, "rows": rows, "errors": errors}
    if a.csv:
        append_csv(a.csv, [{"bench": "vllm", **r} for r in rows], result["machine"])
    if a.json:
        print(json.dumps(result, indent=1))
    return 1 if errors or any(r["steps_with_wrong_rows"] for r in rows) else 0
