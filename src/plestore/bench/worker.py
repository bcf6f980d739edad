"""One cold lookup in a fresh process:
`python -m plestore.bench.worker TABLE METHOD IDS.npy DEVICE`.

Warms the process's own machinery first (kernel compiles, thread pools, allocators) on a small
copy of the table's first rows in a temporary directory, then evicts the table file from the page
cache (no mapping of it is alive: this process has just started and unmapped the copy), opens the
method on it, times its first lookup and prints {"seconds": ...} as JSON.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

import numpy as np
import torch

from plestore.bench.lookup import evict
from plestore.bench.methods import make_method
from plestore.tablefile import TableFile, TableWriter


def _warm_up(tf: TableFile, method: str, dev: torch.device, n: int) -> None:
    """Run the method once on a 4,096-row copy of the table (another file)."""
    rows = min(4096, tf.spec.rows)
    with tempfile.TemporaryDirectory() as d:
        with TableWriter(d, tf.spec.replace(rows=rows, hash=None), tf.layout) as w:
            w.write_rows(tf.read_range(0, rows))
            small = w.commit()
        m = make_method(method, small, dev)
        try:
            m.lookup(np.random.default_rng(0).integers(0, rows, n))
        finally:
            m.close()


def main(argv: list[str]) -> int:
    table, method, ids_path, device = argv
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=dev)  # context creation stays out of the timing
    tf = TableFile.open(table)
    ids = np.load(ids_path, allow_pickle=False)
    _warm_up(tf, method, dev, len(ids))
    evict(str(tf.data_path))
    m = make_method(method, tf, dev)
    try:
        t0 = time.perf_counter()
        m.lookup(ids)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - t0
    finally:
        m.close()
    print(json.dumps({"seconds": seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
