"""One cold lookup in a fresh process:
`python -m plestore.bench.worker TABLE METHOD IDS.npy DEVICE`.

Evicts the table file from the page cache (no mapping of it is alive: the process has just
started), opens the method, warms its machinery (kernel compiles, thread pools, staging buffers)
with a lookup of as many other random rows, then times the lookup of the measured rows — still
on the disk — and prints {"seconds": ...} as JSON.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch

from plestore.bench.methods import make_method
from plestore.io.memory import evict
from plestore.tablefile import TableFile


def _warm_up(m, tf: TableFile, ids: np.ndarray) -> None:
    """One lookup of as many *other* random rows: compiles kernels, starts thread pools, sizes
    staging buffers. The rows it reads are not the measured ones, which stay on the disk."""
    rng = np.random.default_rng(1)
    others = rng.integers(0, tf.spec.rows, len(ids))
    others = others[~np.isin(others, ids)]
    if len(others):
        m.lookup(others)


def main(argv: list[str]) -> int:
    table, method, ids_path, device = argv
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=dev)  # context creation stays out of the timing
    tf = TableFile.open(table)
    ids = np.load(ids_path, allow_pickle=False)
    evict(str(tf.data_path))
    m = make_method(method, tf, dev)
    try:
        _warm_up(m, tf, ids)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
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
