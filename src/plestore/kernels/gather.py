"""Gather packed rows by id into a device buffer — from device memory or from pinned host memory
(the GPU reads registered host memory directly through unified virtual addressing).

`gather_rows_reference` is the plain torch version the kernel is tested against.
"""

from __future__ import annotations

import torch

from plestore.kernels import triton_available

__all__ = ["gather_rows", "gather_rows_reference"]


def gather_rows_reference(src: torch.Tensor, rows: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """uint8 [n, row_bytes]: src[rows, :row_bytes], computed where src lives."""
    out = torch.index_select(src, 0, rows.to(src.device))[:, :row_bytes]
    return out.contiguous()


def _word_dtype(*sizes: int) -> torch.dtype:
    for nbytes, dt in ((4, torch.int32), (2, torch.int16)):
        if all(s % nbytes == 0 for s in sizes):
            return dt
    return torch.uint8


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _gather_rows_kernel(
        src,
        rows,
        out,
        n,
        src_stride,
        out_stride,
        WORDS: tl.constexpr,
        BLOCK_W: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        # one program copies ROWS rows of WORDS words each; strides are in words
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
        rmask = r < n
        row = tl.load(rows + r, mask=rmask, other=-1)  # [ROWS] int64 source row
        rmask = rmask & (row >= 0)  # negative: an absent row, never read
        w = tl.arange(0, BLOCK_W)  # [BLOCK_W]
        m = rmask[:, None] & (w[None, :] < WORDS)  # [ROWS, BLOCK_W]
        vals = tl.load(src + row[:, None] * src_stride + w[None, :], mask=m)
        tl.store(out + r[:, None] * out_stride + w[None, :], vals, mask=m)


def gather_rows(
    src: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, rows_per_program: int = 16
) -> None:
    """out[i, :] = src[rows[i], :out.shape[1]] on the GPU (rows[i] < 0: out[i] untouched).

    src: uint8 [R, stride] on the device or in registered (pinned) host memory.
    rows: int64 [n] on the device (local row indices). out: uint8 [>= n, row_bytes] on the device.
    """
    n = rows.numel()
    if n == 0:
        return
    rb = out.shape[1]
    stride = src.stride(0)
    dt = _word_dtype(rb, stride, out.stride(0))
    size = torch.tensor([], dtype=dt).element_size()
    words = rb // size
    _gather_rows_kernel[(triton.cdiv(n, rows_per_program),)](
        src.view(dt),
        rows,
        out.view(dt),
        n,
        stride // size,
        out.stride(0) // size,
        WORDS=words,
        BLOCK_W=triton.next_power_of_2(words),
        ROWS=rows_per_program,
    )
