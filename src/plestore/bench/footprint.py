"""What a storage tier costs the host: disk bytes per decode token, and the mapped tier's
resident set under its budget over a long run.

    plestore bench footprint TABLE --json
    plestore bench footprint TABLE --tiers mapped,direct --steps 64 --batch 8 --rss-calls 24

disk: each tier runs in a fresh process with the table file evicted (no mapping of it alive):
one warm-up lookup (counted out), then `steps` decode lookups of `batch` tokens x 16 uniform
random rows; disk bytes are /proc/self/io read_bytes over those steps — what the storage really
delivered, readahead included — divided by the tokens.

rss: the mapped tier with `rss_budget_bytes` = --rss-budget, fed `--rss-calls` prefill-sized
lookups (65,536 random rows, a fresh page for nearly every row); the mapping's Rss is sampled
every 20 ms by a thread. The budget holds if the peak stays near it (the trimmer runs every
0.25 s, so one call's pages can land between two trims).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

import numpy as np

from plestore.bench.report import machine
from plestore.io.memory import evict, process_io
from plestore.options import parse_bytes
from plestore.tablefile import TableFile

ROWS_PER_TOKEN = 16


def disk_per_token(table: str, tier: str, device: str, steps: int, batch: int) -> dict:
    """In this (fresh) process: disk bytes per decode token of `tier`, cold, uniform ids."""
    import torch

    import plestore

    tf = TableFile.open(table)
    evict(str(tf.data_path))
    rng = np.random.default_rng(0)
    with plestore.open_table(table, tier=tier, device=device) as t:
        t.lookup(rng.integers(0, tf.spec.rows, (batch, ROWS_PER_TOKEN)))  # warm-up, not counted
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        io0, t0 = process_io().get("read_bytes", 0), time.perf_counter()
        for _ in range(steps):
            t.lookup(rng.integers(0, tf.spec.rows, (batch, ROWS_PER_TOKEN)))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        read = process_io().get("read_bytes", 0) - io0
        own = t.tier.describe().get("bytes_read")  # the tier's own count (direct: exact)
    tokens = steps * batch
    return {
        "tier": tier,
        "block_bytes": tf.layout.block_bytes,
        "tokens": tokens,
        "disk_bytes": read,
        "disk_bytes_per_token": read / tokens,
        "tier_bytes_read": own,  # since open, warm-up included; None where not counted
        "row_bytes_per_token": ROWS_PER_TOKEN * tf.spec.row_bytes,
        "ms_per_step": seconds / steps * 1e3,
    }


def rss_under_budget(table: str, device: str, budget: int, calls: int, rows: int) -> dict:
    """In this (fresh) process: the mapped tier's Rss, sampled through `calls` big lookups."""
    import plestore
    from plestore.tiers.mapped import mapping_rss

    tf = TableFile.open(table)
    evict(str(tf.data_path))
    path = str(tf.data_path.resolve())
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            samples.append(mapping_rss(path))

    rng = np.random.default_rng(0)
    sampler = threading.Thread(target=sample, daemon=True)
    with plestore.open_table(table, tier="mapped", device=device, rss_budget_bytes=budget) as t:
        sampler.start()
        t0 = time.perf_counter()
        for _ in range(calls):
            t.lookup(rng.integers(0, tf.spec.rows, (rows // ROWS_PER_TOKEN, ROWS_PER_TOKEN)))
        seconds = time.perf_counter() - t0
        time.sleep(0.5)  # let the trimmer act on the last call
        stop.set()
        sampler.join()
        trims = t.tier.describe()["trims"]
    arr = np.array(samples or [0])
    return {
        "budget_bytes": budget,
        "calls": calls,
        "rows_per_call": rows,
        "pages_touched_bytes": calls * rows * 4096,
        "rss_peak_bytes": int(arr.max()),
        "rss_median_bytes": int(np.median(arr)),
        "rss_final_bytes": int(arr[-1]),
        "peak_over_budget": float(arr.max() / budget) if budget else None,
        "trims": trims,
        "samples": len(samples),
        "seconds": seconds,
    }


def _fresh(table: str, *args: str) -> dict:
    """Run one measurement in a fresh `python -m plestore.bench.footprint` process."""
    cmd = [sys.executable, "-m", "plestore.bench.footprint", table, "--worker", *args]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="plestore bench footprint", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("table", help="a packed table (directory or .json)")
    ap.add_argument("--tiers", default="mapped,direct")
    ap.add_argument("--steps", type=int, default=64, help="decode steps per tier")
    ap.add_argument("--batch", type=int, default=8, help="tokens per decode step")
    ap.add_argument("--rss-budget", default="1G", help="mapped tier's budget ('0' skips)")
    ap.add_argument("--rss-calls", type=int, default=24)
    ap.add_argument("--rss-rows", type=int, default=65536, help="rows per call")
    ap.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.worker:
        kind, *rest = a.worker
        if kind == "disk":
            tier, device, steps, batch = rest
            r = disk_per_token(a.table, tier, device, int(steps), int(batch))
        else:
            device, budget, calls, rows = rest
            r = rss_under_budget(a.table, device, int(budget), int(calls), int(rows))
        print(json.dumps(r))
        return 0
    if a.device is None:
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    res: dict = {"machine": machine(), "table": str(a.table), "disk": []}
    for tier in [t for t in a.tiers.split(",") if t]:
        res["disk"].append(_fresh(a.table, "disk", tier, a.device, str(a.steps), str(a.batch)))
    budget = parse_bytes(a.rss_budget)
    if budget:
        res["rss"] = _fresh(
            a.table, "rss", a.device, str(budget), str(a.rss_calls), str(a.rss_rows)
        )
    if a.json:
        print(json.dumps(res, indent=1))
        return 0
    for d in res["disk"]:
        kib = d["disk_bytes_per_token"] / 1024
        print(
            f"{d['tier']:8s} blocks {d['block_bytes']:>5} B: {kib:8.2f} KiB disk per token "
            f"(rows: {d['row_bytes_per_token']} B), "
            f"{d['ms_per_step']:.2f} ms/step, {d['tokens']} tokens"
        )
    if "rss" in res:
        r = res["rss"]
        print(
            f"mapped rss: budget {r['budget_bytes'] / 2**20:.0f} MiB, peak "
            f"{r['rss_peak_bytes'] / 2**20:.0f} MiB, median {r['rss_median_bytes'] / 2**20:.0f} "
            f"MiB, final {r['rss_final_bytes'] / 2**20:.0f} MiB over {r['calls']} calls touching "
            f"{r['pages_touched_bytes'] / 2**30:.1f} GiB ({r['trims']} trims)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
