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
a plestore tier's start and finish between graphs instead (vLLM's eager breaks: the way
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

A directory of DeepSeek-V4.1's Engram tables times its Engram step instead (bench/vllm_engram.py
says what it is); cold, beside the step's blocks read alone, layer 0's time and layers 0-13's
(what layer 1's and layer 14's reads can hide behind).

    plestore bench vllm ENGRAM_DIR --batches 1,8,64 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

import numpy as np
import torch

import plestore
from plestore import native
from plestore.bench.limits import random_read_floor_s
from plestore.bench.methods import split_labels, tier_options
from plestore.bench.report import append_csv, machine
from plestore.bench.vllm_baselines import BASELINES, ENGRAM_BASELINES
from plestore.bench.vllm_engram import ENGRAM_DEFAULTS, ENGRAM_TIERS, EngramStep, engram_tables
from plestore.bench.vllm_model import DecodeStep, StepTier, open_step_tier
from plestore.bench.vllm_run import PAUSED, TimedSteps, drop_caches
from plestore.integrations.layerlookup import PleLayerLookup

__all__ = ["main"]

_DEFAULT_TIERS = (
    "device,pinned,vllm-pinned-uva,mapped,direct,"
    "cascade:device_budget_bytes=1000000000,pinned_budget_bytes=1000000000,"
    "direct:gpu_cache_bytes=268435456,vllm-disk-offload,mapped+eager,direct+eager"
)
_COLD = ("mapped", "direct", "cascade", "vllm-disk-offload", "disk-prestage")  # with a cold state
_QWEN_DEFAULTS = {"hidden": 2560, "q_dim": 4096, "kv_dim": 1024, "ffn": 9728, "layers": 8}
_FEED_TIMEOUT_S = 3.0  # a captured step's wait for its rows (a cold b64 step reads in ~12 ms)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="plestore bench vllm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "table",
        help="a packed Qwen4Exp table (its .json, or the directory), or a directory of "
        "DeepSeek-V4.1's Engram tables",
    )
    p.add_argument(
        "--tiers",
        default=None,
        help="plestore tiers, with table options after ':' (pinned:gather=cpu); '+beside': its "
        "captured lookup on a side stream beside layer 0; '+eager': its "
        "lookups between graphs; vLLM 0.34's paths: "
        + ", ".join(BASELINES)
        + " (Engram: "
        + ", ".join(ENGRAM_BASELINES)
        + f"). Default: {_DEFAULT_TIERS} (Engram: {ENGRAM_TIERS})",
    )
    p.add_argument("--caches", default="warm,cold", help="warm and/or cold")
    p.add_argument("--id-sets", type=int, default=8, help="warm steps cycle over this many id sets")
    p.add_argument("--batches", default="1,8,64,128,256", help="decode batch sizes (tokens a step)")
    p.add_argument("--steps", type=int, default=200, help="timed steps per tier and batch")
    p.add_argument("--rounds", type=int, default=4, help="blocks the steps are timed in")
    p.add_argument(
        "--hidden", type=int, help="the model's hidden size (Qwen4Exp 2560, Engram 4096)"
    )
    p.add_argument("--q-dim", type=int, help="attention query width (4096)")
    p.add_argument("--kv-dim", type=int, help="attention key (= value) width (1024; Engram 512)")
    p.add_argument("--ffn", type=int, help="MLP intermediate size (9728; Engram 14336)")
    p.add_argument("--layers", type=int, help="decoder layers after the last rows (8; Engram 4)")
    p.add_argument(
        "--mid-layers",
        type=int,
        default=13,
        help="Engram: decoder layers between layer 1's rows and layer 14's",
    )
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


def _windows_us(tier: StepTier, a, batch: int) -> list[float]:
    """What a read started at the hash can hide behind, as graphs: the step's window segments,
    each cumulative (Qwen4Exp: layer 0; Engram: layer 0, then layers 0-13)."""
    s = a.step_class(tier, a, batch, 1, seed=0)
    out = []
    for k in range(1, len(s.window) + 1):
        part = s.window[:k]
        for fn in part:
            fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for fn in part:
                fn()
        times = []
        for _ in range(50):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            g.replay()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out.append(1e6 * statistics.median(times))
    return out


def _open(a, spec: str, device: torch.device, max_tokens: int) -> StepTier:
    """A tier spec -> its step's lookups (one a table: Engram's two, Qwen4Exp's one)."""
    if a.engram is not None:
        paths, baselines = list(a.engram.values()), ENGRAM_BASELINES
    else:
        paths, baselines = [a.table], BASELINES
    return open_step_tier(spec, paths, baselines, device, max_tokens, _FEED_TIMEOUT_S)


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
        windows = ", ".join(f"{w:.0f}" for w in r["windows_us"])
        text += f"  disk alone {r['disk_us']:.0f} us, hides behind {windows} us"
    if r.get("host_step_us") is not None:
        text += f"  host step {r['host_step_us']:.1f} us"
    if r.get("host_bytes") is not None:
        text += f"  host {r['host_bytes'] / 2**20:.0f} MiB"
    if r.get("idle_host_thread_cpu") is not None:
        text += f"  idle host thread {r['idle_host_thread_cpu']:.3f} core"
    if r["steps_with_wrong_rows"]:
        text += f"  WRONG ROWS in {r['steps_with_wrong_rows']} steps"
    return text


