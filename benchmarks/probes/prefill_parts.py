"""A warm 65,536-row host lookup (a 4,096-token prefill chunk) split into its parts, per host
tier, each part timed alone and everything interleaved call by call (medians, µs; each call
synchronised): the whole `lookup()`; the tier's read of every row in one call and in the host
path's chunks (`read_chunk_rows`); the H2D copy of the staged rows (from torch's pinned memory,
and from the host path's own registered staging on 4 KiB and on 2 MiB pages) and of the index; the
decode kernel over rows already on the device; the same lookup with the rows read in one chunk;
the device tier's lookup and the PCIe floor of the bytes beside them. Where the sum of the parts
is far below the lookup, the rest is the path's own overhead (syncs, allocation, launches).

    python benchmarks/probes/prefill_parts.py TABLE [--rows 4000000] [--reps 30] [--json OUT]

TABLE: a packed table, or a directory to write one of random row bytes in (--rows).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch
from host_overhead import interleaved_us  # (probes beside this one)
from native_parts import _table

import plestore
from plestore.io.memory import HostBuffer
from plestore.kernels.gather_decode import gather_decode

N = 65536
PCIE_BYTES_PER_S = 55.2e9  # H2D measured on the H200 (RESULTS.md "lookup")


def tier_parts(t, ids: np.ndarray, reps: int) -> dict:
    """The parts of t.lookup(ids) for a host tier t (warm)."""
    tier, dev = t.tier, t.device
    flat = ids.reshape(-1)
    rb = tier.staging_stride
    pin = dev.type == "cuda"
    staging = torch.empty((flat.size, rb), dtype=torch.uint8, pin_memory=pin)
    arr = staging.numpy()
    index_host = torch.arange(flat.size, dtype=torch.int64).pin_memory() if pin else None
    raw = torch.empty((flat.size, rb), dtype=torch.uint8, device=dev)
    index = torch.arange(flat.size, device=dev)
    out = torch.empty((flat.size, t.dim), dtype=t.dtype, device=dev)
    chunk = tier.read_chunk_rows

    def read_chunks() -> None:
        for a in range(0, flat.size, chunk):
            tier.read(flat[a : a + chunk], arr[a : a + chunk])

    def one_chunk_lookup() -> None:
        saved = tier.read_chunk_rows
        tier.read_chunk_rows = flat.size  # (an instance attribute over the class's)
        try:
            t.lookup(ids)
        finally:
            tier.read_chunk_rows = saved

    fns = {
        "lookup": lambda: t.lookup(ids),
        "lookup_one_chunk": one_chunk_lookup,
        "read_one_call": lambda: tier.read(flat, arr),
        "read_chunks": read_chunks,
        "decode": lambda: gather_decode(raw, index, 0, flat.size, t.format, t.dim, 1.0, out),
    }
    own = []  # the host path's own staging (registered HostBuffers), on 4 KiB and 2 MiB pages
    if pin:
        fns["h2d_rows"] = lambda: raw.copy_(staging, non_blocking=True)
        fns["h2d_index"] = lambda: index.copy_(index_host, non_blocking=True)
        for name, huge in (("h2d_rows_staging_4k", False), ("h2d_rows_staging_2m", True)):
            buf = HostBuffer(flat.size * rb, pin=True, hugepages=huge)
            own.append(buf)
            src = buf.tensor.view(flat.size, rb)
            fns[name] = lambda src=src: raw.copy_(src, non_blocking=True)
    try:
        res = interleaved_us(fns, reps, dev)
    finally:
        for buf in own:
            buf.close()
    res["chunk_rows"] = chunk
    res["staged_bytes"] = flat.size * rb
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", help="a packed table, or a directory to write one in")
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiers", default="pinned,mapped,direct")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    path = _table(Path(args.table), args.rows)
    dev = torch.device(args.device)
    result: dict = {"cpus": len(os.sched_getaffinity(0)), "device": str(dev), "rows": N}
    with plestore.open_table(path, tier="device", device=args.device) as t:
        ids = np.random.default_rng(3).integers(0, t.spec.rows, (N // 16, 16))
        result["device_lookup"] = interleaved_us({"lookup": lambda: t.lookup(ids)}, args.reps, dev)
        result["pcie_floor_us"] = round(N * t.spec.row_bytes / PCIE_BYTES_PER_S * 1e6, 1)
    print(json.dumps(result), flush=True)
    for name in args.tiers.split(","):
        # warm means in memory: the direct tier's row cache holds every row read here
        opts = {"cache_bytes": 1 << 30} if name == "direct" else {}
        with plestore.open_table(path, tier=name, device=args.device, **opts) as t:
            t.lookup(ids)  # warm: page cache, row cache, kernels
            result[name] = tier_parts(t, ids, args.reps)
        print(json.dumps({name: result[name]}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
