"""The host step alone (a graph feed's post seen -> READY, timed inside the host core) beside a
DRAM bound measured in the same run: a plain compiled random gather of the same rows' bytes
from a copy of the table in memory, on one thread and on the pool (the rows split evenly
among its threads: where it wins past a size, the step's WARM_GRAIN should follow).

    plestore bench hoststep [TABLE] --json
    plestore bench hoststep TABLE --tiers mapped,direct --rows 16,1024 --steps 200

Warm: each size's id sets (uniform random rows) are read once before the timed steps, which
cycle through them, so the page cache and the direct tier's row cache hold every row. Every host
tier runs; `+gpu-cache` puts the GPU row cache's directory in front (it runs without a GPU: the
probe is the host's). Without TABLE a small synthetic table is packed in a temporary directory.
The JSON's rows: rows, tier, host-step time (median and p90: the core's step served in this
thread, alone), the bound (the faster of one thread and the pool), their ratio, and the same
step served by the feed's own thread as a graph posts it (fed_step_us: on a small CPU the
poster's polling shares the cores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from plestore.bench.report import machine
from plestore.native.constants import W_POSTED, C
from plestore.tablefile import DATA_OFFSET, TableFile

TIERS = "mapped,direct,pinned,cascade,mapped+gpu-cache"
SIZES = "16,128,1024,4096"
#: each tier's table options (the cascade: a pinned part and the file, no device part)
OPTIONS = {
    "cascade": lambda rb: dict(device_budget_bytes=0, pinned_budget_bytes=rb << 20),
    "mapped+gpu-cache": lambda rb: dict(gpu_cache_bytes=rb << 14),
}


def dram_bound(data: np.ndarray, tf: TableFile, ids: list, threads: int, reps: int) -> float:
    """Median seconds of one compiled gather of ids (cycling the sets) from data on `threads`."""
    from plestore import native

    core = native.load("auto")
    rpb, block, stride = native.layout_rule(tf.layout)
    rb = tf.layout.row_bytes
    out = np.empty((max(i.size for i in ids), rb), np.uint8)
    times = []
    for r in range(reps + len(ids)):
        rows = ids[r % len(ids)]
        t0 = time.perf_counter_ns()
        grain = -(-rows.size // threads)  # (the pool's threads a piece each)
        core.gather(data, rows, out, rb, rb, 0, rpb, block, stride, threads, grain, False, 0)
        if r >= len(ids):  # (each set once before: warm)
            times.append(time.perf_counter_ns() - t0)
    return float(np.median(times)) * 1e-9


def host_steps(path: str, tier: str, ids: list, steps: int, fed: bool) -> list[float]:
    """Each timed step's host time (s) of `tier` on the CPU, ids cycling: the host core's step
    served in this thread (alone), or by the feed's own thread as a graph posts it (fed)."""
    import torch

    import plestore
    from plestore import native

    name = tier.partition("+")[0]
    rb = TableFile.open(path).layout.row_bytes
    kw = OPTIONS[tier](rb) if tier in OPTIONS else {}
    with plestore.open_table(path, tier=name, device="cpu", **kw) as t:
        box = torch.zeros(ids[0].size, dtype=torch.int64)
        feed = t.staged((ids[0].size,), ids=box, feed=True)
        f, times = feed.feeder, []
        if not fed:
            f.stop()  # (its thread gone: this one serves each post)
            f.counters[C.STOP] = 0
        core, plan, words = native.load(t.options.tuning.native), f.plan().args, f.header.numpy()
        for s in range(steps + len(ids)):
            before = int(f.counters[C.STEP_NS])
            box.copy_(torch.from_numpy(ids[s % len(ids)]))
            feed.post()
            if fed:
                feed.decode()
            else:
                posted = int(words[W_POSTED])
                core.feed_serve(
                    words, f.counters, f.buffers, plan, posted - 1, 0, 0, 0.0, 0.0, 0.0, 0.0
                )
            t.check_feed()
            deadline = time.monotonic() + 1.0  # (the core adds the step's time after READY)
            while int(f.counters[C.STEP_NS]) == before and time.monotonic() < deadline:
                pass
            if s >= len(ids):
                times.append((int(f.counters[C.STEP_NS]) - before) * 1e-9)
    return times


