"""The direct tier's warm prefill lookup on this machine, variant beside variant: the row cache's
probe with numpy (one core) or torch ops (torch's threads) at several thread counts, and the
whole lookup of a prefill chunk (16,384 / 131,072 ids: batch 8 / 64 x 128 tokens x 16 heads)
as the decoder starts it (prefetch on the worker, result()), with and without the dedup.
Medians of repeats, each part alone.

    python benchmarks/probe_prefill_host.py TABLE_DIR [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

import plestore
import plestore.rowcache as rowcache
from plestore.tiers.direct import DirectTier


def _median_ms(fn, reps: int = 9) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return round(float(np.median(ts)) * 1e3, 3)


def _thp() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def cache_probes(t, ids: np.ndarray, threads: list[int]) -> dict:
    """RowCache._get (numpy) and _get_parallel (torch) on the tier's warm cache."""
    cache, out = t.tier.cache, np.zeros((len(ids), t.tier.staging_stride), np.uint8)
    res = {}
    for n in (16384, len(ids)):
        rows = np.unique(ids)[:n]
        res[f"numpy_{n}"] = _median_ms(lambda rows=rows: cache._get(rows, out[: len(rows)]))
        for k in threads:
            torch.set_num_threads(k)
            res[f"torch{k}_{n}"] = _median_ms(
                lambda rows=rows: cache._get_parallel(rows, out[: len(rows)])
            )
    torch.set_num_threads(max(threads))
    return res


def lookups(t, ids: np.ndarray) -> dict:
    """The decoder's first-chunk path: prefetch (worker), result(), the GPU done."""
    res = {}
    sync = torch.cuda.synchronize if t.device.type == "cuda" else (lambda: None)
    for n in (16384, len(ids)):
        chunk = ids[:n].reshape(-1, 16)
        for dedup in (True, False):
            for parallel in (True, False):
                DirectTier.needs_unique = dedup
                rowcache.PARALLEL_ROWS = 8192 if parallel else 1 << 62
                name = f"{'dedup' if dedup else 'no-dedup'}_{'torch' if parallel else 'numpy'}"
                res[f"{name}_{n}"] = _median_ms(lambda c=chunk: (t.prefetch(c).result(), sync()))
    DirectTier.needs_unique, rowcache.PARALLEL_ROWS = True, 8192
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("table")
    ap.add_argument("--device", default=None)
    a = ap.parse_args()
    ids = np.random.default_rng(0).integers(0, 1 << 62, 131072)
    with plestore.open_table(a.table, tier="direct", device=a.device) as t:
        ids %= t.spec.rows
        t.lookup(ids.reshape(-1, 16))  # every row cached from here on
        base = {"thp": _thp(), "torch_threads": torch.get_num_threads()}
        print(json.dumps({**base, **cache_probes(t, ids, [4, 8, base["torch_threads"]])}))
        print(json.dumps(lookups(t, ids)), flush=True)


if __name__ == "__main__":
    main()
