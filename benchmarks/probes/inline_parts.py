"""What a decode-sized host lookup costs on this machine, part by part (no profiler: each part
timed alone over many calls), and where a cold direct lookup of 16 rows spends its time.

    python benchmarks/probes/inline_parts.py TABLE_DIR            # warm parts, mapped + direct
    python benchmarks/probes/inline_parts.py TABLE_DIR --cold     # one cold lookup, in parts

Run in a fresh process for --cold (the table file evicted at start).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

import plestore
from plestore.io.memory import disk_read_bytes, evict, rusage_faults
from plestore.kernels.gather_decode import gather_decode


def per_call_us(fn, calls: int = 300) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / calls * 1e6


def warm_parts(table: str) -> dict:
    rng = np.random.default_rng(0)
    return {tier: _tier_parts(table, tier, rng) for tier in ("mapped", "direct")}


def _tier_parts(table: str, tier: str, rng: np.random.Generator) -> dict:
    with plestore.open_table(table, tier=tier) as t:
        rows = t.spec.rows
        ids = rng.integers(0, rows, (1, 16))
        t.lookup(ids)  # now cached (page cache / row cache)
        flat = np.sort(ids.ravel())
        buf = np.empty((16, t.tier.staging_stride), np.uint8)
        staged = torch.empty((16, t.tier.staging_stride), dtype=torch.uint8).pin_memory()
        index = torch.arange(16).pin_memory()
        dst = torch.empty((16, t.dim), dtype=torch.bfloat16, device="cuda")
        parts = {
            "lookup (prefetch + result)": lambda: t.lookup(ids),
            "prefetch only": lambda: t.prefetch(ids),
            "tier.read 16 rows": lambda: t.tier.read(flat, buf),
            "disk_read_bytes": disk_read_bytes,
            "rusage_faults thread": lambda: rusage_faults(thread=True),
            "rusage_faults process": rusage_faults,
            "event create+record x2": lambda: [
                torch.cuda.Event(enable_timing=True).record() for _ in range(2)
            ],
            "gather_decode launch (pinned src)": lambda: gather_decode(
                staged, index, 0, 16, t.format, t.dim, t.spec.scale, dst
            ),
            "torch.empty out": lambda: torch.empty((16, t.dim), device="cuda"),
        }
        out = {k: round(per_call_us(f), 1) for k, f in parts.items()}
        t.lookup(ids)  # (the prefetch-only calls left lookups pending)
    return out


def cold_parts(table: str) -> dict:
    torch.empty(1, device="cuda")
    rng = np.random.default_rng(1)
    res = {}
    with plestore.open_table(table, tier="direct") as t:
        warm = rng.integers(0, t.spec.rows, (1, 16))
        t.lookup(warm)  # machinery warm (kernel, rings, buffers); measured rows stay on disk
        torch.cuda.synchronize()
        evict(table)
        ids = rng.integers(0, t.spec.rows, (1, 16))
        t0 = time.perf_counter()
        p = t.prefetch(ids, label="cold")
        t1 = time.perf_counter()
        out = p.result()
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        ph = t.stats()["phases"]["cold"]
        res["direct"] = {
            "prefetch_ms": (t1 - t0) * 1e3,
            "result_ms": (t2 - t1) * 1e3,
            "gpu_sync_ms": (t3 - t2) * 1e3,
            "host_gather_ms": ph.get("host_gather_s", 0) * 1e3,
            "blocks_read": ph.get("blocks_read"),
            "io_engine": t.tier.engine,
            "unit": t.tier.unit,
        }
        # raw block reads of 16 more cold rows, no table machinery
        ids2 = rng.integers(0, t.spec.rows, 16)
        offs = np.unique(
            (4096 + t.tier.table.layout.offsets(np.sort(ids2))) // t.tier.unit * t.tier.unit
        )
        t0 = time.perf_counter()
        t.tier.reader.read(offs, t.tier._staged)
        res["raw_read_16_ms"] = (time.perf_counter() - t0) * 1e3
        del out
    res["raw_reads_16"] = raw_reads(table, rng)
    res["staged_cold_16"] = staged_cold(table, rng)
    return res


def staged_cold(table: str, rng, batches: int = 40) -> dict:
    """A batch-1 decode step's host work on a cold direct table: StagedLookup.stage() of 16
    rows never read before (the row cache holds none), ms percentiles, beside raw_reads_16."""
    with plestore.open_table(table, tier="direct") as t:
        staged = t.staged((1, 16))
        staged.stage(rng.integers(0, t.spec.rows, (1, 16)))  # machinery warm
        ms = []
        for _ in range(batches):
            ids = rng.integers(0, t.spec.rows, (1, 16))
            t0 = time.perf_counter()
            staged.stage(ids)
            ms.append((time.perf_counter() - t0) * 1e3)
            time.sleep(0.002)  # as between decode steps: the cache insert runs meanwhile
    return percentiles(ms)


def raw_reads(table: str, rng, batches: int = 40) -> dict:
    """Batches of 16 cold 512-B block reads straight through each engine's BlockReader: the
    disk's own latency for a batch-1 decode step's reads, without the table machinery."""
    from plestore.io.blockreader import BlockReader
    from plestore.io.memory import HostBuffer
    from plestore.tablefile import DATA_OFFSET, TableFile

    tf = TableFile.open(table)
    out = {}
    for engine in ("io_uring", "threads"):
        reader = BlockReader(tf.data_path, 512, engine=engine, queue_depth=64, threads=16)
        staging = HostBuffer(16 * 512, pin=False)  # page-aligned, as O_DIRECT needs
        buf = staging.array.reshape(16, 512)
        ms = []
        for _ in range(batches):
            rows = rng.integers(0, tf.spec.rows, 16)
            units = np.unique((DATA_OFFSET + tf.layout.offsets(rows)) // 512 * 512)
            t0 = time.perf_counter()
            reader.read(units, buf)
            ms.append((time.perf_counter() - t0) * 1e3)
        reader.close()
        staging.close()
        out[engine] = percentiles(ms)
    return out


def percentiles(ms: list[float]) -> dict:
    return {q: round(float(np.percentile(ms, p)), 3) for q, p in _PCT.items()}


_PCT = {"p10": 10, "p50": 50, "p90": 90, "max": 100}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("table")
    ap.add_argument("--cold", action="store_true")
    a = ap.parse_args()
    print(json.dumps(cold_parts(a.table) if a.cold else warm_parts(a.table), indent=1))


if __name__ == "__main__":
    main()
