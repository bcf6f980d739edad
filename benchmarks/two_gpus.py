"""The two-GPU runs (`nvidia-h200-x2`; NCCL with NVLink multicast off), one process per GPU:

    python3 benchmarks/two_gpus.py QWEN_TABLE ENGRAM_TABLE OUT_DIR [--batches 1,8,64] [--reps 3]

tp2     `bench e2e` in both ranks: the resident table, mapped and direct beside their rows-sharded
        variants (`TIER:shard=rows`: each rank reads its half; the decode step's all-reduce
        inside its CUDA graph), warm and cold; tokens against the resident table's
                                                                    -> OUT_DIR/tp2-e2e.json
engram  the Engram table head-sharded over both GPUs (gathered, and each rank's columns), every
        tier: rows bit-identical to one GPU's lookup                -> OUT_DIR/engram-heads.json
dp2     two replicas, one per GPU, on the pinned tier with share="node" against private copies:
        the table's host memory (PSS) and lookup time (`bench shared --device cuda:each`)
                                                                    -> OUT_DIR/dp2-shared.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys

import numpy as np
import torch

TIERS = ["device", "pinned", "mapped", "direct"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, port: int) -> torch.device:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    return torch.device("cuda", rank)


def _tp2(rank: int, port: int, a: argparse.Namespace) -> None:
    import torch.distributed as dist

    from plestore.bench.e2e import run_e2e

    device = _init(rank, port)
    tiers = ["mapped", "mapped:shard=rows", "direct", "direct:shard=rows"]
    batches = [int(b) for b in a.batches.split(",")]
    log = print if rank == 0 else (lambda m: None)
    rows = run_e2e(a.qwen, tiers, batches, device, reps=a.reps, log=log)
    if rank == 0:
        out = [dataclasses.asdict(r) for r in rows]
        with open(os.path.join(a.out, "tp2-e2e.json"), "w") as f:
            json.dump(out, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def _engram(rank: int, port: int, a: argparse.Namespace) -> None:
    import torch.distributed as dist

    import plestore
    from plestore.distributed import open_sharded

    device = _init(rank, port)
    result = {}
    with plestore.open_table(a.engram, tier="device", device=str(device)) as one:
        spec = one.spec
        rng = np.random.default_rng(5)  # the same ids on both ranks
        offs, sizes = spec.hash.head_offsets, spec.hash.head_sizes
        batches = [
            np.stack([rng.integers(o, o + s, n) for o, s in zip(offs, sizes, strict=True)], 1)
            for n in (1, 64, 4096)
        ]
        want = [one.lookup(ids).view(torch.int16).cpu() for ids in batches]
    for tier in TIERS:
        for gather in (True, False):
            with open_sharded(a.engram, "heads", tier=tier, gather=gather, device=str(device)) as t:
                cols = slice(*(c * spec.dim for c in t.plan.columns)) if not gather else slice(None)
                same = [
                    torch.equal(t.lookup(ids).view(torch.int16).cpu(), w[:, cols])
                    for ids, w in zip(batches, want, strict=True)
                ]
            result[f"{tier}, {'gathered' if gather else 'own columns'}"] = all(same)
    if rank == 0:
        out = {"table": spec.name, "rows": spec.rows, "heads": spec.heads, "exact": result}
        with open(os.path.join(a.out, "engram-heads.json"), "w") as f:
            json.dump(out, f, indent=1)
        print("engram heads, bit-identical to one GPU:", result)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("qwen", help="a packed Qwen4Exp table (the e2e table)")
    ap.add_argument("engram", help="a packed Engram table")
    ap.add_argument("out", help="where the JSON files go")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runs", default="tp2,engram,dp2")
    a = ap.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("two GPUs needed (nvidia-h200-x2)")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the GPU machine's notes (spawned ranks too)
    import torch.multiprocessing as mp

    runs = a.runs.split(",")
    for name, fn in (("tp2", _tp2), ("engram", _engram)):
        if name in runs:
            mp.spawn(fn, (_free_port(), a), nprocs=2, join=True)
    if "dp2" in runs:
        from plestore.bench.shared import bench

        res = bench(a.qwen, "pinned", "cuda:each", 2, 64, 300, 2)
        with open(os.path.join(a.out, "dp2-shared.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(
            f"dp2: copies private {res['private']['copies']:.2f}, shared "
            f"{res['shared']['copies']:.2f}; lookup private/shared {res['lookup_ratio']:.3f}; "
            f"rows exact {res['rows_exact']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
