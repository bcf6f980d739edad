"""Probe the warm gather paths on a GPU machine: pinned (cpu gather + H2D vs GPU reading pinned
memory), device, against the H2D floor measured in the same run. Used to set
`lookup.GPU_GATHER_MAX_IDS`; the full comparison lives in `plestore bench`.

    python benchmarks/probe_gather.py --gib 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np
import torch

import plestore
from plestore.spec import RowLayout, TableSpec
from plestore.tablefile import TableWriter


def build(path: str, gib: float, fmt: str = "nvfp4", dim: int = 160) -> int:
    spec0 = TableSpec(name="probe", rows=1, dim=dim, format=fmt)
    rows = int(gib * 2**30) // spec0.row_bytes
    spec = spec0.replace(rows=rows)
    rng = np.random.default_rng(0)
    chunk = (256 << 20) // spec.row_bytes
    with TableWriter(path, spec, RowLayout(spec.row_bytes, block_bytes=4096)) as w:
        for a in range(0, rows, chunk):
            n = min(chunk, rows - a)
            data = rng.integers(0, 256, (n, spec.row_bytes), dtype=np.uint8)
            data[(data & 0x7F) == 0x7F] = 0  # no e4m3 NaN codes
            w.write_rows(data)
        w.commit()
    return rows


def timed(fn, reps: int = 20) -> float:
    """Median seconds of fn() with the GPU synchronised around each call."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    res: dict = {"device": torch.cuda.get_device_name(), "gib": args.gib}
    with tempfile.TemporaryDirectory(dir=".") as d:
        t0 = time.perf_counter()
        rows = build(d, args.gib)
        res["build_s"] = time.perf_counter() - t0
        rng = np.random.default_rng(1)
        n_big = 65536
        big = rng.integers(0, rows, (n_big // 16, 16))
        rb = 90
        host = torch.empty(n_big * rb, dtype=torch.uint8).pin_memory()
        dev = torch.empty_like(host, device="cuda")
        res["h2d_floor_s"] = timed(lambda: dev.copy_(host, non_blocking=True))
        for tier in ("device", "pinned"):
            t0 = time.perf_counter()
            t = plestore.open_table(d, tier=tier)
            res[f"{tier}_open_s"] = time.perf_counter() - t0
            modes = ["gpu", "cpu"] if tier == "pinned" else ["-"]
            for mode in modes:
                if mode != "-":
                    t.options = t.options.replace(gather=mode)
                ids_t = torch.as_tensor(big).cuda()
                res[f"{tier}_{mode}_65536_s"] = timed(lambda ids=big, t=t: t.lookup(ids))
                res[f"{tier}_{mode}_65536_dev_ids_s"] = timed(lambda ids=ids_t, t=t: t.lookup(ids))
                for b in (1, 8, 64):
                    ids = rng.integers(0, rows, (b, 16))
                    res[f"{tier}_{mode}_decode_b{b}_s"] = timed(lambda ids=ids, t=t: t.lookup(ids))
            res[f"{tier}_stats"] = t.stats()["phases"]
            t.close()
    res["ratio_pinned_cpu_vs_floor"] = res["pinned_cpu_65536_s"] / res["h2d_floor_s"]
    res["ratio_pinned_gpu_vs_floor"] = res["pinned_gpu_65536_s"] / res["h2d_floor_s"]
    text = json.dumps(res, indent=1, default=str)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    for k, v in res.items():
        if isinstance(v, float):
            print(f"{k:40s} {v * 1e3 if k.endswith('_s') else v:10.3f}")


if __name__ == "__main__":
    main()
