"""A table streamed from a cold file (the loop every load and every GPU row cache start runs),
as plestore streams it — the next piece read on a thread while this one is checked, its blocks
checked in one native call per piece — beside the loop it replaced (read, check with one
zlib.crc32 call per block, hand on; one after another), with and without block checks. Each
pass starts with the file evicted; seconds and GB/s of the data region.

    python benchmarks/probes/stream_load.py TABLE [--passes stream,stream-nocheck,serial,...]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from native_parts import _table  # (a probe beside this one)

from plestore.io.memory import evict
from plestore.tablefile import TableFile, checksums

PASSES = ("stream", "stream-nocheck", "serial-python", "serial-nocheck")


def serial(tf: TableFile, checks, chunk_bytes: int = 64 << 20) -> None:
    """The replaced loop: each piece read, checked, then handed on, one after another."""
    chunk = max(1, chunk_bytes // tf.layout.row_stride)
    fd = os.open(tf.data_path, os.O_RDONLY)
    try:
        for first in range(0, tf.spec.rows, chunk):
            tf.read_range(first, min(chunk, tf.spec.rows - first), fd, True, checks)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", help="a packed table, or a directory to write one in")
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--passes", default=",".join(PASSES))
    args = ap.parse_args()
    tf = TableFile.open(_table(Path(args.table), args.rows))
    native_load = checksums.native.load
    for name in args.passes.split(","):
        checks = None if name.endswith("nocheck") else tf.block_checks
        if name.endswith("python"):  # zlib per block, as before the native checks
            checksums.native.load = lambda mode="auto": None
        evict(tf.data_path.parent)
        t0 = time.perf_counter()
        try:
            if name.startswith("stream"):
                tf.stream(0, tf.spec.rows, lambda first, rows: None, checks)
            else:
                serial(tf, checks)
        finally:
            checksums.native.load = native_load
        s = time.perf_counter() - t0
        row = {"pass": name, "bytes": tf.data_bytes, "s": round(s, 2)}
        row["gb_s"] = round(tf.data_bytes / s / 1e9, 2)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
