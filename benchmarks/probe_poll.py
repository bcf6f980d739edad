"""A decode step's cold reads with the waiting thread asleep in the kernel or polling: O_DIRECT
reads of 16 / 128 / 1,024 random 512-B blocks (batch 1 / 8 / 64 x 16 rows), each batch after
2 ms of host idleness as between decode steps, the two ways interleaved; ms percentiles.

    python benchmarks/probe_poll.py TABLE_DIR
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from plestore.bench.limits import random_read_floor_s
from plestore.tablefile import TableFile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("table")
    ap.add_argument("--reps", type=int, default=40)
    a = ap.parse_args()
    path = str(TableFile.open(a.table).data_path)
    res = {}
    for n in (16, 128, 1024):
        ms: dict[str, list[float]] = {"sleep": [], "poll": []}
        for i in range(a.reps):
            for j, (way, poll_us) in enumerate((("sleep", 0), ("poll", 1000))):
                seed = 2 * (a.reps * n + i) + j  # blocks never read before in this probe
                s = random_read_floor_s(path, n, 512, 128, seed, poll_us, idle_s=0.002)
                ms[way].append(s * 1e3)
        pct = {"p10": 10, "p50": 50, "p90": 90}
        res[n] = {
            w: {q: round(float(np.percentile(v, p)), 3) for q, p in pct.items()}
            for w, v in ms.items()
        }
    print(json.dumps({"cold_reads_ms": res}))


if __name__ == "__main__":
    main()
