"""Where a warm `lookup()`'s host path runs, per host tier and lookup size (default a decode
step's 16 ids and a 4,096-token prefill chunk's 65,536): in the caller's thread (as `lookup()`
runs without a timeout), on the table's worker (a timeout given, `inline_ids=0`: the handoff,
the table's stream and its event), and at 65,536 ids with other `read_chunk_rows` (each
chunk's copy queued as it is read); the tier's read alone (its bound on the host) and the
device tier beside them, every variant its own open table, all interleaved call by call
(medians, µs; each call synchronised), `--rounds` times.

    python benchmarks/probes/sync_paths.py TABLE [--rows 4000000] [--ids 16,65536] [--reps 30]
        [--rounds 3] [--chunks 16384,32768] [--json OUT]

TABLE: a packed table, or a directory to write one of random row bytes in (--rows).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

import plestore
from plestore.spec import RowLayout, TableSpec
from plestore.tablefile import TableFile, TableWriter

TIERS = ("pinned", "mapped", "direct")
PCIE_BYTES_PER_S = 55.2e9  # H2D measured on the H200 (RESULTS.md "lookup")


def random_table(path: Path, rows: int) -> Path:
    """The table at path, or a new nvfp4 one there (dim 160: 90-B rows, 512-B blocks) of random
    bytes."""
    try:
        TableFile.open(path)
        return path
    except (OSError, ValueError):
        pass
    spec = TableSpec(name="t", rows=rows, dim=160, format="nvfp4", scale=1.0, heads=16)
    rng = np.random.default_rng(0)
    with TableWriter(path, spec, RowLayout(spec.row_bytes, block_bytes=512)) as w:
        for a in range(0, rows, 1 << 20):
            w.write_rows(rng.integers(0, 256, (min(1 << 20, rows - a), spec.row_bytes), np.uint8))
        w.commit()
    return path


def interleaved_us(fns: dict, reps: int, sync: torch.device | None = None) -> dict:
    """Median µs of each fn, the fns called in turn `reps` times (one untimed call each first)."""
    for fn in fns.values():
        fn()
    ts: dict = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            if sync is not None:
                torch.cuda.synchronize(sync)
            t0 = time.perf_counter()
            fn()
            if sync is not None:
                torch.cuda.synchronize(sync)
            ts[k].append(time.perf_counter() - t0)
    return {k: round(float(np.median(v)) * 1e6, 1) for k, v in ts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", help="a packed table, or a directory to write one in")
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--ids", default="16,65536", help="lookup sizes (ids)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunks", default="16384,32768", help="read_chunk_rows variants")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    path = random_table(Path(args.table), args.rows)
    dev = torch.device(args.device)

    def open_tier(tier: str, **options) -> plestore.Table:
        return plestore.open_table(path, tier=tier, device=args.device, **options)

    tables = {"device": open_tier("device")}
    for tier in TIERS:
        tables[tier] = open_tier(tier)
        if tables[tier].tier.reads_storage:  # (a memory tier's lookup runs in this thread)
            tables[f"{tier}:worker"] = open_tier(tier, inline_ids=0)
        for c in (int(c) for c in args.chunks.split(",") if c):
            if c != tables[tier].tier.read_chunk_rows:  # (the default is the plain variant)
                t = tables[f"{tier}:chunk{c}"] = open_tier(tier)
                t.tier.read_chunk_rows = c
    sizes = [int(n) for n in args.ids.split(",")]
    rng = np.random.default_rng(1)
    calls = {}
    for n in sizes:
        ids = rng.integers(0, tables["device"].spec.rows, (-(-n // 16), 16))
        flat = ids.reshape(-1)
        for k, t in tables.items():
            if ":chunk" in k and n <= t.tier.read_chunk_rows:
                continue  # (one chunk either way)
            timeout = 600 if k.endswith(":worker") else None
            calls[f"{k}@{n}"] = lambda t=t, ids=ids, s=timeout: t.lookup(ids, timeout=s)
        for tier in TIERS:
            t = tables[tier]
            buf = np.empty((flat.size, t.tier.staging_stride), np.uint8)
            calls[f"{tier}:read@{n}"] = lambda t=t, f=flat, b=buf: t.tier.read(f, b)
    row_bytes = tables["device"].spec.row_bytes
    result = {
        "ids": sizes,
        "pcie_floor_us": {n: round(n * row_bytes / PCIE_BYTES_PER_S * 1e6, 2) for n in sizes},
        "default_chunks": {k: tables[k].tier.read_chunk_rows for k in TIERS},
        "rounds": [],
    }
    try:
        for fn in calls.values():  # warm: page cache, row cache, kernels
            fn()
        for _ in range(args.rounds):
            us = interleaved_us(calls, args.reps, dev if dev.type == "cuda" else None)
            result["rounds"].append(us)
            print(json.dumps(us), flush=True)
    finally:
        for t in tables.values():
            t.close()
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
