"""Tables for the tier tests: real table files of encoded N(0,1) rows, and the rows a lookup
must return (a resident gather + decode)."""

from __future__ import annotations

import numpy as np

from plestore.formats import get_format
from plestore.spec import RowLayout, TableSpec
from plestore.tablefile import TableWriter

TIERS = ["device", "pinned", "mapped", "direct"]
FORMATS = {
    "bf16": 64,
    "fp8_e4m3": 160,
    "nvfp4": 160,
    "fp8_ue8m0": 256,
    "nf4": 160,
    "fp16": 64,
    "fp32": 32,
}
ROWS = 3000


def make_table(path, fmt_name, dim, rows=ROWS, block=4096, seed=0):
    """A real table file of encoded N(0,1) rows; returns (dir, reference decode of every row)."""
    fmt = get_format(fmt_name)
    x = np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32)
    enc = fmt.encode(x)
    spec = TableSpec(name="t", rows=rows, dim=dim, format=fmt_name, scale=enc.scale, heads=4)
    with TableWriter(path, spec, RowLayout(spec.row_bytes, block_bytes=block)) as w:
        w.write_rows(enc.rows[: rows // 3])
        w.write_rows(enc.rows[rows // 3 :])
        w.commit()
    return path, fmt.decode(enc.rows, scale=enc.scale)  # [rows, dim] float32 of bf16 values


def random_bytes_table(path, spec: TableSpec, seed: int, block: int = 512) -> np.ndarray:
    """A real table file of random packed rows (any bytes: every format decodes them); returns
    them, uint8 [rows, row_bytes]."""
    data = np.random.default_rng(seed).integers(0, 256, (spec.rows, spec.row_bytes), np.uint8)
    with TableWriter(path, spec, RowLayout(spec.row_bytes, block_bytes=block)) as w:
        w.write_rows(data)
        w.commit()
    return data


def resident_rows(ref, ids, absent=None):
    """The rows of `ids` from the reference decode; `absent` ids (another rank's) as zeros."""
    flat = np.asarray(ids).reshape(-1)
    out = ref[flat].copy()
    if absent is not None:
        out[absent.reshape(-1)] = 0
    return out.reshape(*np.asarray(ids).shape[:-1], -1)
