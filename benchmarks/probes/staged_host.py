"""Host time of a decode-sized lookup, side by side: `lookup_into` (its decode kernel stubbed
out, so only the host's part is timed) vs `StagedLookup.stage` (whose kernel runs inside the
captured step instead), per tier and batch.

    python benchmarks/probes/staged_host.py TABLE_DIR [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import timeit

import numpy as np
import torch

import plestore
import plestore.lookup.hostpath
import plestore.lookup.staged
import plestore.lookup.table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("table")
    ap.add_argument("--device", default=None)
    ap.add_argument("--tiers", default="device,pinned,mapped,direct")
    ap.add_argument("--number", type=int, default=1500)
    a = ap.parse_args()
    for module in (plestore.lookup.table, plestore.lookup.hostpath):  # host side only
        module.gather_decode = lambda *args, **kw: None
    for tier in a.tiers.split(","):
        with plestore.open_table(a.table, tier=tier, device=a.device) as t:
            for r in (1, 8, 64):
                ids = np.random.default_rng(r).integers(0, t.spec.rows, (r, 16))
                out = torch.empty(r, 16 * t.dim, dtype=torch.bfloat16, device=t.device)
                staged = t.staged((r, 16))
                t.lookup_into(ids, out)
                staged.stage(ids)
                fns = {
                    "lookup_into_us": lambda i=ids, o=out: t.lookup_into(i, o, label="decode"),
                    "stage_us": lambda i=ids, s=staged: s.stage(i),
                }
                best = dict.fromkeys(fns, 1e9)
                for _ in range(3):  # best of three: the least disturbed
                    for key, fn in fns.items():
                        us = timeit.timeit(fn, number=a.number) / a.number * 1e6
                        best[key] = min(best[key], us)
                row = {"tier": tier, "batch": r, **{k: round(v, 1) for k, v in best.items()}}
                print(json.dumps(row), flush=True)
                if t.device.type == "cuda":
                    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
