"""The row cache's probe of a warm prefill chunk (16,384 / 131,072 ids) three ways: numpy on
one core, torch ops on torch's threads (the library's, past PARALLEL_ROWS), numpy on a pool
of threads (benchmarks/probes/variants.py threaded-get); a 256 MiB cache (the direct tier's
default) holding (nearly) every probed row, four id sets in turn; medians, ms.

    python benchmarks/probes/cache_get.py
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import variants

from plestore.tiers.rowcache import RowCache


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    cache = RowCache((256 << 20) // (90 + 16), 90)
    rng = np.random.default_rng(0)
    sets = [rng.integers(0, 48_000_768, 131072) for _ in range(4)]
    for ids in sets:
        cache.put(ids, rng.integers(0, 256, (len(ids), 90), dtype=np.uint8), False)
    out = np.zeros((131072, 96), np.uint8)
    torch_get = RowCache._get_parallel
    variants.threaded_get()
    ways = {"numpy": RowCache._get, "torch": torch_get, "threads8": RowCache._get_parallel}
    res = {"torch_threads": torch.get_num_threads()}
    for n in (16384, 131072):
        for name, fn in ways.items():
            ts = []
            for i in range(25):
                t0 = time.perf_counter()
                hit = fn(cache, sets[i % 4][:n], out[:n])
                ts.append(time.perf_counter() - t0)
                assert hit.mean() > 0.99, hit.mean()  # (a full set turns a few away)
            res[f"{name}_{n}"] = round(float(np.median(ts[1:])) * 1e3, 3)
    print(json.dumps({"warm_cache_get_ms": res}))


if __name__ == "__main__":
    main()
