"""Where a warm host lookup's time goes, on one clock: the host's CUDA calls (allocations,
copies queued, kernel launches, waits), its torch ops of 5 µs or more, and the GPU's copies and
kernels, each as start and end in µs from the call's start (torch.profiler, which slows the host
part; the median call of several is printed). A GPU that starts its copy late waits on the
host; one that finishes long before the call returns waits on nothing — the host path's own
overhead. For #21: a 65,536-row pinned lookup ran at ~7× its PCIe floor, its parts adding to ~4×.

    python benchmarks/probes/lookup_timeline.py TABLE [--tiers pinned,direct]
        [--rows 65536,16] [--reps 5] [--json OUT]

TABLE: a packed table, or a directory to write one of random row bytes in (--table-rows).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from native_parts import _table  # (a probe beside this one)
from torch.profiler import ProfilerActivity, profile

import plestore

#: host calls worth a line (the rest of the runtime API is summed in `other_cuda_api`)
_HOST = (
    "cudaMemcpyAsync",
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cudaEventRecord",
    "cudaEventSynchronize",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaStreamWaitEvent",
    "cudaMalloc",
    "cudaHostAlloc",
    "cudaHostRegister",
)


def timeline(t, ids: np.ndarray, reps: int) -> dict:
    """The median of `reps` profiled calls of t.lookup(ids) (each synchronised), as lines."""
    sync = torch.cuda.synchronize if t.device.type == "cuda" else lambda: None
    for _ in range(3):
        t.lookup(ids)  # warm
    sync()
    calls = []
    for _ in range(reps):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            t.lookup(ids)
            sync()
            wall = (time.perf_counter() - t0) * 1e6
        events = [e for e in prof.events() if e.time_range.end > e.time_range.start]
        if not events:
            continue
        start = min(e.time_range.start for e in events)
        lines, other = [], 0.0
        for e in sorted(events, key=lambda e: e.time_range.start):
            a, b = e.time_range.start - start, e.time_range.end - start
            gpu = e.device_type == torch.autograd.DeviceType.CUDA
            if gpu or e.name in _HOST or (e.name.startswith("aten::") and b - a >= 5):
                lines.append([("gpu " if gpu else "host ") + e.name[:60], round(a, 1), round(b, 1)])
            elif e.name.startswith("cuda"):
                other += b - a
        calls.append(
            {"wall_us": round(wall, 1), "other_cuda_api_us": round(other, 1), "lines": lines}
        )
    calls.sort(key=lambda c: c["wall_us"])
    return calls[len(calls) // 2] if calls else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", help="a packed table, or a directory to write one in")
    ap.add_argument("--table-rows", type=int, default=4_000_000)
    ap.add_argument("--tiers", default="pinned,direct")
    ap.add_argument("--rows", default="65536,16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    path = _table(Path(args.table), args.table_rows)
    rng = np.random.default_rng(5)
    results = []
    for tier in ["device", *args.tiers.split(",")]:
        opts = {"cache_bytes": 1 << 30} if tier == "direct" else {}  # warm: rows in memory
        with plestore.open_table(path, tier=tier, device=args.device, **opts) as t:
            for n in map(int, args.rows.split(",")):
                ids = rng.integers(0, t.spec.rows, (max(1, n // 16), min(n, 16)))
                row = {"tier": tier, "rows": n, **timeline(t, ids, args.reps)}
                print(json.dumps(row), flush=True)
                results.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
