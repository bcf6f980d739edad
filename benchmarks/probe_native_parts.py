"""The host path part by part, the pure-Python path and the native core side by side in one
process (medians, ms): id validation; the raw gather of random rows (torch index_select, the
pinned tier's Python path, vs the core's pooled gather); each host tier's read() warm at 16 /
1,024 / 16,384 / 65,536 rows; the direct tier's cold 16-row read (cache dropped, O_DIRECT); and
decode-sized lookup() on every tier. Writes the table it needs (random row bytes) once.

    python benchmarks/probe_native_parts.py WORKDIR [--rows 4000000] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

import plestore
from plestore import native
from plestore.spec import RowLayout, TableSpec
from plestore.tablefile import TableWriter

SIZES = (16, 1024, 16384, 65536)


def _table(work: Path, rows: int) -> Path:
    """An nvfp4 table (dim 160: 90-B rows) in 512-B blocks, of random bytes."""
    path = work / f"native-parts-{rows}"
    if (path / "t.json").exists():
        return path
    spec = TableSpec(name="t", rows=rows, dim=160, format="nvfp4", scale=1.0, heads=16)
    rng = np.random.default_rng(0)
    with TableWriter(path, spec, RowLayout(spec.row_bytes, block_bytes=512)) as w:
        for a in range(0, rows, 1 << 20):
            w.write_rows(rng.integers(0, 256, (min(1 << 20, rows - a), spec.row_bytes), np.uint8))
        w.commit()
    return path


def _ms(fn, args: list, reps: int) -> float:
    fn(args[0])
    ts = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(args[i % len(args)])
        ts.append(time.perf_counter() - t0)
    return round(float(np.median(ts)) * 1e3, 4)


def _id_sets(rows: int, n: int, k: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng(n)
    return [rng.integers(0, rows, n) for _ in range(k)]


def raw_gather(rows: int, reps: int) -> dict:
    """65,536 / 16,384 random 96-B rows of a [rows, 96] array: torch.index_select vs the core."""
    core = native.load("on")
    src = np.random.default_rng(0).integers(0, 256, (rows, 96), np.uint8)
    src_t = torch.from_numpy(src)
    threads = native.memory_threads(64)
    res = {"threads": threads, "torch_threads": torch.get_num_threads(), "mib": src.nbytes >> 20}
    for n in SIZES:
        sets = _id_sets(rows, n)
        out = np.empty((n, 96), np.uint8)
        out_t = torch.from_numpy(out)
        res[f"torch_{n}"] = _ms(
            lambda ids: torch.index_select(src_t, 0, torch.from_numpy(ids), out=out_t), sets, reps
        )
        for th in sorted({1, threads}):
            res[f"native_t{th}_{n}"] = _ms(
                lambda ids, th=th: core.gather(src, ids, out, 96, 96, 0, 1, 96, 96, th), sets, reps
            )
    return res


def tier_reads(path: Path, tier: str, mode: str, reps: int) -> dict:
    res = {}
    with plestore.open_table(path, tier=tier, device="cpu", native=mode) as t:
        rows = t.spec.rows
        out = np.empty((max(SIZES), t.tier.staging_stride), np.uint8)
        for n in SIZES:
            sets = _id_sets(rows, n)
            if tier == "direct":  # warm: the rows in the cache
                for ids in sets:
                    t.tier.read(ids, out)
            res[f"read_{n}"] = _ms(lambda ids: t.tier.read(ids, out), sets, reps)
        for n in (16, 1024, 65536):
            sets = [s.reshape(-1, 16) for s in _id_sets(rows, n)]
            res[f"validate_{n}"] = _ms(lambda ids: t._validate(ids), sets, reps)
        for n in (16, 128, 1024):  # decode-sized lookup() (CPU decode included)
            sets = [s.reshape(-1, 16) for s in _id_sets(rows, n)]
            if tier == "direct":
                for ids in sets:
                    t.lookup(ids)
            res[f"lookup_{n}"] = _ms(lambda ids: t.lookup(ids), sets, reps)
        if tier == "direct":  # cold 16-row reads: the cache dropped, O_DIRECT blocks
            cold = []
            rng = np.random.default_rng(7)
            for _ in range(reps):
                t.drop_caches()
                ids = rng.integers(0, rows, 16)
                t0 = time.perf_counter()
                t.tier.read(ids, out)
                cold.append(time.perf_counter() - t0)
            res["cold_read_16"] = round(float(np.median(cold)) * 1e3, 4)
            cold = []
            for _ in range(reps):  # reads started at prefetch, collected by the read
                t.drop_caches()
                ids = rng.integers(0, rows, 16)
                t.tier.prefetch(ids)
                time.sleep(0.002)  # (the caller's layers before the PLE layer)
                t0 = time.perf_counter()
                t.tier.read(ids, out)
                cold.append(time.perf_counter() - t0)
            res["cold_after_prefetch_16"] = round(float(np.median(cold)) * 1e3, 4)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir")
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tiers", default="pinned,mapped,direct")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    path = _table(work, args.rows)
    result = {"cpus": len(os.sched_getaffinity(0)), "rows": args.rows}
    result["raw_gather"] = raw_gather(args.rows, args.reps)
    print(json.dumps({"raw_gather": result["raw_gather"]}), flush=True)
    for tier in args.tiers.split(","):
        for mode in ("off", "on"):
            r = tier_reads(path, tier, mode, args.reps)
            result[f"{tier}_{'native' if mode == 'on' else 'python'}"] = r
            print(json.dumps({f"{tier}/{mode}": r}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
