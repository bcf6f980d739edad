"""Triton decode + scatter: packed rows -> bf16 output rows, one kernel for all formats.

Every format computes exactly what `formats.RowFormat.decode_torch` does, in the same order and
precision (fp32 products of exactly representable factors, one final round to bf16), so the
output is bit-identical to the reference; `tests/test_kernels.py` checks it on the GPU.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from plestore.formats import NF4_LEVELS, RowFormat, bf16_round

__all__ = ["decode_scatter", "supports"]

_CODES = {"bf16": 0, "fp8_e4m3": 1, "nvfp4": 2, "fp8_ue8m0": 3, "nf4": 4}
_ROWS = 8  # output rows per program
_MAX_BLOCK_D = 1024  # values per program along the row


def supports(fmt: RowFormat) -> bool:
    return fmt.name in _CODES


@triton.jit
def _e4m3_to_f32(b):
    return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _decode_scatter_kernel(
    raw,
    inverse,
    out,
    lut,
    n,
    scale,
    FORMAT: tl.constexpr,
    DIM: tl.constexpr,
    RB: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS] output rows
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D] value index
    rmask = r < n
    src = tl.load(inverse + r, mask=rmask, other=-1)  # [ROWS] packed row, -1 = absent
    present = rmask & (src >= 0)
    m = present[:, None] & (d[None, :] < DIM)  # [ROWS, BLOCK_D]
    base = raw + src[:, None] * RB  # [ROWS, 1] row start (uint8 pointer)
    if FORMAT == 0:  # bf16: two bytes per value, little endian
        lo = tl.load(base + 2 * d[None, :], mask=m, other=0).to(tl.uint16)
        hi = tl.load(base + 2 * d[None, :] + 1, mask=m, other=0).to(tl.uint16)
        val = (lo | (hi << 8)).to(tl.bfloat16, bitcast=True)
    elif FORMAT == 1:  # fp8_e4m3 x bf16(table scale)
        v = _e4m3_to_f32(tl.load(base + d[None, :], mask=m, other=0))
        val = (v * scale).to(tl.bfloat16)
    elif FORMAT == 2:  # nvfp4: fp4 * e4m3 block scale (exact), then * fp32 table scale
        byte = tl.load(base + d[None, :] // 2, mask=m, other=0).to(tl.int32)
        nib = (byte >> ((d[None, :] % 2) * 4)) & 0xF
        mag = nib & 7
        e = mag >> 1
        half = (mag & 1).to(tl.float32) * 0.5
        pow2 = tl.where(e == 3, 4.0, tl.where(e == 2, 2.0, 1.0))  # exact, unlike exp2.approx
        fp4 = tl.where(e == 0, half, (1.0 + half) * pow2)
        fp4 = tl.where(nib >= 8, -fp4, fp4)
        bs = _e4m3_to_f32(tl.load(base + DIM // 2 + d[None, :] // 16, mask=m, other=0))
        val = ((fp4 * bs) * scale).to(tl.bfloat16)
    elif FORMAT == 3:  # fp8_ue8m0: e4m3 * 2^(byte-127) via the fp32 exponent field
        v = _e4m3_to_f32(tl.load(base + d[None, :], mask=m, other=0))
        sb = tl.load(base + DIM + d[None, :] // 32, mask=m, other=0).to(tl.int32)
        s = (sb << 23).to(tl.float32, bitcast=True)
        val = (v * s).to(tl.bfloat16)
    else:  # nf4: LEVELS[code] * fp16 row scale
        byte = tl.load(base + d[None, :] // 2, mask=m, other=0).to(tl.int32)
        code = (byte >> ((d[None, :] % 2) * 4)) & 0xF
        level = tl.load(lut + code, mask=m, other=0.0)
        slo = tl.load(base + DIM // 2 + tl.zeros_like(d)[None, :], mask=m, other=0).to(tl.uint16)
        shi = tl.load(base + DIM // 2 + 1 + tl.zeros_like(d)[None, :], mask=m, other=0)
        s = (slo | (shi.to(tl.uint16) << 8)).to(tl.float16, bitcast=True).to(tl.float32)
        val = (level * s).to(tl.bfloat16)
    val = tl.where(m, val, 0.0).to(tl.bfloat16)
    omask = rmask[:, None] & (d[None, :] < DIM)
    tl.store(out + r[:, None] * DIM + d[None, :], val, mask=omask)


_LUTS: dict[torch.device, torch.Tensor] = {}


def decode_scatter(
    raw: torch.Tensor,
    inverse: torch.Tensor,
    fmt: RowFormat,
    dim: int,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """raw: uint8 [u, row_bytes] (contiguous); inverse: int64 [N]; out: bf16 [N, dim]."""
    n = inverse.numel()
    if n == 0:
        return out
    if not (raw.is_contiguous() and out.is_contiguous() and out.dtype == torch.bfloat16):
        raise ValueError("decode_scatter needs contiguous raw rows and a contiguous bf16 output")
    if fmt.name == "fp8_e4m3":
        scale = float(bf16_round(np.array([scale], np.float32))[0])  # the engines' bf16(scale)
    else:
        scale = float(np.float32(scale))
    lut = _LUTS.get(raw.device)
    if lut is None:
        lut = _LUTS[raw.device] = torch.from_numpy(NF4_LEVELS).to(raw.device)
    block_d = min(triton.next_power_of_2(dim), _MAX_BLOCK_D)
    grid = (triton.cdiv(n, _ROWS), triton.cdiv(dim, block_d))
    _decode_scatter_kernel[grid](
        raw,
        inverse,
        out,
        lut,
        n,
        scale,
        FORMAT=_CODES[fmt.name],
        DIM=dim,
        RB=fmt.row_bytes(dim),
        ROWS=_ROWS,
        BLOCK_D=block_d,
    )
    return out
