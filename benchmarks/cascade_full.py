"""The cascade tier on a full-size table: the budget split it chooses, exact rows from every part.

    python3 benchmarks/cascade_full.py TABLE_DIR [--device-budget 8G --pinned-budget 8G]
        [--gpu-cache 1G] [--text textstreams/en] [--lookups 64]

Opens TABLE_DIR with tier="cascade" (budgets from free memory where not given), prints the plan
and its reason, then checks `--lookups` lookups (decode-b64 and prefill-2048 of real text when
`--text` is given, uniform rows otherwise, plus rows at each part's edges) bit for bit against
the file's bytes decoded in numpy, and prints the GPU row cache's hit rate per phase, lookup
times and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

import plestore
from plestore.bench.workloads import WORKLOADS, row_ids
from plestore.formats import get_format
from plestore.options import parse_bytes
from plestore.tablefile import TableFile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("table")
    ap.add_argument("--device-budget", help="bytes resident on the device (default: free HBM)")
    ap.add_argument("--pinned-budget", help="bytes in pinned memory (default: available RAM)")
    ap.add_argument("--gpu-cache", default="0", help="GPU row cache in front (e.g. 1G)")
    ap.add_argument("--text", help="a token stream (plestore text) for the lookups")
    ap.add_argument("--lookups", type=int, default=64)
    a = ap.parse_args()
    tf = TableFile.open(a.table)
    fmt = get_format(tf.spec.format)
    opts = {"gpu_cache_bytes": parse_bytes(a.gpu_cache)}
    if a.device_budget:
        opts["device_budget_bytes"] = parse_bytes(a.device_budget)
    if a.pinned_budget:
        opts["pinned_budget_bytes"] = parse_bytes(a.pinned_budget)
    t0 = time.perf_counter()
    with plestore.open_table(a.table, tier="cascade", **opts) as t:
        opened = time.perf_counter() - t0
        plan = t.stats()["tier_detail"]["cascade"]
        print(f"opened in {opened:.1f} s; {plan['reason']}", flush=True)
        edges = [r for p in ("device", "pinned", "file") for r in plan[p] if 0 <= r < tf.spec.rows]
        edges = np.array(sorted({max(0, r - 1) for r in edges} | set(edges)), np.int64)
        dist = "text" if a.text else "uniform"
        exact, times = True, {}
        for i in range(a.lookups):
            w = "decode-b64" if i % 2 else "prefill-2048"
            ids = row_ids(tf.spec, WORKLOADS[w], dist, seed=i, text=a.text)
            ids = np.r_[edges, ids] if i == 0 else ids
            ids = ids[: ids.size // tf.spec.heads * tf.spec.heads].reshape(-1, tf.spec.heads)
            label = w.split("-")[0]
            if t.device.type == "cuda":
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            got = t.lookup(ids, label=label)
            if t.device.type == "cuda":
                torch.cuda.synchronize()
            times.setdefault(label, []).append(time.perf_counter() - t1)
            want = fmt.decode_numpy(tf.read_rows(ids.reshape(-1)), tf.spec.scale)
            g = got.float().cpu().numpy().reshape(want.shape)
            same = (g.view(np.uint32) == want.view(np.uint32)) | (np.isnan(g) & np.isnan(want))
            exact &= bool(same.all())
        phases = t.stats()["phases"]
        out = {
            "table_rows": tf.spec.rows,
            "plan": plan,
            "exact": exact,
            "open_s": opened,
            "gpu_cache_hit_rate": {p: v["gpu_cache_hit_rate"] for p, v in phases.items()},
            "median_ms": {p: 1e3 * float(np.median(v)) for p, v in times.items()},
        }
        print(f"exact: {exact}; hit rate {out['gpu_cache_hit_rate']}; ms {out['median_ms']}")
        print(json.dumps(out))
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
