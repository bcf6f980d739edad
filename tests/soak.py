"""The soak, a test tool: long runs per tier, with what the process holds sampled over time.

    PYTHONPATH=src python3 tests/soak.py tables/ --lookups 100000 --json

tests/test_soak.py runs it at a fixed small budget in CI; this command is the long run.

Each tier runs `lookups` calls of mixed sizes (decode-sized to prefill chunks) and kinds:
`lookup`, `prefetch` + `result`, `prefetch` abandoned (never collected), `prefetch(defer=True)`
+ `run_now`, and every so often `drop_caches`. Every `every` lookups it samples the process:
RSS, open file descriptors, threads, the tier's host bytes (pinned memory, row cache, mapping
Rss) and CUDA memory. After a warm-up (the first `warmup` of the run), file descriptors and
threads must stay exactly flat and RSS grow less than `rss_bound` bytes: the verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["SoakResult", "main", "process_sample", "run_soak"]

#: lookup sizes (ids) and how often each is drawn: mostly decode steps, some prefill chunks
SIZES = (1, 8, 16, 64, 128, 1024, 2048, 16384)
WEIGHTS = (0.2, 0.2, 0.2, 0.15, 0.1, 0.08, 0.05, 0.02)


def process_sample() -> dict:
    """RSS, open fds and OS threads of this process, from /proc."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    threads = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                threads = int(line.split()[1])
    return {"rss": rss, "fds": _open_fds(), "threads": threads}


