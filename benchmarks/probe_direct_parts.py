"""Where the direct tier's host time goes, part by part, on this machine (each part timed
alone, median of repeats): a warm 131,072-id prefill lookup (the row-cache probes, the tier's
reads, the whole host job) and a cold 16-row decode stage (validation, cache probe, block
offsets, submit, wait, placing) — the two gaps the fifth session left (benchmarks/RESULTS.md).

    python benchmarks/probe_direct_parts.py TABLE_DIR [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from probe_inline_parts import staged_cold

import plestore
from plestore.tablefile import DATA_OFFSET


def _median_ms(fn, reps: int = 7) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return round(float(np.median(ts)) * 1e3, 3)


def warm_parts(t, rng, n: int = 131072) -> dict:
    ids = rng.integers(0, t.spec.rows, n)
    t.lookup(ids.reshape(-1, 16))  # cached from here on
    uniq = np.unique(ids)
    chunk = t.tier.read_chunk_rows
    out = np.zeros((len(uniq), t.tier.staging_stride), np.uint8)
    chunks = [(a, min(a + chunk, len(uniq))) for a in range(0, len(uniq), chunk)]

    def reads():
        for a, b in chunks:
            t.tier.read(uniq[a:b], out[a:b])

    def lookup():
        t.lookup(ids.reshape(-1, 16))
        if t.device.type == "cuda":
            torch.cuda.synchronize()

    return {
        "ids": n,
        "cache_get_ms": _median_ms(lambda: t.tier.cache.get(uniq, out)),
        "tier_reads_ms": _median_ms(reads),
        "lookup_ms": _median_ms(lookup),
        "torch_threads": torch.get_num_threads(),
    }


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
        offs = DATA_OFFSET + t.file.layout.offsets(rows[miss])
        units = np.unique(offs // tier.unit * tier.unit)
        mark("block_offsets")
        handle = tier.reader.start(units, tier._staged)
        mark("submit")
        tier.reader.finish(handle)
        mark("wait")
        tier._place(rows, miss, units, tier._staged, out)
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
        print(json.dumps({"warm_prefill": warm_parts(t, rng)}), flush=True)
        print(json.dumps({"cold_decode_ms_p50": cold_stage_parts(t, a.table, rng)}), flush=True)


if __name__ == "__main__":
    main()
