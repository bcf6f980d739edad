"""`plestore bench sglang`: SGLang 0.5.23's own ways of serving the PLE table beside plestore's
tiers, on the same packed table file, every method's rows checked against the resident table.

    plestore bench sglang TABLE --json
    plestore bench sglang TABLE --methods sglang-file,plestore-direct --long-steps 4000

steps: a decode step's lookup (b1 / b8 / b64 tokens x 16 rows) and a 4,096-token prefill chunk,
uniform ids, per method: warm (median of --reps after a warm-up) and cold (a fresh process, the
file evicted, no mapping alive; decode-b1, decode-b64, prefill-4096). `vs_file` is each method's
time over `sglang-file`'s in the same run (the target: plestore's host tiers <= 1/3).

resident: the table's host memory after a long decode (--long-steps decode-b64 steps, uniform
ids, from a cold start, each method in a fresh process): `sglang-file`'s mapping Rss under its
trimmer (budget --budget, checked every --trim-interval s, as SGLang's defaults: 8 GiB, 30 s),
plestore's mapped tier under `rss_budget_bytes` = --budget, the direct tier's row cache, and
SGLang's pinned table (the whole table); peak and final, sampled every 20 ms.

The methods (bench/methods.py): sglang-pinned-uva (the pinned backend's UVA gather),
sglang-file (its file backend: mmap + MADV_RANDOM, WILLNEED for gathers >= 2,048 rows, the Rss
trimmer; on a CUDA GPU SGLang serves it only where the GPU reads pageable memory, here it is
gathered on the host and copied), hbm-resident (the floor) and plestore-<tier>.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from dataclasses import asdict

import numpy as np

from plestore.bench.report import machine
from plestore.io.memory import evict
from plestore.options import parse_bytes
from plestore.tablefile import TableFile

__all__ = ["main", "resident_after_decode"]

METHODS = (
    "hbm-resident,sglang-pinned-uva,sglang-file,plestore-pinned,plestore-mapped,plestore-direct"
)
WORKLOADS = ("decode-b1", "decode-b8", "decode-b64", "prefill-4096")
COLD = ("decode-b1", "decode-b64", "prefill-4096")
ROWS_PER_TOKEN = 16


def resident_after_decode(
    table: str, method: str, device: str, steps: int, budget: int, interval_s: float
) -> dict:
    """In this (fresh) process: the table's host memory through `steps` decode-b64 lookups of
    `method` from a cold start (peak of 20-ms samples, and final)."""
    import torch

    from plestore.bench.methods import SglangFile, make_method

    tf = TableFile.open(table)
    evict(str(tf.data_path))
    SglangFile.budget, SglangFile.interval_s = budget, interval_s
    options = {"rss_budget_bytes": budget} if method == "plestore-mapped" else {}
    m = make_method(method, tf, torch.device(device), **options)
    held = _holding(m, tf)
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            samples.append(held())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    try:
        for _ in range(steps):
            m.lookup(rng.integers(0, tf.spec.rows, 64 * ROWS_PER_TOKEN))
        seconds = time.perf_counter() - t0
        time.sleep(0.3)  # (a trimmer's last pass)
        final = held()
        trims = getattr(m, "trims", None) if method != "plestore-mapped" else m.table.tier.trims
    finally:
        stop.set()
        sampler.join()
        m.close()
    return {
        "method": method,
        "steps": steps,
        "budget_bytes": budget if method in ("sglang-file", "plestore-mapped") else None,
        "peak_bytes": int(max(samples, default=final)),
        "final_bytes": int(final),
        "trims": trims,
        "table_bytes": tf.data_bytes,
        "ms_per_step": seconds / steps * 1e3,
    }


def _holding(m, tf: TableFile):
    """() -> the host bytes `m` holds of the table now."""
    if hasattr(m, "resident_bytes"):  # sglang-file: its mapping's Rss
        return m.resident_bytes
    if hasattr(m, "table"):  # plestore: what the tier reports holding
        return m.table.tier.host_bytes
    return lambda: tf.data_bytes  # pinned / resident copies: the whole table


def _fresh(table: str, *args: str) -> dict:
    cmd = [sys.executable, "-m", "plestore.bench.sglang", table, "--worker", *args]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _vs_file(steps: list[dict]) -> None:
    """Each row's times over sglang-file's for the same workload, in place."""
    file = {r["workload"]: r for r in steps if r["method"] == "sglang-file"}
    for r in steps:
        base = file.get(r["workload"])
        for key in ("warm_ms", "cold_ms"):
            ok = base and r[key] is not None and base[key]
            r[f"{key.removesuffix('_ms')}_vs_file"] = r[key] / base[key] if ok else None


def _print(res: dict) -> None:
    print(f"{'method':18s} {'workload':13s} {'warm ms':>9s} {'cold ms':>9s} {'vs file':>8s}")
    for r in res["steps"]:
        cold = "" if r["cold_ms"] is None else f"{r['cold_ms']:9.3f}"
        vs = "" if r["warm_vs_file"] is None else f"{r['warm_vs_file']:8.2f}"
        print(f"{r['method']:18s} {r['workload']:13s} {r['warm_ms']:9.3f} {cold:>9s} {vs:>8s}")
    for r in res["resident"]:
        budget = "" if r["budget_bytes"] is None else f" (budget {r['budget_bytes'] >> 20} MiB)"
        print(
            f"{r['method']:18s} after {r['steps']} decode steps: peak "
            f"{r['peak_bytes'] / 2**20:.0f} MiB, final {r['final_bytes'] / 2**20:.0f} MiB of a "
            f"{r['table_bytes'] / 2**20:.0f} MiB table{budget}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="plestore bench sglang", description=__doc__.split("\n\n")[0])
    ap.add_argument("table", help="a packed Qwen4-Exp table (directory or .json)")
    ap.add_argument("--methods", default=METHODS, help=f"comma-separated (default: {METHODS})")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="(default: %(default)s)")
    ap.add_argument(
        "--cold",
        default=",".join(COLD),
        help="workloads timed cold, '' none (default: %(default)s)",
    )
    ap.add_argument("--reps", type=int, default=20, help="warm repetitions (default: 20)")
    ap.add_argument("--long-steps", type=int, default=2000, help="decode-b64 steps (default: 2000)")
    ap.add_argument(
        "--budget",
        default="8G",
        help="the resident-set budget of sglang-file's trimmer and plestore-mapped (default: 8G, "
        "SGLang's)",
    )
    ap.add_argument(
        "--trim-interval",
        type=float,
        default=30.0,
        help="seconds between sglang-file's trims (default: 30, SGLang's)",
    )
    ap.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        method, device, steps, budget, interval = a.worker
        r = resident_after_decode(a.table, method, device, int(steps), int(budget), float(interval))
        print(json.dumps(r))
        return 0
    import torch

    from plestore.bench.lookup import run_lookup_bench

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    methods = [m for m in a.methods.split(",") if m]
    log = (lambda msg: print(msg, file=sys.stderr)) if a.json else print
    rows = run_lookup_bench(
        a.table, methods, [w for w in a.workloads.split(",") if w], ["uniform"], device, {},
        reps=a.reps, cold=[w for w in a.cold.split(",") if w], log=log,
    )  # fmt: skip
    res = {"machine": machine(), "table": str(a.table), "steps": [asdict(r) for r in rows]}
    _vs_file(res["steps"])
    budget = str(parse_bytes(a.budget))
    res["resident"] = [
        _fresh(a.table, m, str(device), str(a.long_steps), budget, str(a.trim_interval))
        for m in methods
        if a.long_steps and m != "hbm-resident"
    ]
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        _print(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
