"""The GPU row cache's host costs per lookup, side by side in one process (medians, µs): a
batch-8 decode step's staged `stage()` and a 16,384-id lookup (a batch-8 prefill chunk of 128
tokens) through a cache of each size beside the uncached table; and the directory's probe
(`locate`) and admission alone, numpy beside the native core (its probe on one thread and on
the pool). Ids: a Zipf(1.2) stream, so hits,
misses and admissions all happen. The question: does a lookup cost what its ids cost, whatever
the cache's size and tier, and what does the native directory save.

    python benchmarks/probes/cache_host.py TABLE [--rows 2000000] [--sizes 64M,1G] [--reps 40]
        [--tiers pinned,direct] [--profile direct]

TABLE: a packed table, or a directory to write one of random row bytes in (--rows). Runs on
the CPU by default (the host side is the same; `--device cuda` adds the GPU's queueing).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import numpy as np
from native_parts import _table  # (a probe beside this one)

import plestore
from plestore import native
from plestore.options import parse_bytes


def _zipf(rng, rows: int, n: int) -> np.ndarray:
    return (rng.zipf(1.2, n) % rows).astype(np.int64).reshape(-1, 16)  # [n / 16, 16]


def _median_us(fn, args: list) -> float:
    ts = []
    for a in args:
        t0 = time.perf_counter()
        fn(a)
        ts.append(time.perf_counter() - t0)
    return round(float(np.median(ts)) * 1e6, 1)


def lookups(path: Path, tier: str, size: int, device: str, reps: int, profile: bool) -> dict:
    """stage() of a batch-8 decode step and lookups of 2,048 and 16,384 ids (a batch-1 and a
    batch-8 prefill chunk) on `tier` behind a cache of `size` bytes (0: none), after a warm-up
    that fills it; profile: the 2,048-id lookups' host time by function, on stderr."""
    rng = np.random.default_rng(0)
    with plestore.open_table(path, tier=tier, device=device, gpu_cache_bytes=size) as t:
        rows = t.spec.rows
        staged = t.staged((8, 16))
        for _ in range(30):  # warm: admissions, held slots, kernels, the tier's own caches
            t.lookup(_zipf(rng, rows, 16384))
            t.lookup(_zipf(rng, rows, 2048))
            staged.stage(_zipf(rng, rows, 128))
            staged.decode()
        steps = [_zipf(rng, rows, 128) for _ in range(20 * reps)]
        res = {"stage": _median_us(staged.stage, steps)}
        for n in (2048, 16384):
            ids = [_zipf(rng, rows, n) for _ in range(reps)]
            if profile and n == 2048:
                prof = cProfile.Profile()
                prof.enable()
            res[f"lookup_{n}"] = _median_us(t.lookup, ids)
            if profile and n == 2048:
                prof.disable()
                pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    return res


def directory(path: Path, size: int, reps: int) -> dict:
    """The directory of a `size`-byte cache alone: locate (touching) and admit of its misses,
    numpy and the native core on identical copies fed identical ids (128, 16,384 and 65,536:
    whether the pool gains as its job grows)."""
    core = native.load("on")
    rng = np.random.default_rng(1)
    with plestore.open_table(path, tier="pinned", device="cpu", gpu_cache_bytes=size) as t:
        rows = t.spec.rows
        for _ in range(30):
            t.lookup(_zipf(rng, rows, 16384))
        d = t.gpu_cache.directory
        pool = d.threads
        res = {"pool_threads": pool}
        for n in (128, 16384, 65536):
            ids = [_zipf(rng, rows, n).reshape(-1) for _ in range(reps)]
            for name, impl, threads in (
                ("numpy", None, 1),
                ("native_1thread", core, 1),
                ("native", core, pool),  # past 2,048 ids on the pool
            ):
                d._native, d.threads = impl, threads
                res[f"locate_{n}_{name}"] = _median_us(d.locate, ids)
            misses = [x[d.locate(x, touch=False) < 0] for x in ids]  # (as a lookup passes them)
            saved = d.tags.copy(), d.stamp.copy(), d._clock
            for name, impl in (("numpy", None), ("native", core)):
                d.tags[:], d.stamp[:], d._clock = saved[0], saved[1], saved[2]
                d._native = impl
                res[f"admit_{n}_{name}"] = _median_us(d.admit, misses)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", help="a packed table, or a directory to write one in")
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--sizes", default="64M,1G", help="cache sizes beside the uncached table")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tiers", default="pinned", help="host tiers whose lookups to time")
    ap.add_argument("--profile", default="", help="a tier: its cached 2,048-id lookups by function")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    path = _table(Path(args.table), args.rows)
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    result: dict = {"device": args.device, "rows": args.rows}
    for tier in args.tiers.split(","):
        for size in [0, *sizes]:
            key = f"{tier}_lookups_{size >> 20}M"
            prof = tier == args.profile and size == sizes[-1]
            result[key] = lookups(path, tier, size, args.device, args.reps, prof)
            print(json.dumps({key: result[key]}), flush=True)
    for size in sizes:
        result[f"directory_{size >> 20}M"] = directory(path, size, args.reps)
        print(json.dumps({f"directory_{size >> 20}M": result[f"directory_{size >> 20}M"]}))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
