"""A cold decode step's host time on the file tiers, part by part: the lookup's prefetch (mapped:
WILLNEED of its pages; direct: its block reads submitted), the step's window (a sleep), then the
read, for 16 / 128 / 1,024 fresh random rows a step (batch 1 / 8 / 64), the file evicted first;
with the Python host path beside the native one. Backs the mapped tier's cold phase lasting while
its prefetches read the disk, and its advice in one native call (RESULTS.md "host time, part by
part"). Prints one JSON line per tier: median µs of prefetch, read and both.

    python benchmarks/probes/cold_steps.py TABLE_DIR [--steps 150] [--window-us 400]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import plestore


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("table")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--window-us", type=float, default=400.0)
    ap.add_argument("--tiers", default="mapped,direct,mapped:native=off,direct:native=off")
    a = ap.parse_args()
    for label in a.tiers.split(","):
        tier, _, opt = label.partition(":")
        options = dict(o.split("=") for o in opt.split(",") if o)
        res = {"tier": label}
        with plestore.open_table(a.table, tier=tier, device="cpu", **options) as t:
            tr = t.tier
            rng = np.random.default_rng(7)  # the same rows for every tier
            for n in (16, 128, 1024):
                out = np.empty((n, tr.staging_stride), np.uint8)
                tr.drop_cache()
                tr.read(rng.integers(0, tr.row_range.rows, n), out)  # a cold read first
                pre, read = [], []
                for _ in range(a.steps):
                    rows = rng.integers(0, tr.row_range.rows, n)
                    t0 = time.perf_counter()
                    tr.prefetch(rows)
                    t1 = time.perf_counter()
                    time.sleep(a.window_us / 1e6)
                    t2 = time.perf_counter()
                    tr.read(rows, out)
                    pre.append(t1 - t0)
                    read.append(time.perf_counter() - t2)
                p, r = np.array(pre) * 1e6, np.array(read) * 1e6
                res[n] = {k: round(float(np.median(v)), 1) for k, v in
                          (("prefetch", p), ("read", r), ("both", p + r))}  # fmt: skip
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
