"""N processes on one node serving one table: host memory and lookup time with a private copy
per process (share="none") against one copy per node (share="node"), side by side in one run.

    plestore bench shared TABLE --procs 2 --device cuda --json
    plestore bench shared TABLE --procs 3 --tier pinned --batch 64 --reps 200 --rounds 2

`procs` fresh processes run the modes in turn (private, shared, then shared, private, ... for
`rounds`, so drift cancels). In each, every process opens the table, waits for the others,
warms up, then times `reps` lookups of `batch` tokens x heads uniform random rows (each lookup
waited for: on a GPU, synchronised), all processes at once. While every process still holds the
table, each reads its own proportional set size (PSS: a shared page counts 1/n in each of the n
processes mapping it): of the table's mapping (`table_pss`) and of the whole process
(smaps_rollup). Their sums over the processes are host memory counted once; `copies` is the
table mappings' sum over the table's bytes (private: ~procs; shared: ~1). Rows exact: every
process hashes its lookups' output bytes; both modes must give the same digest per process.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import re
import statistics
import sys
import time

import numpy as np

from plestore.bench.report import machine

__all__ = ["main", "mapping_pss", "process_pss", "table_pss"]

_VMA = re.compile(rb"^([0-9a-f]+)-([0-9a-f]+) [^\n]*$", re.M)


def process_pss(pid: int | str = "self") -> int:
    """Bytes of PSS of a whole process (/proc/PID/smaps_rollup)."""
    with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
        m = re.search(rb"^Pss:\s+(\d+) kB", f.read(), re.M)
    return int(m.group(1)) * 1024 if m else 0


def mapping_pss(lo: int, hi: int, pid: int | str = "self") -> int:
    """Bytes of PSS of the mappings of [lo, hi) in a process (/proc/PID/smaps)."""
    with open(f"/proc/{pid}/smaps", "rb") as f:
        smaps = f.read()
    total = 0
    heads = list(_VMA.finditer(smaps))
    for i, h in enumerate(heads):
        a, b = int(h.group(1), 16), int(h.group(2), 16)
        if a < hi and b > lo:
            end = heads[i + 1].start() if i + 1 < len(heads) else len(smaps)
            m = re.search(rb"^Pss:\s+(\d+) kB", smaps[h.end() : end], re.M)
            total += int(m.group(1)) * 1024 if m else 0
    return total


def table_pss(table) -> int:
    """PSS of what a Table's tier maps: the pinned tier's buffer, the mapped tier's file."""
    tier = table.tier
    buf = getattr(tier, "buffer", None)
    if buf is not None:
        return mapping_pss(buf.address, buf.address + buf.nbytes)
    if getattr(tier, "map", None) is not None:
        base = tier._base
        return mapping_pss(base, base + tier._size)
    return 0


def _proc(i, table, tier, device, schedule, batch, reps, threads, barrier, queue) -> None:
    import torch

    import plestore

    torch.set_num_threads(threads)  # the processes split the cores, not oversubscribe them
    if device == "cuda:each":  # replicas, one per GPU (data parallel)
        device = f"cuda:{i}"
    try:
        if device.startswith("cuda"):
            torch.empty(1, device=device)  # context creation stays out of the numbers
        for r, share in schedule:
            res = _one(i, plestore, torch, table, tier, device, share, batch, reps, barrier)
            queue.put({**res, "round": r})
    except BaseException as e:
        barrier.abort()
        queue.put({"proc": i, "error": f"{type(e).__name__}: {e}"})


def _one(i, plestore, torch, table, tier, device, share, batch, reps, barrier) -> dict:
    """One process's part of one mode: open, time lookups, read PSS while all hold it, close."""
    barrier.wait()  # the previous mode is closed everywhere
    base = process_pss()
    t0 = time.perf_counter()
    t = plestore.open_table(table, tier=tier, device=device, share=share)
    open_s = time.perf_counter() - t0
    barrier.wait()
    rng = np.random.default_rng(1000 + i)
    heads, rows = t.spec.heads, t.spec.rows
    for _ in range(5):
        t.lookup(rng.integers(0, rows, (batch, heads)))
    sync = torch.cuda.synchronize if t.device.type == "cuda" else (lambda: None)
    sync()
    rng = np.random.default_rng(i)  # per process; the same in every mode
    digest, times = hashlib.sha256(), []
    for _ in range(reps):
        ids = rng.integers(0, rows, (batch, heads))
        t0 = time.perf_counter()
        out = t.lookup(ids)
        sync()
        times.append(time.perf_counter() - t0)
        digest.update(out.view(torch.int16).cpu().numpy().tobytes())
    barrier.wait()  # every process still holds the table: PSS splits the shared pages
    res = {
        "proc": i,
        "share": share,
        "open_s": open_s,
        "lookup_p50_s": statistics.median(times),
        "table_pss": table_pss(t),
        "process_pss": process_pss(),
        "process_pss_growth": process_pss() - base,
        "digest": digest.hexdigest(),
        "built": bool(t.tier.describe().get("built_shared_copy")),
    }
    barrier.wait()
    t.close()
    return res


