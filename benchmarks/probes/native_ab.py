"""The native gather of two builds of the core side by side, call by call (order alternated;
medians, µs): this checkout's and another compiled `_core` (e.g. one built at an older commit:
`git stash; pip install -e .; cp src/plestore/native/_core*.so /tmp/other/; git stash pop`).
65,536 random rows of 96 B from a 768 MiB array, unblocked and in 512-B blocks, 1 thread and
every core. The question: is a change to the C hot path faster, on the same ids and memory.

    python benchmarks/probes/native_ab.py OTHER_CORE_SO [--reps 40] [--json OUT]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

import numpy as np

from plestore import native

ROWS, RB, N = 8_000_000, 96, 65536


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("other", help="another build's _core shared object")
    ap.add_argument("--reps", type=int, default=40)
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
    result = {k: round(float(np.median(v)) * 1e6, 1) for k, v in res.items()}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
