"""What a decode step's cold reads cost on this disk, three ways: O_DIRECT reads of 16 / 128 /
1,024 random 512-B blocks (batch 1 / 8 / 64 x 16 rows) timed as the e2e bound times them
(prepared, then one io_uring_enter: the kernel and the disk alone), the same after 2 ms of
host idleness (as a decode loop's host may idle between steps), and through BlockReader.read
(this library's reader, its Python included); interleaved, ms percentiles.

    python benchmarks/probes/disk_latency.py TABLE_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from plestore.bench.limits import random_read_floor_s
from plestore.io.blockreader import BlockReader
from plestore.io.memory import HostBuffer
from plestore.tablefile import TableFile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("table")
    ap.add_argument("--reps", type=int, default=40)
    a = ap.parse_args()
    path = str(TableFile.open(a.table).data_path)
    size = os.path.getsize(path)
    reader = BlockReader(path, 512, queue_depth=128)
    buf = HostBuffer(1024 * 512)
    out = buf.array.reshape(-1, 512)
    rng = np.random.default_rng(12345)
    res = {}
    for n in (16, 128, 1024):
        ms: dict[str, list[float]] = {"prepared": [], "prepared_idle": [], "reader": []}
        for i in range(a.reps):
            seed = 3 * (a.reps * n + i)  # blocks never read before in this probe
            ms["prepared"].append(1e3 * random_read_floor_s(path, n, 512, 128, seed))
            s = random_read_floor_s(path, n, 512, 128, seed + 1, idle_s=0.002)
            ms["prepared_idle"].append(1e3 * s)
            offs = rng.integers(0, size // 512, n) * 512
            t0 = time.perf_counter()
            reader.read(offs, out[:n])
            ms["reader"].append(1e3 * (time.perf_counter() - t0))
        pct = {"p10": 10, "p50": 50, "p90": 90}
        res[n] = {
            w: {q: round(float(np.percentile(v, p)), 3) for q, p in pct.items()}
            for w, v in ms.items()
        }
    reader.close()
    buf.close()
    print(json.dumps({"cold_reads_ms": res}))


if __name__ == "__main__":
    main()
