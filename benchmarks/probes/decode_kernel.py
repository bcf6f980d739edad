"""The gather+decode kernel's launch shape: output values per program (`_BLOCK`) and warps
(`_WARPS`), the rows laid end to end, one lane per value. (The layout it replaced, a program per
8 rows with nibbles and block scales spread in registers, was timed beside these by this probe
at `6849d87`: RESULTS.md "lookup: the decode kernel".) Every variant's output is checked
bit-identical to the torch reference first. Medians, µs: `gpu` the kernel alone (queued behind
a sleeping kernel, so the host's launch is not in it), `launch` the host's time in gather_decode
(no sync); beside them the HBM floor of the bytes the kernel moves.

    python benchmarks/probes/decode_kernel.py [--reps 50] [--json OUT]

Sources: `staged` (rows in order, as a host lookup stages them), `table` (random rows of a
4,000,000-row table in device memory, as the device tier and the GPU row cache read them),
`pinned` (the same in registered host memory, read through UVA: the pinned tier's GPU read).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

import plestore.kernels.gather_decode as gd
from plestore.formats import get_format
from plestore.io.memory import HostBuffer

DIM, TABLE_ROWS, HBM_BYTES_PER_S = 160, 4_000_000, 4.8e12
VARIANTS = {  # name -> (values per program, warps)
    "flat1024-w4": (1024, 4),
    "flat2048-w4": (2048, 4),
    "flat2048-w8": (2048, 8),
    "flat4096-w8": (4096, 8),
}


def use(variant: str) -> None:
    gd._BLOCK, gd._WARPS = VARIANTS[variant]


def time_variants(call, reps: int) -> dict:
    """{variant: {gpu, launch}} medians in µs, the variants interleaved call by call."""
    gpu = {v: [] for v in VARIANTS}
    host = {v: [] for v in VARIANTS}
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    for _ in range(reps):
        for v in VARIANTS:
            use(v)
            torch.cuda.synchronize()
            torch.cuda._sleep(200_000)  # the GPU busy while the host queues the kernel
            ev[0].record()
            t0 = time.perf_counter()
            call()
            host[v].append(time.perf_counter() - t0)
            ev[1].record()
            ev[1].synchronize()
            gpu[v].append(ev[0].elapsed_time(ev[1]) * 1e-3)
    return {
        v: {"gpu": round(np.median(gpu[v]) * 1e6, 1), "launch": round(np.median(host[v]) * 1e6, 1)}
        for v in VARIANTS
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rng = np.random.default_rng(0)
    results = []
    for name in ("nvfp4", "fp8_e4m3"):
        fmt = get_format(name)
        rb = fmt.row_bytes(DIM)
        stride = -(-rb // 16) * 16  # the pinned tier's and the GPU row cache's stride
        scale = 0.0123 if fmt.has_table_scale else 1.0
        table = torch.randint(0, 256, (TABLE_ROWS, stride), dtype=torch.uint8, device=dev)
        if name != "nvfp4":  # no e4m3 NaN codes (0x7f, 0xff): their payloads may differ
            table[(table & 0x7F) == 0x7F] = 0x11
        else:
            scales = table[:, DIM // 2 : rb]
            scales[(scales & 0x7F) == 0x7F] = 0x11
        host = HostBuffer(TABLE_ROWS * stride, pin=True)
        pinned = host.tensor.view(TABLE_ROWS, stride)
        pinned.copy_(table)
        try:
            for n in (16, 1024, 16384, 65536):
                ids = torch.from_numpy(rng.integers(0, TABLE_ROWS, n)).to(dev)
                sources = {
                    "staged": (table[:n], torch.arange(n, device=dev)),
                    "table": (table, ids),
                    "pinned": (pinned, ids),
                }
                for source, (src, index) in sources.items():
                    if source == "pinned" and n > 16384:
                        continue  # (the pinned tier gathers large lookups on the host)
                    rows = src.shape[0]
                    want = torch.empty((n, DIM), dtype=fmt.torch_dtype, device=dev)
                    gd.gather_decode_reference(src, index, 0, rows, fmt, DIM, scale, want)
                    out = torch.empty_like(want)
                    exact = {}
                    for v in VARIANTS:
                        use(v)
                        out.fill_(7)
                        gd.gather_decode(src, index, 0, rows, fmt, DIM, scale, out)
                        exact[v] = bool(torch.equal(out.view(torch.int16), want.view(torch.int16)))

                    def call(src=src, index=index, rows=rows, out=out, fmt=fmt, scale=scale):
                        gd.gather_decode(src, index, 0, rows, fmt, DIM, scale, out)

                    moved = n * (rb + 8 + DIM * 2)  # rows + index read, bf16 written
                    row = {"format": name, "source": source, "rows": n, "exact": exact}
                    row["hbm_floor_us"] = round(moved / HBM_BYTES_PER_S * 1e6, 2)
                    row.update(time_variants(call, args.reps))
                    print(json.dumps(row), flush=True)
                    results.append(row)
        finally:
            del pinned
            host.close()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
