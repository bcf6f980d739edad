"""Where the direct tier's host time goes, part by part, on this machine (each part timed
alone, medians): the row cache's probe of a warm prefill chunk (16,384 / 131,072 ids: batch 8
/ 64 x 128 tokens x 16 heads) in numpy (one core) or torch ops at several thread counts; the
whole warm lookup as the decoder starts a first chunk (prefetch on the worker, result()), read
in one call or in 16,384-row chunks, probed with torch or numpy; and a cold 16-row decode stage
(validation, cache probe, block offsets, submit, wait, placing). Warm parts run over four id
sets in turn (a set seen again is out of the CPU caches by then).

    python benchmarks/probes/direct_parts.py TABLE_DIR [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from inline_parts import staged_cold

import plestore
import plestore.tiers.rowcache as rowcache
from plestore.tiers.direct import DirectTier


def _median_ms(fn, sets: list, reps: int = 10) -> float:
    """fn(x) over the id sets in turn, the first call not counted."""
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
    res = {"thp": _thp(), "torch_threads": torch.get_num_threads()}
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
    whole, parallel = DirectTier.read_chunk_rows, rowcache.PARALLEL_ROWS
    for n in (16384, len(sets[0])):
        chunks = [ids[:n].reshape(-1, 16) for ids in sets]
        for one_call in (True, False):
            for torch_ops in (True, False):
                DirectTier.read_chunk_rows = whole if one_call else 16384
                rowcache.PARALLEL_ROWS = parallel if torch_ops else 1 << 62
                name = f"{'whole' if one_call else 'chunked'}_{'torch' if torch_ops else 'numpy'}"
                res[f"{name}_{n}"] = _median_ms(lambda c: (t.prefetch(c).result(), sync()), chunks)
    DirectTier.read_chunk_rows, rowcache.PARALLEL_ROWS = whole, parallel
    return res


def cold_stage_parts(t, table: str, rng, steps: int = 60) -> dict:
    """The pieces of a cold 16-row staged read, in order, with the host idle between steps as
    in a decode loop (2 ms)."""
    tier, staged = t.tier, t.staged((1, 16))
    staged.stage(rng.integers(0, t.spec.rows, (1, 16)))
    parts: dict[str, list[float]] = {}
    marks: list[float] = []

    def mark(name: str) -> None:  # the time since the last mark, as `name`
        marks.append(time.perf_counter())
        parts.setdefault(name, []).append((marks[-1] - marks[-2]) * 1e3)

    for _ in range(steps):
        ids = rng.integers(0, t.spec.rows, (1, 16))
        time.sleep(0.002)
        marks[:] = [time.perf_counter()]
        flat, _ = t._validate(ids)
        mark("validate")
        _, _, rows = t._host.rows_to_read(flat)
        mark("rows_to_read")
        out = staged._rows.array[: 16 * tier.staging_stride].reshape(16, tier.staging_stride)
        tier._settle()
        mark("settle")
        hit = tier.cache.get(rows, out)
        mark("cache_get")
        miss = np.flatnonzero(~hit)
        start, within = tier._locate(rows[miss])
        units, slot = np.unique(start, return_inverse=True)
        mark("block_offsets")
        handle = tier.reader.start(units, tier._staged)
        mark("submit")
        tier.reader.finish(handle)
        mark("wait")
        tier._copy_out(rows[miss], miss, slot * tier.unit + within, tier._staged_items, out)
        mark("place")
    res = {k: round(float(np.median(v)), 3) for k, v in parts.items()}
    res["stage_total"] = staged_cold(table, rng, steps)["p50"]  # the whole stage(), same way
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
        threads = sorted({4, 8, torch.get_num_threads()})
        print(json.dumps({"warm_cache_probe_ms": cache_probes(t, sets, threads)}), flush=True)
        print(json.dumps({"warm_lookup_ms": lookups(t, sets)}), flush=True)
        print(json.dumps({"cold_decode_ms_p50": cold_stage_parts(t, a.table, rng)}), flush=True)


if __name__ == "__main__":
    main()
