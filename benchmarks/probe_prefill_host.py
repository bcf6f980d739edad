"""The direct tier's warm prefill lookup on this machine, variant beside variant: the row cache's
probe with numpy (one core) or torch ops (torch's threads) at several thread counts, and the
whole lookup of a prefill chunk (16,384 / 131,072 ids: batch 8 / 64 x 128 tokens x 16 heads)
as the decoder starts it (prefetch on the worker, result()), read in one call or in chunks.
Medians of repeats over four id sets in turn, each part alone.

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


def _median_ms(fn, sets: list, reps: int = 10) -> float:
    """fn(x) over the id sets in turn (a set seen again is out of the CPU caches by then)."""
    fn(sets[0])
    ts = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(sets[i % len(sets)])
        ts.append(time.perf_counter() - t0)
    return round(float(np.median(ts)) * 1e3, 3)


def _thp() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def cache_probes(t, sets: list, threads: list[int]) -> dict:
    """RowCache._get (numpy) and _get_parallel (torch) on the tier's warm cache."""
    cache = t.tier.cache
    out = np.zeros((len(sets[0]), t.tier.staging_stride), np.uint8)
    res = {}
    for n in (16384, len(sets[0])):
        rows = [ids[:n] for ids in sets]
        res[f"numpy_{n}"] = _median_ms(lambda r: cache._get(r, out[: len(r)]), rows)
        for k in threads:
            torch.set_num_threads(k)
            res[f"torch{k}_{n}"] = _median_ms(lambda r: cache._get_parallel(r, out[: len(r)]), rows)
    torch.set_num_threads(max(threads))
    return res


def lookups(t, sets: list) -> dict:
    """The decoder's first-chunk path: prefetch (worker), result(), the GPU done; the cache
    probed with torch or numpy, the lookup read in one call or 16,384-row chunks."""
    res = {}
    sync = torch.cuda.synchronize if t.device.type == "cuda" else (lambda: None)
    for n in (16384, len(sets[0])):
        chunks = [ids[:n].reshape(-1, 16) for ids in sets]
        for whole in (True, False):
            for parallel in (True, False):
                DirectTier.read_chunk_rows = 1 << 18 if whole else 16384
                rowcache.PARALLEL_ROWS = 8192 if parallel else 1 << 62
                name = f"{'whole' if whole else 'chunked'}_{'torch' if parallel else 'numpy'}"
                res[f"{name}_{n}"] = _median_ms(lambda c: (t.prefetch(c).result(), sync()), chunks)
    DirectTier.read_chunk_rows, rowcache.PARALLEL_ROWS = 1 << 18, 8192
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("table")
    ap.add_argument("--device", default=None)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    with plestore.open_table(a.table, tier="direct", device=a.device) as t:
        sets = [rng.integers(0, t.spec.rows, 131072) for _ in range(4)]
        for ids in sets:
            t.lookup(ids.reshape(-1, 16))  # every row cached from here on
        base = {"thp": _thp(), "torch_threads": torch.get_num_threads()}
        print(json.dumps({**base, **cache_probes(t, sets, [4, 8, base["torch_threads"]])}))
        print(json.dumps(lookups(t, sets)), flush=True)


if __name__ == "__main__":
    main()
