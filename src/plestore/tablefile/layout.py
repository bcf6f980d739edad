"""Where rows lie in the data region, and the checksums of its chunks.

`place` lays a run of rows out as data-region bytes (block padding included, so consecutive
batches abut); `unplace` is its inverse; `crc32_combine` joins the CRC-32s that workers compute
on their own rows.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from plestore.spec import RowLayout

__all__ = ["PreparedRows", "crc32_combine", "place_bytes"]


def next_offset(layout: RowLayout, row: int, total_rows: int) -> int:
    """Data-region offset where row `row` starts, or the data end when row == total_rows."""
    if row >= total_rows:
        return layout.data_bytes(total_rows)
    return int(layout.offsets(np.array([row]))[0])


def place(
    layout: RowLayout, rows: np.ndarray, first: int, total_rows: int, out: np.ndarray | None = None
) -> np.ndarray:
    """Lay rows [first, first+n) out as the data region bytes from the first row's offset up to
    the next row's offset (or the data end): block padding included, so consecutive batches
    abut and every byte of the data region belongs to exactly one batch. `out` (uint8, at least
    `place_bytes` long) is used instead of a new buffer."""
    n, rb = rows.shape
    rpb = layout.rows_per_block
    end = next_offset(layout, first + n, total_rows)
    start = next_offset(layout, first, total_rows)
    if rpb == 0:  # unblocked, or one row per whole-block span
        pitch = layout.row_stride if layout.block_bytes == 0 else layout.row_span
        if pitch == rb:
            return rows.reshape(-1)  # back to back: the rows are the bytes
        buf = _zeros(n * pitch, out).reshape(n, pitch)  # [n, pitch]
        buf[:, :rb] = rows
        return buf.reshape(-1)[: end - start]
    b0 = first // rpb
    nb = -(-(end - b0 * layout.block_bytes) // layout.block_bytes)
    blocks = _zeros(nb * layout.block_bytes, out).reshape(nb, -1)  # [blocks, block_bytes]
    grid = blocks[:, : rpb * layout.row_stride].reshape(nb, rpb, layout.row_stride)  # view
    p0 = first - b0 * rpb  # slot of the first row within block b0
    h = min(n, rpb - p0)  # rows in the (partial) head block
    grid[0, p0 : p0 + h, :rb] = rows[:h]
    m = (n - h) // rpb  # full blocks
    grid[1 : 1 + m, :, :rb] = rows[h : h + m * rpb].reshape(m, rpb, rb)
    t = n - h - m * rpb  # rows in the tail block
    if t:
        grid[1 + m, :t, :rb] = rows[h + m * rpb :]
    lo = start - b0 * layout.block_bytes
    return blocks.reshape(-1)[lo : lo + end - start]


def place_bytes(layout: RowLayout, rows: int) -> int:
    """The most bytes `place` lays out for `rows` rows starting anywhere (its `out` size)."""
    if layout.rows_per_block == 0:
        pitch = layout.row_stride if layout.block_bytes == 0 else layout.row_span
        return rows * pitch
    return (-(-rows // layout.rows_per_block) + 1) * layout.block_bytes


def _zeros(size: int, out: np.ndarray | None) -> np.ndarray:
    if out is None:
        return np.zeros(size, np.uint8)
    if out.size < size:
        raise ValueError(f"layout buffer holds {out.size} bytes, {size} needed")
    buf = out[:size]
    buf.fill(0)
    return buf


def unplace(layout: RowLayout, buf: np.ndarray, first: int, n: int) -> np.ndarray:
    """Inverse of place: [n, row_bytes] view of rows [first, first+n) in buf, which holds the
    data region from row `first`'s offset to at least the last row's end."""
    rb, rpb = layout.row_bytes, layout.rows_per_block
    if rpb == 0:
        pitch = layout.row_stride if layout.block_bytes == 0 else layout.row_span
        full = np.zeros(n * pitch, np.uint8)
        full[: buf.size] = buf[: n * pitch]
        return full.reshape(n, pitch)[:, :rb]
    b0 = first // rpb
    lo = (first - b0 * rpb) * layout.row_stride
    nb = -(-(lo + buf.size) // layout.block_bytes)
    blocks = np.zeros(nb * layout.block_bytes, np.uint8)
    blocks[lo : lo + buf.size] = buf
    grid = blocks.reshape(nb, layout.block_bytes)[:, : rpb * layout.row_stride]
    slots = grid.reshape(nb, rpb, layout.row_stride).reshape(nb * rpb, layout.row_stride)
    p0 = first - b0 * rpb
    return slots[p0 : p0 + n, :rb]


@dataclass(frozen=True)
class PreparedRows:
    """Rows laid out and checksummed, ready for `TableWriter.write_prepared` (see prepare)."""

    first_row: int
    num_rows: int
    start: int  # data-region offset of data[0]
    data: np.ndarray  # uint8, the data region bytes [start, start + data.size)
    pieces: tuple[tuple[int, int], ...]  # (length, crc32) split at checksum-chunk boundaries
    block_crcs: Any = None  # checksums.UnitCrcs: the CRC-32 of each block (the .crc sidecar)


def crc_pieces(data: np.ndarray, start: int, chunk_bytes: int) -> tuple[tuple[int, int], ...]:
    out, pos, view = [], start, memoryview(data)
    while len(view):
        room = chunk_bytes - pos % chunk_bytes
        part, view = view[:room], view[room:]
        out.append((len(part), zlib.crc32(part)))
        pos += len(part)
    return tuple(out)


def _gf2_times(mat: list[int], vec: int) -> int:
    s, i = 0, 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A+B from crc(A), crc(B) and len(B) (zlib's crc32_combine, which Python's zlib
    does not expose). Lets workers checksum their own rows in parallel.

    CRC-32 is linear over GF(2): appending len2 zero bytes to A is a 32x32 bit matrix applied to
    crc(A), built once per length (a pack's batches share one)."""
    return _gf2_times(_zeros_operator(len2), crc1) ^ crc2


