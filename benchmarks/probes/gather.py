"""Probe the warm gather paths on a GPU machine: pinned (cpu gather + H2D vs GPU reading pinned
memory), device, against the H2D floor measured in the same run. Used to set
`GPU_GATHER_MAX_IDS` (plestore/lookup/table.py); the full comparison lives in `plestore bench`.

    python benchmarks/probes/gather.py --gib 4 --json out.json
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


def breakdown(gib: float) -> dict:
    """The host path's parts, each timed alone: gather into pinned staging (by method and
    thread count), H2D of the gathered rows, and the decode kernel."""
    from concurrent.futures import ThreadPoolExecutor

    from plestore.formats import get_format
    from plestore.io.memory import HostBuffer
    from plestore.kernels.gather_decode import gather_decode

    out: dict = {}
    rows, stride, rb, n = int(gib * 2**30) // 96, 96, 90, 65536
    table = HostBuffer(rows * stride, pin=True)
    table.array[:] = 1
    items = np.ndarray((rows,), np.dtype((np.void, rb)), buffer=table.array, strides=(stride,))
    idx = np.random.default_rng(2).integers(0, rows, n)
    staging = HostBuffer(n * rb, pin=True)
    dst = staging.array.view(np.dtype((np.void, rb)))
    for threads in (1, 8, 16, 32):
        pool = ThreadPoolExecutor(threads)
        parts = np.array_split(np.arange(n), threads)

        def gather(p):
            dst[p[0] : p[-1] + 1] = items[idx[p[0] : p[-1] + 1]]

        out[f"np_gather_{threads}thr_s"] = timed(lambda p=pool, q=parts: list(p.map(gather, q)))
        pool.shutdown()
    tt = table.tensor.view(rows, stride)
    ti = torch.from_numpy(idx)
    for threads in (8, 16):
        torch.set_num_threads(threads)
        out[f"torch_index_select_{threads}thr_s"] = timed(lambda: torch.index_select(tt, 0, ti))
    raw = torch.empty((n, rb), dtype=torch.uint8, device="cuda")
    src = staging.tensor[: n * rb].view(n, rb)
    out["h2d_65536_rows_s"] = timed(lambda: raw.copy_(src, non_blocking=True))
    fmt = get_format("nvfp4")
    inv = torch.arange(n, device="cuda")
    o = torch.empty((n, 160), dtype=torch.bfloat16, device="cuda")
    out["decode_kernel_65536_s"] = timed(lambda: gather_decode(raw, inv, 0, n, fmt, 160, 1.0, o))
    ids = torch.from_numpy(idx).cuda()
    out["uva_gather_decode_65536_s"] = timed(
        lambda: gather_decode(tt, ids, 0, rows, fmt, 160, 1.0, o)
    )
    staging.close()
    table.close()
    return out


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
            modes = ["gpu", "cpu", "cpu-inline"] if tier == "pinned" else ["-"]
            for mode in modes:
                if mode != "-":  # cpu-inline: the host path in the caller's thread, no worker
                    inline = 1 << 20 if mode == "cpu-inline" else 4096
                    t.options = t.options.replace(gather=mode[:3], inline_ids=inline)
                ids_t = torch.as_tensor(big).cuda()
                res[f"{tier}_{mode}_65536_s"] = timed(lambda ids=big, t=t: t.lookup(ids))
                res[f"{tier}_{mode}_65536_dev_ids_s"] = timed(lambda ids=ids_t, t=t: t.lookup(ids))
                for b in (1, 8, 64, 256, 1024, 2048):  # 16 to 32,768 ids: where paths cross
                    ids = rng.integers(0, rows, (b, 16))
                    res[f"{tier}_{mode}_decode_b{b}_s"] = timed(lambda ids=ids, t=t: t.lookup(ids))
            res[f"{tier}_stats"] = t.stats()["phases"]
            if tier == "pinned":  # the tier's host gather alone: caller's thread vs a worker's
                from concurrent.futures import ThreadPoolExecutor

                flat = big.reshape(-1)
                buf = np.empty((flat.size, t.tier.staging_stride), np.uint8)
                res["pinned_tier_read_main_s"] = timed(lambda r=t.tier.read, f=flat, b=buf: r(f, b))
                with ThreadPoolExecutor(1) as pool:
                    res["pinned_tier_read_worker_s"] = timed(
                        lambda r=t.tier.read, f=flat, b=buf: pool.submit(r, f, b).result()
                    )
            t.close()
    res.update(breakdown(args.gib))
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