def _run_all(a, device: torch.device, refs, log) -> tuple[list[dict], list[dict]]:
    """Every tier open at once; per (cache, batch) each tier's run built, then timed in
    --rounds blocks, round-robin (cold: every table's caches and the file dropped before each
    block). A tier that fails is reported; the rest go on."""
    batches = list(map(int, a.batches.split(",")))
    busies = [float(b) for b in str(a.host_busy_us).split(",")]
    rows, errors, tiers = [], [], {}

    def fail(spec, e):  # (where it failed goes to the log: a GPU run is rarely repeated)
        log(f"  {spec}: FAILED: {type(e).__name__}: {e}")
        log("".join(traceback.format_exception(e)[-6:]))
        errors.append({"tier": spec, "error": f"{type(e).__name__}: {e}"[:500]})

    for k, spec in enumerate(split_labels(a.tiers)):
        try:
            tiers[spec] = (k, _open(a, spec, device, max(batches)))
        except Exception as e:  # noqa: BLE001  (the other tiers still run; the exit code says)
            fail(spec, e)
    for cache in a.caches.split(","):
        for batch in batches:
            runs = {}
            for spec, (k, tier) in tiers.items():
                if cache == "cold" and tier_options(spec.partition("+")[0])[0] not in _COLD:
                    continue
                try:
                    runs[spec] = TimedSteps(tier, refs, a, batch, cache == "cold", seed=k)
                except Exception as e:  # noqa: BLE001
                    fail(spec, e)
            for r in range(a.rounds):
                for spec, run in list(runs.items()):
                    if cache == "cold":
                        for _, tier in tiers.values():
                            drop_caches(tier)
                    try:
                        for busy in busies:
                            run.time(a.steps // a.rounds + (r < a.steps % a.rounds), busy)
                    except Exception as e:  # noqa: BLE001
                        fail(spec, e)
                        del runs[spec]
            for spec, run in runs.items():
                if cache == "warm" and a.idle_s > 0:
                    run.after_idle(a.idle_s)
                paused = list(PAUSED) if cache == "warm" and a.idle_s > 0 else []
                for busy in busies + paused:
                    rows.append({"tier": spec, "cache": cache, "batch": batch, **run.result(busy)})
                    r = rows[-1]  # (a run cut short still shows what it checked)
                    wrong = r["steps_with_wrong_rows"]
                    log(
                        f"  {spec} {cache} b{batch} busy {busy:g}: {r['step_us']:.1f} us, "
                        f"{r['steps']} steps, {wrong} with wrong rows"
                    )
    for _, tier in tiers.values():
        tier.close()
    return rows, errors


def _model(a) -> None:
    """The step's model from the table: Engram's (a directory of its tables) or Qwen4Exp's;
    its defaults where an argument is not given."""
    a.engram = engram_tables(a.table)
    a.step_class = DecodeStep if a.engram is None else EngramStep
    defaults = _QWEN_DEFAULTS if a.engram is None else ENGRAM_DEFAULTS
    for key, value in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.tiers is None:
        a.tiers = _DEFAULT_TIERS if a.engram is None else ENGRAM_TIERS


def _cold_bounds(rows: list[dict], refs, a) -> None:
    """Each cold row beside the step's blocks read alone (every table's, read from the first
    table's file: the same disk) and what its reads hide behind. (The probe's lookups are
    left open: closing one closes its table, a ref that main closes.)"""
    ref = refs[0]
    bounds: dict[int, tuple] = {}
    for r in (r for r in rows if r["cache"] == "cold"):
        if r["batch"] not in bounds:
            probe = StepTier(
                "device", tuple(PleLayerLookup(t, t.spec.heads, r["batch"]) for t in refs)
            )
            blocks = r["batch"] * sum(t.spec.heads for t in refs)
            unit = ref.file.layout.block_bytes or 4096
            bounds[r["batch"]] = (
                _disk_us(str(ref.file.data_path), blocks, unit),
                _windows_us(probe, a, r["batch"]),
            )
        r["disk_us"], r["windows_us"] = bounds[r["batch"]]


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    _model(a)
    if a.switch_interval_us:
        sys.setswitchinterval(a.switch_interval_us * 1e-6)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    log = (lambda m: print(m, file=sys.stderr)) if a.json else print
    paths = list(a.engram.values()) if a.engram is not None else [a.table]
    refs = tuple(plestore.open_table(p, tier="device", device=str(device)) for p in paths)
    rows, errors = _run_all(a, device, refs, log)
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
    if device.type == "cuda":
        _cold_bounds(rows, refs, a)
    for r in rows:
        log(_line(r))
    for ref in refs:
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
