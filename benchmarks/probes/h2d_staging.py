"""The copy of a 65,536-row staging to the GPU in the states a host lookup leaves it: written
long ago, just filled by one thread, just gathered into by the pinned tier's native gather (as
a lookup does: non-temporal stores) and by the same gather with plain stores (`_cached`: the
rows left dirty in the gathering threads' caches), into staging registered with other flags
and into torch's own pinned memory (cudaHostAlloc); then the gather and its copy in 1 / 4 / 8
pieces, each piece's copy queued as soon as it is gathered, with either stores. Medians, µs:
`gpu` the copy on the GPU (CUDA events), `call` the host's time in the copy call, `prep` the
fill or gather before it, `total` (pieces) gather + copies to the last copy's end; `lookup`:
the table's 65,536-row lookup, its copy queued a chunk at a time as one pooled gather passes it
(`pooled`, the tier's start_read) or after a gather of all (`one_gather`), synchronised.
For #21: inside a 65,536-row pinned lookup the staged copy ran 510 µs, alone 129
(`lookup_timeline.py`, RESULTS.md "host time, part by part").

    python benchmarks/probes/h2d_staging.py TABLE [--reps 30] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from sync_paths import random_table  # (a probe beside this one)

import plestore
from plestore.io.memory import HostBuffer
from plestore.tiers.base import Reading

N = 65536
FLAGS = {"flags0": 0, "portable": 1, "mapped": 2}  # cudaHostRegister flags


def _registered(nbytes: int, flags: int) -> HostBuffer:
    buf = HostBuffer(nbytes, pin=False, hugepages=False)
    err = torch.cuda.cudart().cudaHostRegister(buf.address, nbytes, flags)
    if int(getattr(err, "value", err)) != 0:
        raise RuntimeError(f"cudaHostRegister(flags={flags}) failed: {err}")
    buf.pinned = True  # (close() unregisters it)
    return buf


def _one_gather(tier):
    return lambda rows, out: Reading(tier, rows, out, chunk=len(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", help="a packed table, or a directory to write one in")
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    path = random_table(Path(args.table), args.rows)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    result: dict = {"rows": N}
    with plestore.open_table(path, tier="pinned", device="cuda") as t:
        tier = t.tier
        rb = tier.staging_stride
        ids = np.random.default_rng(9).integers(0, t.spec.rows, N)
        raw = torch.empty((N, rb), dtype=torch.uint8, device="cuda")
        bufs = {name: _registered(N * rb, f) for name, f in FLAGS.items()}
        bufs["idle"] = _registered(N * rb, 0)
        bufs["idle"].array.fill(1)  # written once, never again: its lines long out of the caches
        torch_pinned = torch.empty((N, rb), dtype=torch.uint8, pin_memory=True)

        def staging(name: str) -> np.ndarray:
            return bufs[name].array.reshape(N, rb)

        states = {  # name -> (staging [N, rb], what is done to it just before its copy)
            "idle": (staging("idle"), None),
            "after_fill": (staging("flags0"), "fill"),
            "after_gather": (staging("flags0"), "gather"),
            "after_gather_cached": (staging("flags0"), "gather_cached"),
            "after_gather_portable": (staging("portable"), "gather"),
            "after_gather_mapped": (staging("mapped"), "gather"),
            "after_gather_torch_pinned": (torch_pinned.numpy(), "gather"),
        }
        times = {k: {"gpu": [], "call": [], "prep": []} for k in states}
        pieces = {f"{p}{s}": [] for p in (1, 4, 8) for s in ("", "_cached")}
        try:
            for _ in range(args.reps):
                for name, (rows, prep) in states.items():
                    t0 = time.perf_counter()
                    if prep == "fill":
                        rows.fill(1)
                    elif prep is not None:  # as a lookup gathers: every thread
                        tier.stream_stores = prep == "gather"
                        tier.read(ids, rows)
                    times[name]["prep"].append(time.perf_counter() - t0)
                    src = torch.from_numpy(rows)
                    torch.cuda.synchronize()
                    ev[0].record()
                    t0 = time.perf_counter()
                    raw.copy_(src, non_blocking=True)
                    times[name]["call"].append(time.perf_counter() - t0)
                    ev[1].record()
                    ev[1].synchronize()
                    times[name]["gpu"].append(ev[0].elapsed_time(ev[1]) * 1e-3)
                rows = staging("flags0")
                src = torch.from_numpy(rows)
                for p in pieces:  # gather a piece, queue its copy, gather the next
                    tier.stream_stores = not p.endswith("_cached")
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    step = -(-N // int(p.split("_")[0]))
                    for a in range(0, N, step):
                        tier.read(ids[a : a + step], rows[a : a + step])
                        raw[a : a + step].copy_(src[a : a + step], non_blocking=True)
                    torch.cuda.synchronize()
                    pieces[p].append(time.perf_counter() - t0)
            pooled = tier.start_read
            lookups = {"pooled": [], "one_gather": []}
            for _ in range(args.reps):
                for name in lookups:
                    tier.stream_stores = True
                    tier.start_read = pooled if name == "pooled" else _one_gather(tier)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    t.lookup(ids[:, None])
                    torch.cuda.synchronize()
                    lookups[name].append(time.perf_counter() - t0)
            tier.start_read = pooled
        finally:
            for b in bufs.values():
                b.close()

        def us(v: list) -> float:
            return round(float(np.median(v)) * 1e6, 1)

        result["states"] = {k: {m: us(v) for m, v in d.items()} for k, d in times.items()}
        result["pieces_total"] = {p: us(v) for p, v in pieces.items()}
        result["lookup"] = {k: us(v) for k, v in lookups.items()}
        result["pcie_floor_us"] = round(N * t.spec.row_bytes / 55.2e9 * 1e6, 1)
    print(json.dumps(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
