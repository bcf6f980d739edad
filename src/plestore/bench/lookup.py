"""`plestore bench lookup`: every method x workload, warm and cold, against the limits.

Warm: in this process, after one warm-up call, the median of `reps` calls. Cold: a fresh
process per (method, workload) — the table file evicted with POSIX_FADV_DONTNEED, no live
mapping of it anywhere — timing the first lookup. Every method's output is compared with the
resident reference (decode of the file's bytes) before it is timed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from plestore.bench.methods import make_method
from plestore.bench.workloads import WORKLOADS, row_ids
from plestore.formats import get_format
from plestore.tablefile import TableFile

__all__ = ["LookupResult", "run_lookup_bench", "time_lookup"]


@dataclass
class LookupResult:
    method: str
    workload: str
    dist: str
    rows: int
    unique: int
    warm_ms: float | None = None
    cold_ms: float | None = None
    exact: bool | None = None
    pcie_floor_ms: float | None = None  # packed bytes / H2D bandwidth
    disk_floor_ms: float | None = None  # `unique` O_DIRECT 4 KiB reads at QD64
    # plestore host tiers: the tier's read() alone into pinned staging, warm (the host gather,
    # or the direct tier's cache probe) — with the native core, the host's own bound
    read_ms: float | None = None
    note: str = ""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_lookup(method, ids: np.ndarray, reps: int) -> float:
    """Median seconds of method.lookup(ids), the device synchronised around each call."""
    ts = []
    for _ in range(reps):
        _sync(method.device)
        t0 = time.perf_counter()
        method.lookup(ids)
        _sync(method.device)
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def _median_s(fn, ids: np.ndarray, reps: int) -> float:
    fn(ids)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(ids)
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def _exact(method, tf: TableFile, ids: np.ndarray) -> bool:
    fmt = get_format(tf.spec.format)
    want = fmt.decode_numpy(tf.read_rows(ids), tf.spec.scale)  # [n, dim] float32 of bf16
    got = method.lookup(ids).float().cpu().numpy()
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    return bool(same.all())


def _cold(table: str, method: str, ids: np.ndarray, device: str) -> float:
    """First-lookup seconds in a fresh process with the table evicted."""
    with tempfile.NamedTemporaryFile(suffix=".npy", delete=False) as f:
        np.save(f, ids)
    try:
        cmd = [sys.executable, "-m", "plestore.bench.worker", table, method, f.name, device]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if out.returncode:
            raise RuntimeError(f"cold worker for {method} failed: {out.stderr.strip()[-500:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]
    finally:
        os.unlink(f.name)


def run_lookup_bench(
    table: str,
    methods: list[str],
    workloads: list[str],
    dists: list[str],
    device: torch.device,
    limits: dict,
    reps: int = 20,
    cold: bool = True,
    log: Callable[[str], None] = print,
    text: str | None = None,
) -> list[LookupResult]:
    """Warm times for every (method, workload, dist); cold times (uniform ids) for the
    workloads in `cold` on the methods that read storage; floors from `limits`."""
    from plestore.bench.limits import random_read_floor_s

    tf = TableFile.open(table)
    cases = {
        (w, d): row_ids(tf.spec, WORKLOADS[w], d, seed=1, text=text)
        for w in workloads
        for d in dists
    }
    results: dict[tuple, LookupResult] = {}
    for (w, d), ids in cases.items():
        uniq = int(np.unique(ids).size)
        r = LookupResult("-", w, d, ids.size, uniq)
        if "h2d_gbs" in limits:
            r.pcie_floor_ms = ids.size * tf.layout.row_bytes / (limits["h2d_gbs"] * 1e9) * 1e3
        try:
            r.disk_floor_ms = random_read_floor_s(str(tf.data_path), uniq, 4096, 64) * 1e3
        except OSError as e:
            r.note = f"no disk floor: {e}"
        results[(w, d)] = r
    rows = []
    for name in methods:
        t0 = time.perf_counter()
        try:
            m = make_method(name, tf, device)
        except (OSError, RuntimeError, ValueError) as e:
            log(f"{name}: unavailable ({e})")
            continue
        log(f"{name}: opened in {time.perf_counter() - t0:.1f} s")
        try:
            exact = _exact(m, tf, next(iter(cases.values()))[:4096])
            for (w, d), ids in cases.items():
                r = LookupResult(**{**asdict(results[(w, d)]), "method": name, "exact": exact})
                m.lookup(ids)  # warm-up: page cache, caches, kernels
                r.warm_ms = time_lookup(m, ids, reps if ids.size < 20000 else max(3, reps // 4))
                r.warm_ms *= 1e3
                if getattr(m, "read_alone", None) is not None:
                    r.read_ms = _median_s(m.read_alone, ids, reps) * 1e3
                rows.append(r)
            disk = m.disk
        finally:
            m.close()
        if disk:
            for r in rows:
                if r.method == name and r.workload in cold and r.dist == "uniform":
                    ids = cases[(r.workload, r.dist)]
                    r.cold_ms = _cold(table, name, ids, str(device)) * 1e3
        log(f"{name}: done ({'exact' if exact else 'NOT EXACT'})")
    return rows
