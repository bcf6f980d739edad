"""The machine's physical limits, measured in the same run as the methods they bound.

- disk: O_DIRECT random reads of 512 B and 4 KiB at queue depth 1 and 64 (io_uring), as IOPS
  and mean latency; sequential O_DIRECT read bandwidth;
- PCIe: H2D bandwidth from pinned memory (one large copy);
- HBM: a resident gather of the same rows (index_select of 65,536 rows).
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from plestore.io.blockreader import BlockReader
from plestore.io.memory import HostBuffer, evict

__all__ = ["disk_limits", "h2d_bandwidth", "hbm_gather_s", "random_read_floor_s"]


def random_read_floor_s(
    path: str,
    count: int,
    unit: int,
    queue_depth: int = 64,
    seed: int = 0,
    idle_s: float = 0.0,
) -> float:
    """Seconds for `count` O_DIRECT reads of `unit` bytes at random aligned offsets of the file
    at the given queue depth (io_uring): what no method reading that many blocks can beat. The
    first queue's reads are prepared before the clock starts (a decode step's few reads are
    then timed as one io_uring_enter: the kernel's and the disk's time alone). idle_s: sleep
    this long first, as a decode loop's host may between steps."""
    size = os.path.getsize(path)
    offs = np.random.default_rng(seed).integers(0, size // unit, count) * unit
    buf = HostBuffer(min(count, 65536) * unit)
    out = buf.array.reshape(-1, unit)
    out.fill(0)  # its pages exist before the clock starts
    reader = BlockReader(path, unit, engine="auto", queue_depth=queue_depth)
    try:
        parts = [offs[a : a + len(out)] for a in range(0, count, len(out))]
        first = reader.start(parts[0], out[: len(parts[0])], submit=False)
        time.sleep(idle_s)
        t0 = time.perf_counter()
        reader.finish(first)
        for part in parts[1:]:
            reader.read(part, out[: len(part)])
        return time.perf_counter() - t0
    finally:
        reader.close()
        buf.close()


def disk_limits(path: str, count: int = 20000) -> dict:
    """IOPS and latency at QD1/QD64 for 512 B and 4 KiB, plus sequential read GB/s."""
    out: dict = {}
    for unit in (512, 4096):
        for qd in (1, 64):
            n = count if qd > 1 else max(1000, count // 10)
            try:
                s = random_read_floor_s(path, n, unit, qd, seed=qd * unit)
            except OSError as e:
                out[f"disk_{unit}B_qd{qd}_error"] = str(e)
                continue
            out[f"disk_{unit}B_qd{qd}_iops"] = n / s
            out[f"disk_{unit}B_qd{qd}_latency_us"] = s / n * 1e6 * (qd if qd > 1 else 1)
    evict(path)
    size = min(os.path.getsize(path), 4 << 30) // (1 << 20) * (1 << 20)
    chunk = 16 << 20
    buf = HostBuffer(chunk)
    reader = BlockReader(path, chunk, engine="auto", queue_depth=8)
    try:
        offs = np.arange(0, size - chunk + 1, chunk, dtype=np.int64)
        t0 = time.perf_counter()
        for o in offs:
            reader.read(np.array([o]), buf.array.reshape(1, chunk))
        out["disk_seq_read_gbs"] = len(offs) * chunk / (time.perf_counter() - t0) / 1e9
    finally:
        reader.close()
        buf.close()
    return out


def h2d_bandwidth(nbytes: int = 1 << 30) -> float:
    """GB/s of one pinned -> device copy (median of 5)."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    ts = []
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return nbytes / float(np.median(ts[1:])) / 1e9


def hbm_gather_s(rows: int = 65536, row_bytes: int = 160, table_rows: int = 10**7) -> float:
    """Seconds of a resident index_select of `rows` random rows (median of 20)."""
    table = torch.empty((table_rows, row_bytes), dtype=torch.uint8, device="cuda")
    idx = torch.randint(0, table_rows, (rows,), device="cuda")
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ts = []
    for _ in range(21):
        ev[0].record()
        torch.index_select(table, 0, idx)
        ev[1].record()
        ev[1].synchronize()
        ts.append(ev[0].elapsed_time(ev[1]) / 1e3)
    return float(np.median(ts[1:]))
