"""Profile the host path of decode-sized lookups (mapped, direct, pinned with gather=cpu): where
the per-call time goes, to bring it under what a decode step can hide.

    python benchmarks/probe_host_path.py --gib 0.5
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time

import numpy as np
import torch
from probe_gather import build

import plestore


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=0.5)
    ap.add_argument("--calls", type=int, default=300)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=".") as d:
        rows = build(d, a.gib)
        rng = np.random.default_rng(0)
        big = {"inline_ids": 1 << 20}  # run every lookup in this thread, where cProfile sees it
        for tier, opts, batches in (
            ("mapped", big, (1, 64)),
            ("direct", big, (1, 64)),
            ("pinned", {"gather": "cpu", **big}, (1, 64, 4096)),
        ):
            with plestore.open_table(d, tier=tier, **opts) as t:
                for batch in batches:
                    calls = a.calls if batch < 4096 else a.calls // 10
                    ids = [rng.integers(0, rows, (batch, 16)) for _ in range(calls)]
                    for i in ids[:20]:
                        t.lookup(i)
                    torch.cuda.synchronize()
                    prof = cProfile.Profile()
                    t0 = time.perf_counter()
                    prof.enable()
                    for i in ids:
                        t.lookup(i)
                    prof.disable()
                    torch.cuda.synchronize()
                    us = (time.perf_counter() - t0) / calls * 1e6
                    print(f"=== {tier} batch {batch}: {us:.0f} us per lookup (profiled)")
                    s = io.StringIO()
                    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
                    print("\n".join(s.getvalue().splitlines()[6:24]))


if __name__ == "__main__":
    main()
