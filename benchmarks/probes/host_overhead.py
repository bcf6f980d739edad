"""A warm decode-sized `lookup()`'s host overhead per tier, part by part: every tier open at
once, the same ids looked up again and again (as `bench lookup`'s warm cells), each part
timed alone and the tiers interleaved call by call (a busy machine's drift lands on all alike);
medians in µs. `lookup` waits for the device; `host` is the same call's host time alone (to the
return of lookup(), before the device finishes); `path` is the host time with the decode left
out (no kernel launched, no CPU decode): the lookup's own bookkeeping, the number to cut.
`mapped:notrim` is the mapped tier with its resident-set trimmer stopped (its smaps reads).
--profile TIER: also where that tier's `path` time goes, by function (cProfile, own time).

    python benchmarks/probes/host_overhead.py TABLE [--device cpu|cuda] [--reps 2000] [--json OUT]
        [--profile mapped] [--shapes b1,b8,b64,p4096]

TABLE: a packed table, or a directory to write one of random row bytes in (--rows).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import time
from pathlib import Path

import numpy as np
import torch
from native_parts import _table  # (a probe beside this one)

import plestore
import plestore.lookup.hostpath as hostpath
import plestore.lookup.table as table_mod
from plestore.kernels.gather_decode import gather_decode
from plestore.lookup.metrics import CallRecord

TIERS = ("device", "pinned", "mapped", "direct")
# decode: 16 hashed rows per token; p4096: a 4,096-token prefill chunk's 65,536 rows
SHAPES = {"b1": (1, 16), "b8": (8, 16), "b64": (64, 16), "p4096": (4096, 16)}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def interleaved_us(fns: dict, reps: int, sync: torch.device | None = None) -> dict:
    """Median µs of each fn, the fns called in turn `reps` times (one untimed call each first)."""
    for fn in fns.values():
        fn()
    ts: dict = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            if sync is not None:
                _sync(sync)
            t0 = time.perf_counter()
            fn()
            if sync is not None:
                _sync(sync)
            ts[k].append(time.perf_counter() - t0)
    return {k: round(float(np.median(v)) * 1e6, 1) for k, v in ts.items()}


@contextlib.contextmanager
def no_decode():
    """The lookup path with its decode (kernel launch, or CPU decode) left out."""
    saved = hostpath.gather_decode, table_mod.gather_decode
    hostpath.gather_decode = table_mod.gather_decode = lambda *a: a[-1]
    try:
        yield
    finally:
        hostpath.gather_decode, table_mod.gather_decode = saved


def parts(t, ids: np.ndarray) -> dict:
    """A host lookup's parts as callables (the tier's, where it has them)."""
    flat = ids.reshape(-1)
    buf = np.empty((flat.size, t.tier.staging_stride), np.uint8)
    src = torch.from_numpy(buf)
    index = torch.arange(flat.size)
    out = torch.empty((flat.size, t.dim), dtype=t.dtype, device=t.device)
    fns = {
        "validate": lambda: t._validate(ids),
        "output": lambda: t._output((*ids.shape[:-1], ids.shape[-1] * t.dim), None),
        "disk_mark": t._host.disk_mark,
        "record": lambda: t.metrics.record(CallRecord(label="probe", path="host", rows=16)),
    }
    if t.tier.can_read_host:
        fns["tier.prefetch"] = lambda: t.tier.prefetch(flat)
        fns["tier.read"] = lambda: t.tier.read(flat, buf)
    if hasattr(t.tier, "_check_file"):
        fns["check_file"] = t.tier._check_file
    if t.device.type == "cpu":
        fns["decode"] = lambda: gather_decode(
            src, index, 0, flat.size, t.format, t.dim, t.spec.scale, out
        )
    return fns


def _profile(fn, reps: int, top: int = 25) -> list:
    """[(function, own µs per call)] of `fn` without its decode, the top `top` by own time."""
    prof = cProfile.Profile()
    with no_decode():
        prof.runcall(lambda: [fn() for _ in range(reps)])
    st = pstats.Stats(prof, stream=io.StringIO())
    rows = [
        (f"{Path(f).name}:{line}({name})", round(tt / reps * 1e6, 2))
        for (f, line, name), (_, _, tt, _, _) in st.stats.items()
    ]
    return sorted(rows, key=lambda r: -r[1])[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", help="a packed table, or a directory to write one in")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiers", default=",".join(TIERS))
    ap.add_argument("--json", default="")
    ap.add_argument("--profile", default="", help="a tier whose path to profile by function")
    ap.add_argument("--shapes", default="b1,b8", help=f"of {', '.join(SHAPES)}")
    args = ap.parse_args()
    path = _table(Path(args.table), args.rows)
    dev = torch.device(args.device)
    tables = {
        k: plestore.open_table(path, tier=k, device=args.device) for k in args.tiers.split(",")
    }
    if "mapped" in tables:  # beside it, one without its resident-set trimmer thread
        tables["mapped:notrim"] = t = plestore.open_table(path, tier="mapped", device=args.device)
        t.tier._stop.set()
        t.tier._trimmer.join()
    result: dict = {"cpus": len(os.sched_getaffinity(0)), "device": str(dev), "reps": args.reps}
    try:
        rows = next(iter(tables.values())).spec.rows
        for name in args.shapes.split(","):
            shape = SHAPES[name]
            ids = np.random.default_rng(1).integers(0, rows, shape)
            for t in tables.values():
                t.lookup(ids)  # warm: page cache, row cache, kernels
                t.metrics.reset()
            calls = {k: (lambda t=t, ids=ids: t.lookup(ids)) for k, t in tables.items()}
            res = {"lookup": interleaved_us(calls, args.reps, dev)}
            res["host"] = interleaved_us(calls, args.reps)
            _sync(dev)
            with no_decode():
                res["path"] = interleaved_us(calls, args.reps)
            # what the timed lookups did: a warm one reads no disk and takes no page fault
            keys = ("calls", "major_faults", "minor_faults", "disk_read_bytes")
            res["counts"] = {
                k: {c: t.stats()["phases"].get("lookup", {}).get(c, 0) for c in keys}
                for k, t in tables.items()
            }
            for k, t in tables.items():
                if ":" not in k:
                    res[k] = interleaved_us(parts(t, ids), args.reps)
            if args.profile:
                res["profile"] = _profile(calls[args.profile], args.reps)
            result[name] = res
            print(json.dumps({name: res}), flush=True)
    finally:
        for t in tables.values():
            t.close()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
