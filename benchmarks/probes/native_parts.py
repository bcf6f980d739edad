"""The host path part by part, the pure-Python path and the native core side by side in one
process (medians, ms): id validation; the raw gather of random rows (torch index_select, the
pinned tier's Python path, vs the core's pooled gather); each host tier's read() warm at 16 /
1,024 / 16,384 / 65,536 rows; the direct tier's cold 16-row read (cache dropped, O_DIRECT); and
decode-sized lookup() on every tier. TABLE: a packed table, or a directory to write one of
random row bytes in (--rows; reused on later runs).

    python benchmarks/probes/native_parts.py TABLE [--rows 4000000] [--json OUT]
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
from plestore.tablefile import TableFile, TableWriter

SIZES = (16, 1024, 16384, 65536)
MODES = ("off", "on")  # TableOptions.native: the pure-Python host path, the native core


def _table(path: Path, rows: int) -> Path:
    """The table at path, or a new nvfp4 one there (dim 160: 90-B rows, 512-B blocks) of random
    bytes."""
    try:
        TableFile.open(path)
        return path
    except (OSError, ValueError):
        pass
    spec = TableSpec(name="t", rows=rows, dim=160, format="nvfp4", scale=1.0, heads=16)
    rng = np.random.default_rng(0)
    with TableWriter(path, spec, RowLayout(spec.row_bytes, block_bytes=512)) as w:
        for a in range(0, rows, 1 << 20):
            w.write_rows(rng.integers(0, 256, (min(1 << 20, rows - a), spec.row_bytes), np.uint8))
        w.commit()
    return path


def _ms(fns: dict, args: list, reps: int) -> dict:
    """Median ms of each fn over args in turn, the variants interleaved call by call (a busy
    machine's drift lands on both alike); one untimed call each first."""
    for fn in fns.values():
        fn(args[0])
    ts: dict = {k: [] for k in fns}
    for i in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn(args[i % len(args)])
            ts[k].append(time.perf_counter() - t0)
    return {k: round(float(np.median(v)) * 1e3, 4) for k, v in ts.items()}


def _id_sets(rows: int, n: int, k: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng(n)
    return [rng.integers(0, rows, n) for _ in range(k)]


def raw_gather(rows: int, reps: int) -> dict:
    """Random 96-B rows of a [rows, 96] array: torch.index_select (the pinned tier's Python
    path) vs the core's gather on one thread and on one per core."""
    core = native.load("on")
    src = np.random.default_rng(0).integers(0, 256, (rows, 96), np.uint8)
    src_t = torch.from_numpy(src)
    threads = native.memory_threads(64)
    res = {"threads": threads, "torch_threads": torch.get_num_threads(), "mib": src.nbytes >> 20}
    for n in SIZES:
        out = np.empty((n, 96), np.uint8)
        out_t = torch.from_numpy(out)
        fns = {
            "torch": lambda ids, o=out_t: torch.index_select(src_t, 0, torch.from_numpy(ids), out=o)
        }
        for th in sorted({1, threads}):
            fns[f"native_t{th}"] = lambda ids, th=th, o=out: core.gather(
                src, ids, o, 96, 96, 0, 1, 96, 96, th
            )
        res[n] = _ms(fns, _id_sets(rows, n, 8), reps)
    return res


def _cold_read(t, rng, prefetch: bool) -> float:
    """One cold 16-row read (cache dropped): started at prefetch 2 ms before, or not."""
    t.drop_caches()
    ids = rng.integers(0, t.spec.rows, 16)
    out = np.empty((16, t.tier.staging_stride), np.uint8)
    if prefetch:
        t.tier.prefetch(ids)
        time.sleep(0.002)  # (the caller's layers before the PLE layer)
    t0 = time.perf_counter()
    t.tier.read(ids, out)
    return time.perf_counter() - t0


def tier_parts(path: Path, tier: str, reps: int) -> dict:
    """Each part, the Python path (off) and the native core (on) interleaved."""
    tables = {m: plestore.open_table(path, tier=tier, device="cpu", native=m) for m in MODES}
    res: dict = {}
    try:
        rows = tables["off"].spec.rows
        outs = {
            m: np.empty((max(SIZES), t.tier.staging_stride), np.uint8) for m, t in tables.items()
        }
        for n in SIZES:
            sets = _id_sets(rows, n)
            if tier == "direct":  # warm: the rows in the cache
                for m, t in tables.items():
                    for ids in sets:
                        t.tier.read(ids, outs[m])
            fns = {m: (lambda ids, t=t, o=outs[m]: t.tier.read(ids, o)) for m, t in tables.items()}
            res[f"read_{n}"] = _ms(fns, sets, reps)
        for n in (16, 1024, 65536):
            sets = [s.reshape(-1, 16) for s in _id_sets(rows, n)]
            res[f"validate_{n}"] = _ms({m: t._validate for m, t in tables.items()}, sets, reps)
        for n in (16, 128):  # decode-sized lookup() (CPU decode included)
            sets = [s.reshape(-1, 16) for s in _id_sets(rows, n)]
            res[f"lookup_{n}"] = _ms({m: t.lookup for m, t in tables.items()}, sets, reps)
        if tier == "direct":  # cold 16-row reads: the cache dropped, O_DIRECT blocks
            for prefetch in (False, True):
                rng = np.random.default_rng(7)
                ts: dict = {m: [] for m in MODES}
                for _ in range(reps):
                    for m, t in tables.items():
                        ts[m].append(_cold_read(t, rng, prefetch))
                key = "cold_after_prefetch_16" if prefetch else "cold_read_16"
                res[key] = {m: round(float(np.median(v)) * 1e3, 4) for m, v in ts.items()}
    finally:
        for t in tables.values():
            t.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", help="a packed table, or a directory to write one in")
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tiers", default="pinned,mapped,direct")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    path = _table(Path(args.table), args.rows)
    rows = TableFile.open(path).spec.rows
    result = {"cpus": len(os.sched_getaffinity(0)), "rows": rows, "load": os.getloadavg()}
    result["raw_gather"] = raw_gather(min(rows, 48_000_000), args.reps)
    print(json.dumps({"raw_gather": result["raw_gather"]}), flush=True)
    for tier in args.tiers.split(","):
        result[tier] = tier_parts(path, tier, args.reps)
        print(json.dumps({tier: result[tier]}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