@functools.lru_cache(maxsize=64)
def _zeros_operator(len2: int) -> tuple[int, ...]:
    """The matrix appending len2 zero bytes: square-and-multiply from the one-zero-byte one."""
    op = [0xEDB88320] + [1 << (n - 1) for n in range(1, 32)]  # append one zero bit
    for _ in range(3):
        op = [_gf2_times(op, v) for v in op]  # 2, 4, 8 bits: one zero byte
    out = [1 << n for n in range(32)]  # identity
    while len2 > 0:
        if len2 & 1:
            out = [_gf2_times(op, v) for v in out]
        len2 >>= 1
        if len2:
            op = [_gf2_times(op, v) for v in op]  # twice as many zero bytes
    return tuple(out)


def rows_within(layout: RowLayout, rows: int, lo: int, hi: int) -> tuple[int, int]:
    """[first, last] of the table's `rows` rows with bytes in data-region bytes [lo, hi)."""
    return first_row_ending_after(layout, rows, lo), last_row_starting_before(layout, rows, hi - 1)


def first_row_ending_after(layout: RowLayout, rows: int, byte: int) -> int:
    lo, hi = 0, rows - 1
    while lo < hi:  # smallest row whose last byte >= byte
        mid = (lo + hi) // 2
        if int(layout.offsets(np.array([mid]))[0]) + layout.row_bytes - 1 >= byte:
            hi = mid
        else:
            lo = mid + 1
    return lo


def last_row_starting_before(layout: RowLayout, rows: int, byte: int) -> int:
    lo, hi = 0, rows - 1
    while lo < hi:  # largest row whose first byte <= byte
        mid = (lo + hi + 1) // 2
        if int(layout.offsets(np.array([mid]))[0]) <= byte:
            lo = mid
        else:
            hi = mid - 1
    return lo