def run(
    table, tier, device, procs, batch, reps, rounds, threads=None, timeout_s=600.0
) -> dict[str, list]:
    """`procs` fresh processes run every mode of the schedule in turn (see the module
    docstring); per mode, a list of rounds, each the processes' results summed."""
    schedule = [(r, s) for r in range(rounds) for s in (("none", "node"), ("node", "none"))[r % 2]]
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(procs), ctx.Queue()
    threads = threads or max(1, (os.cpu_count() or 1) // procs)
    args = (table, tier, device, schedule, batch, reps, threads, barrier, queue)
    ps = [ctx.Process(target=_proc, args=(i, *args)) for i in range(procs)]
    for p in ps:
        p.start()
    got = []
    try:
        while len(got) < procs * len(schedule):
            g = queue.get(timeout=timeout_s)
            if "error" in g:
                raise RuntimeError(f"bench shared, process {g['proc']}: {g['error']}")
            got.append(g)
    finally:
        for p in ps:
            p.join(timeout_s if len(got) == procs * len(schedule) else 5)
            if p.is_alive():
                p.kill()
    runs: dict[str, list] = {}
    for r, share in schedule:
        per = sorted((g for g in got if (g["round"], g["share"]) == (r, share)), key=_proc_of)
        runs.setdefault(share, []).append(_sum(per))
    return runs


def _proc_of(g: dict) -> int:
    return g["proc"]


def _sum(procs: list[dict]) -> dict:
    return {
        "procs": procs,
        "table_pss_sum": sum(g["table_pss"] for g in procs),
        "process_pss_sum": sum(g["process_pss"] for g in procs),
        "process_pss_growth_sum": sum(g["process_pss_growth"] for g in procs),
        "lookup_p50_s": statistics.median(g["lookup_p50_s"] for g in procs),
        "builders": sum(1 for g in procs if g["built"]),
    }


def bench(table, tier, device, procs, batch, reps, rounds, threads=None) -> dict:
    from plestore.tablefile import TableFile
    from plestore.tiers.pinned import padded_stride

    tf = TableFile.open(table)
    stride = padded_stride(tf.layout.row_bytes) if tier == "pinned" else tf.layout.row_bytes
    table_bytes = tf.spec.rows * stride
    runs = run(table, tier, device, procs, batch, reps, rounds, threads)
    out: dict = {"table": str(table), "tier": tier, "device": device, "procs": procs}
    out.update(batch=batch, heads=tf.spec.heads, reps=reps, rounds=rounds, table_bytes=table_bytes)
    for share, name in (("none", "private"), ("node", "shared")):
        rs = runs[share]
        out[name] = {
            "copies": statistics.median(x["table_pss_sum"] for x in rs) / table_bytes,
            "table_pss_sum": statistics.median(x["table_pss_sum"] for x in rs),
            "process_pss_sum": statistics.median(x["process_pss_sum"] for x in rs),
            "process_pss_growth_sum": statistics.median(x["process_pss_growth_sum"] for x in rs),
            "lookup_p50_s": statistics.median(x["lookup_p50_s"] for x in rs),
            "builders": [x["builders"] for x in rs],
            "runs": rs,
        }
    digests = [[p["digest"] for p in x["procs"]] for s in runs for x in runs[s]]
    out["rows_exact"] = all(d == digests[0] for d in digests)
    out["lookup_ratio"] = out["private"]["lookup_p50_s"] / out["shared"]["lookup_p50_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="plestore bench shared", description=__doc__.split("\n\n")[0])
    ap.add_argument("table", help="a packed table (directory or .json)")
    ap.add_argument("--procs", type=int, default=2, help="processes on this node")
    ap.add_argument("--tier", default="pinned", choices=["pinned", "mapped"])
    ap.add_argument(
        "--device", help="cuda, cuda:each (process i on GPU i) or cpu (default: cuda if any)"
    )
    ap.add_argument("--batch", type=int, default=64, help="tokens per lookup")
    ap.add_argument("--reps", type=int, default=200, help="timed lookups per process")
    ap.add_argument("--rounds", type=int, default=2, help="repetitions of both modes")
    ap.add_argument("--threads", type=int, help="torch threads a process (default: cores / procs)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.procs < 1 or a.reps < 1 or a.rounds < 1 or a.batch < 1:
        ap.error("--procs, --batch, --reps and --rounds must be >= 1")
    if a.device is None:
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    res = {
        "machine": machine(),
        **bench(a.table, a.tier, a.device, a.procs, a.batch, a.reps, a.rounds, a.threads),
    }
    if a.json:
        print(json.dumps(res, indent=1))
        return 0
    mib = 2**20
    size = res["table_bytes"] / mib
    print(f"{a.procs} processes, {a.tier} tier on {a.device}, table {size:.1f} MiB")
    for name in ("private", "shared"):
        r = res[name]
        print(
            f"{name:8s} table PSS {r['table_pss_sum'] / mib:9.1f} MiB ({r['copies']:.2f} copies), "
            f"process PSS {r['process_pss_sum'] / mib:9.1f} MiB, lookup p50 "
            f"{r['lookup_p50_s'] * 1e3:.3f} ms"
        )
    print(f"rows exact: {res['rows_exact']}; lookup time private/shared {res['lookup_ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
