"""Packed or decoded rows in the GPU row cache: what a hit costs and what a GiB holds.

A hit served from packed rows (the tier's bytes: `gather_decode` over the cache, the kernel every
lookup runs) against one served from rows kept decoded (bf16: a plain gather of 320-B rows),
side by side, 128 / 16,384 / 65,536 random hits among the 3,355,443 NVFP4 rows a decoded GiB
holds (0.3 GiB packed; medians, µs, CUDA events around each call, the two interleaved; the
hits checked bit-identical); beside them, the rows each kind holds per
GiB and, from `benchmarks/hitrate.json` (`plestore bench hitrate`, the real hash on English),
the hit rates a cache of that many bytes gets with each kind (decoded: the packed cache of the
same row count).

    python benchmarks/probes/cache_rows.py [--device cuda] [--reps 50] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from plestore.formats import get_format
from plestore.kernels.gather_decode import gather_decode

DIM, GIB = 160, 1 << 30
HITRATE = Path(__file__).resolve().parents[1] / "hitrate.json"


def _timer(device: torch.device):
    """fn -> seconds of one call (CUDA events on a GPU, wall time on the CPU)."""

    def run(fn) -> float:
        if device.type != "cuda":
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3

    return run


def hits(device: torch.device, reps: int) -> dict:
    fmt = get_format("nvfp4")
    rb = fmt.row_bytes(DIM)
    stride = -(-rb // 16) * 16  # as the pinned tier stages them
    n_packed = GIB // stride
    n_decoded = GIB // (DIM * 2)
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, (n_decoded, rb), dtype=np.uint8)  # (both hold these rows)
    packed = torch.zeros((n_decoded, stride), dtype=torch.uint8, device=device)
    packed[:, :rb] = torch.from_numpy(codes).to(device)
    decoded = torch.empty((n_decoded, DIM), dtype=torch.bfloat16, device=device)
    every = torch.arange(n_decoded, device=device)
    for a in range(0, n_decoded, 1 << 20):  # decoded once, by the same kernel
        idx = every[a : a + (1 << 20)]
        gather_decode(packed, idx, 0, n_decoded, fmt, DIM, 1.0, decoded[a : a + idx.numel()])
    run = _timer(device)
    res: dict = {"rows_per_gib": {"packed": n_packed, "decoded": n_decoded}}
    for n in (128, 16384, 65536):
        ids = torch.from_numpy(rng.integers(0, n_decoded, n)).to(device)
        out = torch.empty((n, DIM), dtype=torch.bfloat16, device=device)
        want = torch.empty_like(out)
        fns = {
            "packed": lambda ids=ids, out=out: gather_decode(
                packed, ids, 0, n_decoded, fmt, DIM, 1.0, out
            ),
            "decoded": lambda ids=ids, want=want: torch.index_select(decoded, 0, ids, out=want),
        }
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(reps):
            for k, fn in fns.items():
                times[k].append(run(fn))
        if not torch.equal(out.view(torch.int16), want.view(torch.int16)):
            raise SystemExit("packed and decoded hits differ")
        res[f"hits_{n}_us"] = {k: round(float(np.median(v)) * 1e6, 1) for k, v in times.items()}
    return res


def hit_rates(rows_per_gib: dict) -> dict:
    """English, static + dynamic: the hit rate of a packed cache of each size, and of a decoded
    cache of the same bytes (interpolated at the packed size holding as many rows)."""
    rows = [
        r for r in json.loads(HITRATE.read_text()) if r["stream"] == "en" and r["mode"] == "both"
    ]
    out = {}
    ratio = rows_per_gib["decoded"] / rows_per_gib["packed"]
    for phase in ("prefill", "decode"):
        pts = sorted((r["cache_gib"], r["hit_rate"]) for r in rows if r["phase"] == phase)
        gib, rate = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
        for size in (0.25, 1.0, 4.0):
            packed = float(np.interp(np.log2(size), np.log2(gib), rate))
            decoded = float(np.interp(np.log2(size * ratio), np.log2(gib), rate))
            out[f"en_{phase}_{size:g}GiB"] = {
                "packed": round(packed, 3),
                "decoded": round(decoded, 3),
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    res = hits(torch.device(args.device), args.reps)
    res["hit_rates"] = hit_rates(res["rows_per_gib"])
    print(json.dumps(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
