"""A warm 65,536-row `lookup()` (a 4,096-token prefill chunk) on each host tier, by where its
host path runs and in what chunks: in the caller's thread (as `lookup()` runs without a
timeout), on the table's worker (a storage tier's, a timeout given: the handoff, the table's
stream and its event), and with other `read_chunk_rows` (each chunk's copy queued as it is
read); the tier's read alone (its bound on the host) and the device tier beside them, every
variant its own open table, all interleaved call by call (medians, µs; each call
synchronised), `--rounds` times.

    python benchmarks/probes/sync_paths.py TABLE [--rows 4000000] [--reps 30] [--rounds 3]
        [--chunks 16384,32768] [--json OUT]

TABLE: a packed table, or a directory to write one of random row bytes in (--rows).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from host_overhead import interleaved_us  # (probes beside this one)
from native_parts import _table

import plestore

N = 65536
TIERS = ("pinned", "mapped", "direct")
PCIE_BYTES_PER_S = 55.2e9  # H2D measured on the H200 (RESULTS.md "lookup")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", help="a packed table, or a directory to write one in")
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunks", default="16384,32768", help="read_chunk_rows variants")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    path = _table(Path(args.table), args.rows)
    dev = torch.device(args.device)

    def open_tier(tier: str) -> plestore.Table:
        return plestore.open_table(path, tier=tier, device=args.device)

    tables = {"device": open_tier("device")}
    for tier in TIERS:
        tables[tier] = open_tier(tier)
        for c in (int(c) for c in args.chunks.split(",") if c):
            if c != tables[tier].tier.read_chunk_rows:  # (the default is the plain variant)
                t = tables[f"{tier}:chunk{c}"] = open_tier(tier)
                t.tier.read_chunk_rows = c
    ids = np.random.default_rng(1).integers(0, tables["device"].spec.rows, (N // 16, 16))
    flat = ids.reshape(-1)
    calls = {k: (lambda t=t: t.lookup(ids)) for k, t in tables.items()}
    for tier in TIERS:
        t = tables[tier]
        if t.tier.reads_storage:  # (a memory tier's lookup runs in the caller's thread anyway)
            calls[f"{tier}:worker"] = lambda t=t: t.lookup(ids, timeout=600)
        buf = np.empty((N, t.tier.staging_stride), np.uint8)
        calls[f"{tier}:read"] = lambda t=t, b=buf: t.tier.read(flat, b)
    row_bytes = tables["device"].spec.row_bytes
    result = {
        "rows": N,
        "pcie_floor_us": round(N * row_bytes / PCIE_BYTES_PER_S * 1e6, 1),
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