def run(path: str, tiers: list[str], sizes: list[int], steps: int, sets: int) -> list[dict]:
    from plestore import native
    from plestore.io.memory import HostBuffer

    tf = TableFile.open(path)
    size = os.path.getsize(tf.data_path) - DATA_OFFSET
    buf = HostBuffer(size)  # the table in DRAM, huge pages where the kernel gives them
    with open(tf.data_path, "rb") as f:
        f.seek(DATA_OFFSET)
        f.readinto(buf.array)
    data = buf.array

    pool = native.memory_threads(len(os.sched_getaffinity(0)))
    rng = np.random.default_rng(0)
    out = []
    for n in sizes:
        ids = [rng.integers(0, tf.spec.rows, n, dtype=np.int64) for _ in range(sets)]
        one = dram_bound(data, tf, ids, 1, steps)
        pooled = dram_bound(data, tf, ids, pool, steps)
        bound = min(one, pooled)
        for tier in tiers:
            times = host_steps(path, tier, ids, steps, fed=False)
            fed = host_steps(path, tier, ids, steps, fed=True)
            med = float(np.median(times))
            out.append(
                {
                    "rows": n, "tier": tier, "row_bytes": tf.layout.row_bytes,
                    "host_step_us": med * 1e6,
                    "host_step_p90_us": float(np.percentile(times, 90)) * 1e6,
                    "bound_us": bound * 1e6, "bound_one_thread_us": one * 1e6,
                    "bound_pool_us": pooled * 1e6, "pool_threads": pool,
                    "ratio": med / bound, "steps": len(times),
                    "fed_step_us": float(np.median(fed)) * 1e6,
                }
            )  # fmt: skip
    return out


def _synthetic(work: Path) -> str:
    """A small packed table (the hoststep bench without a TABLE)."""
    from plestore.checkpoint import synth_checkpoint
    from plestore.tablefile.pack import pack_checkpoint

    ckpt, tables = work / "checkpoint", work / "tables"
    synth_checkpoint(
        ckpt, "qwen3.8-flash-next", "nvfp4", ngram_vocab_size_base=20000, hidden_size=64
    )
    pack_checkpoint(ckpt, tables, block_bytes=4096)
    return str(tables)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="plestore bench hoststep", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("table", nargs="?", help="a packed table (default: a small synthetic one)")
    ap.add_argument("--tiers", default=TIERS, help=f"comma-separated (default: {TIERS})")
    ap.add_argument("--rows", default=SIZES, help=f"rows a step, comma-separated ({SIZES})")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per tier and size")
    ap.add_argument("--sets", type=int, default=8, help="id sets a size cycles through")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    tiers = [t for t in a.tiers.split(",") if t]
    sizes = [int(n) for n in a.rows.split(",") if n]
    with tempfile.TemporaryDirectory(prefix="plestore-hoststep-") as work:
        path = a.table or _synthetic(Path(work))
        rows = run(path, tiers, sizes, a.steps, a.sets)
    res = {"machine": machine(), "table": a.table or "synthetic", "hoststep": rows}
    if a.json:
        print(json.dumps(res, indent=1))
        return 0
    for r in rows:
        print(
            f"{r['tier']:17s} {r['rows']:>5} rows: host step {r['host_step_us']:8.1f} us "
            f"(p90 {r['host_step_p90_us']:.1f}), DRAM bound {r['bound_us']:7.1f} us "
            f"(1 thread {r['bound_one_thread_us']:.1f}, {r['pool_threads']} threads "
            f"{r['bound_pool_us']:.1f}): {r['ratio']:.1f}x; fed {r['fed_step_us']:.1f} us"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