def _open_fds() -> int:
    """Open descriptors, less those on /proc files (a background thread reading
    /proc/self/smaps or /proc/self/io holds one for a moment: not a leak)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += not os.readlink(f"/proc/self/fd/{fd}").startswith("/proc/")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor among them)
    return n


@dataclass
class SoakResult:
    tier: str
    lookups: int
    ids: int
    seconds: float
    samples: list[dict] = field(default_factory=list)
    rss_growth: int = 0  # bytes, last sample - first sample after warm-up
    fds_flat: bool = True
    threads_flat: bool = True
    flat: bool = True
    verdict: str = ""


def run_soak(
    table: str,
    tier: str,
    lookups: int,
    every: int = 1000,
    warmup: float = 0.2,
    rss_bound: int = 64 << 20,
    device: str = "cpu",
    seed: int = 0,
    log=None,
    max_ids: int = SIZES[-1],
    **options,
) -> SoakResult:
    """`lookups` mixed calls on one tier (see the module doc), sampled every `every`; options:
    TableOptions fields."""
    import torch

    import plestore

    rng = np.random.default_rng(seed)
    t = plestore.open_table(table, tier=tier, device=device, **options)
    rows = t.spec.rows
    heads = t.spec.heads if t.spec.heads <= 16 else 1
    cuda = t.device.type == "cuda"
    res = SoakResult(tier, lookups, 0, 0.0)
    t0 = time.perf_counter()
    try:
        sizes = [n for n in SIZES if n <= max_ids]
        weights = np.array([w for n, w in zip(SIZES, WEIGHTS, strict=True) if n <= max_ids])
        for n in (*sizes, 0):  # every path once, cold and warm: pools and buffers reach size
            if n == 0:
                t.drop_caches()
                n = sizes[-1]
            ids = rng.integers(0, rows, (max(1, n // heads), heads))
            t.lookup(ids)
            t.prefetch(ids).result()
        sizes = rng.choice(sizes, size=lookups, p=weights / weights.sum())
        kinds = rng.random(lookups)
        for i in range(lookups):
            n = max(1, int(sizes[i]) // heads)
            ids = rng.integers(0, rows, (n, heads))
            k = kinds[i]
            if k < 0.4:
                t.lookup(ids)
            elif k < 0.75:
                t.prefetch(ids).result()
            elif k < 0.9:
                t.prefetch(ids)  # abandoned: never collected
            elif k < 0.999:
                p = t.prefetch(ids, defer=True)
                p.run_now()
                p.result()
            else:
                t.drop_caches()
            res.ids += ids.size
            if i % every == 0 or i == lookups - 1:
                s = process_sample()
                s.update(
                    lookups=i + 1,
                    seconds=round(time.perf_counter() - t0, 3),
                    tier_host_bytes=t.tier.host_bytes(),
                    python_threads=threading.active_count(),
                    cuda_bytes=torch.cuda.memory_allocated(t.device) if cuda else 0,
                )
                res.samples.append(s)
                if log and i % (every * 10) == 0:
                    log(
                        f"{tier}: {i + 1} lookups, rss {s['rss'] >> 20} MiB, fds {s['fds']}, "
                        f"threads {s['threads']}"
                    )
    finally:
        t.close()
    res.seconds = time.perf_counter() - t0
    _verdict(res, warmup, rss_bound)
    return res


def _verdict(res: SoakResult, warmup: float, rss_bound: int) -> None:
    after = [s for s in res.samples if s["lookups"] > warmup * res.lookups]
    if len(after) < 2:
        res.verdict = "too few samples after warm-up"
        res.flat = False
        return
    res.rss_growth = after[-1]["rss"] - after[0]["rss"]
    res.fds_flat = len({s["fds"] for s in after}) == 1
    res.threads_flat = len({s["threads"] for s in after}) == 1
    res.flat = res.fds_flat and res.threads_flat and res.rss_growth < rss_bound
    res.verdict = (
        f"{'flat' if res.flat else 'NOT FLAT'}: after warm-up RSS {res.rss_growth / 2**20:+.1f} "
        f"MiB (bound {rss_bound >> 20}), fds {_range(after, 'fds')}, threads "
        f"{_range(after, 'threads')}"
    )


def _range(samples: list[dict], key: str) -> str:
    lo, hi = min(s[key] for s in samples), max(s[key] for s in samples)
    return str(lo) if lo == hi else f"{lo}..{hi}"


def plot_soak(results: list[SoakResult], path: str) -> bool:
    """RSS, fds and threads per tier over lookups, one panel each; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.5))
    panels = (
        ("rss", "RSS (MiB)", 2**20),
        ("tier_host_bytes", "tier host bytes (MiB)", 2**20),
        ("fds", "open fds", 1),
        ("threads", "threads", 1),
    )
    for ax, (key, title, scale) in zip(axes, panels, strict=True):
        for r in results:
            xs = [s["lookups"] for s in r.samples]
            ax.plot(xs, [s[key] / scale for s in r.samples], label=r.tier)
        ax.set_title(title)
        ax.set_xlabel("lookups")
    axes[0].legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="tests/soak.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("table", help="a packed table (directory or .json)")
    p.add_argument("--tiers", default="device,pinned,mapped,direct")
    p.add_argument("--lookups", type=int, default=100_000, help="per tier (default 100000)")
    p.add_argument("--every", type=int, default=1000, help="sample every N lookups")
    p.add_argument("--warmup", type=float, default=0.2, help="fraction of the run (default 0.2)")
    p.add_argument("--rss-bound-mib", type=int, default=64, help="RSS growth allowed after it")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-ids", type=int, default=SIZES[-1], help="largest lookup (ids)")
    p.add_argument("--out", default="benchmarks/soak.jsonl", help="JSON rows ('' off)")
    p.add_argument("--plot", default="benchmarks/soak.png", help="PNG path ('' off)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    args = p.parse_args(argv)
    if args.lookups < 1 or args.every < 1:
        p.error("--lookups and --every must be >= 1")
    import torch

    from plestore.bench.report import machine

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    results = []
    for tier in args.tiers.split(","):
        r = run_soak(
            args.table,
            tier,
            args.lookups,
            args.every,
            args.warmup,
            args.rss_bound_mib << 20,
            device,
            args.seed,
            log,
            args.max_ids,
        )
        log(f"{tier}: {r.lookups} lookups ({r.ids} ids) in {r.seconds:.1f} s — {r.verdict}")
        results.append(r)
    meta = {"machine": machine(), "device": device, "table": args.table}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            for r in results:
                for s in r.samples:
                    f.write(json.dumps({"bench": "soak", "tier": r.tier, **s}) + "\n")
    if args.plot and results and plot_soak(results, args.plot):
        log(f"plot: {args.plot}")
    ok = all(r.flat for r in results)
    if args.json:
        print(json.dumps({**meta, "flat": ok, "tiers": [asdict(r) for r in results]}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
