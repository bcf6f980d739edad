"""Where a warm host lookup's time goes, stamped on the host's clock without a profiler: the
call's start, its ids checked, its output made, the host path entered, its staging ready, the
read begun, each chunk ready, its copies queued, the decode queued, the read done, the host
path left, the call returned and the GPU done (the median µs of each stamp from the call's
start over `--reps` calls, tiers interleaved; each stamp a wrapper of ~1 µs). The gaps say what
a lookup pays beside its read: for #21, a 65,536-row pinned lookup took ~190 µs more than its
read alone.

    python benchmarks/probes/host_stamps.py TABLE [--tiers pinned,mapped,direct]
        [--rows 65536] [--reps 40] [--json OUT]

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

import plestore
from plestore import native
from plestore.lookup.hostpath import HostPath, Staging
from plestore.lookup.table import Table
from plestore.tiers.base import PooledReading, Reading

_stamps: list[tuple[str, float]] = []


def _stamped(owner: object, name: str, before: str | None, after: str | None) -> None:
    """owner.name wrapped: a stamp `before` it runs and `after` it returns."""
    fn = getattr(owner, name)

    def wrapper(*a, **kw):
        if before:
            _stamps.append((before, time.perf_counter()))
        try:
            return fn(*a, **kw)
        finally:
            if after:
                _stamps.append((after, time.perf_counter()))

    setattr(owner, name, wrapper)


def _instrument(tables: dict) -> None:
    _stamped(Table, "_validate", None, "ids checked")
    _stamped(Table, "_output", None, "output made")
    _stamped(HostPath, "steps", "host path", "host path left")
    _stamped(Staging, "ensure", None, "staging ready")
    if native.available():
        _stamped(native._core, "gather_start", "gather start", None)
    _stamped(HostPath, "_decode", "decode", "decode queued")
    for cls in (Reading, PooledReading):
        _stamped(cls, "ready", None, "chunk ready")
        _stamped(cls, "done", None, "read done")
        _stamped(cls, "copy_to", "copies", "copies queued")
    for t in tables.values():
        _stamped(t.tier, "start_read", None, "read begun")
        _stamped(t.tier, "read", "read", "read returned")


def _one(t: plestore.Table, ids: np.ndarray, cuda: bool) -> list[tuple[str, float]]:
    if cuda:
        torch.cuda.synchronize()
    _stamps.clear()
    t0 = time.perf_counter()
    t.lookup(ids)
    _stamps.append(("returned", time.perf_counter()))
    if cuda:
        torch.cuda.synchronize()
        _stamps.append(("GPU done", time.perf_counter()))
    seen: dict = {}  # a repeated stamp numbered: chunk ready 1, 2, ...
    out = []
    for name, ts in _stamps:
        seen[name] = seen.get(name, 0) + 1
        out.append((f"{name} {seen[name]}" if seen[name] > 1 else name, (ts - t0) * 1e6))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", help="a packed table, or a directory to write one in")
    ap.add_argument("--table-rows", type=int, default=4_000_000)
    ap.add_argument("--tiers", default="pinned,mapped,direct")
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    path = _table(Path(args.table), args.table_rows)
    cuda = args.device == "cuda"
    tables = {
        k: plestore.open_table(path, tier=k, device=args.device) for k in args.tiers.split(",")
    }
    _instrument(tables)
    ids = np.random.default_rng(1).integers(0, tables[next(iter(tables))].spec.rows, args.rows)
    runs: dict = {k: [] for k in tables}
    try:
        for t in tables.values():  # warm: page cache, row cache, kernels
            t.lookup(ids), t.lookup(ids)
        for _ in range(args.reps):
            for k, t in tables.items():
                runs[k].append(_one(t, ids, cuda))
    finally:
        for t in tables.values():
            t.close()
    result = {"rows": args.rows, "reps": args.reps, "device": args.device, "tiers": {}}
    for k, calls in runs.items():
        names = [n for n, _ in calls[0]]  # (the stamps of every call alike: a warm table)
        same = [c for c in calls if [n for n, _ in c] == names]
        med = np.median(np.array([[us for _, us in c] for c in same]), axis=0)
        result["tiers"][k] = {n: round(float(us), 1) for n, us in zip(names, med, strict=True)}
        print(k, json.dumps(result["tiers"][k]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
