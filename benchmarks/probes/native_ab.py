"""The native gather of two builds of the core side by side, call by call (order alternated;
medians, µs): this checkout's and another compiled `_core` (e.g. one built at an older commit:
`git stash; pip install -e .; cp src/plestore/native/_core*.so /tmp/other/; git stash pop`).
65,536 random rows of 96 B from a 768 MiB array, unblocked and in 512-B blocks, 1 thread and
every core. The question: is a change to the C hot path faster, on the same ids and memory.
With --table, also the direct tier's read of 65,536 rows all in its row cache (1 GiB), both
cores' `DirectCore` over the same cache arrays, plain and streamed stores.

    python benchmarks/probes/native_ab.py OTHER_CORE_SO [--reps 40] [--table DIR] [--json OUT]

--table: a packed table, or a directory to write one of random row bytes in.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

import numpy as np
from native_parts import _table  # (a probe beside this one)

import plestore
from plestore import native
from plestore.tablefile import DATA_OFFSET

ROWS, RB, N = 8_000_000, 96, 65536


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("other", help="another build's _core shared object")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--table", default="", help="also the direct tier's cache probe, on this table")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("other._core", args.other)
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    cores = {"this": native.load("on"), "other": other}
    rng = np.random.default_rng(0)
    src = np.full(ROWS * RB, 7, np.uint8)  # written: resident, no first-touch faults
    out = np.empty((N, RB), np.uint8)
    layouts = {"unblocked": (1, RB, RB), "blocked512": (512 // RB, 512, RB)}
    res: dict[str, list[float]] = {}
    for rep in range(args.reps):
        for name, (rpb, block, stride) in layouts.items():
            rows = ROWS if rpb == 1 else ROWS * RB // block * rpb
            for threads in (1, len(os.sched_getaffinity(0))):
                ids = rng.integers(0, rows, N)
                order = list(cores.items())[:: 1 if rep % 2 else -1]
                for tag, core in order:
                    t0 = time.perf_counter()
                    bad, *_ = core.gather(src, ids, out, RB, RB, 0, rpb, block, stride, threads)
                    res.setdefault(f"{name}_t{threads}_{tag}", []).append(time.perf_counter() - t0)
                    if bad >= 0:
                        raise SystemExit(f"{tag}: row {ids[bad]} refused")
    if args.table:
        direct_ab(cores, _table(Path(args.table), 4_000_000), args.reps, res)
    result = {k: round(float(np.median(v)) * 1e6, 1) for k, v in res.items()}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def direct_ab(cores: dict, path: Path, reps: int, res: dict) -> None:
    """Each core's DirectCore reading N rows that all hit the same row cache (alternated)."""
    with plestore.open_table(path, tier="direct", device="cpu", cache_bytes=1 << 30) as t:
        tier, c = t.tier, t.tier.cache
        ids = np.random.default_rng(1).integers(0, t.spec.rows, N)
        out = np.empty((N, tier.staging_stride), np.uint8)
        tier.read(ids, out)  # admitted: every later read hits
        want = out.copy()
        args = (
            tier.reader.fd, tier.reader.size, DATA_OFFSET, tier.unit, tier._step, tier.row_bytes,
            *native.layout_rule(tier.table.layout), tier.staging.array, tier._ahead_buf.array,
            tier.options.queue_depth, c.tags, c.stamp, c.data,
            native.memory_threads(tier.options.threads),
        )  # fmt: skip
        direct = {tag: core.DirectCore(*args) for tag, core in cores.items()}
        for rep in range(reps):
            for streaming in (False, True):
                for tag, d in list(direct.items())[:: 1 if rep % 2 else -1]:
                    out[:] = 0
                    t0 = time.perf_counter()
                    hits, _, _ = d.read(ids, out, out.shape[1], 1 + rep, streaming)
                    key = f"direct_{'streamed' if streaming else 'plain'}_{tag}"
                    res.setdefault(key, []).append(time.perf_counter() - t0)
                    if hits != N or not np.array_equal(out, want):
                        raise SystemExit(f"{tag}: the direct read missed or differs")


if __name__ == "__main__":
    main()
