"""Gather packed rows by index and decode them to bf16 (fp16 / fp32 rows: copied as they are) in
one pass — the reference in torch, the fast path in Triton.

    out[i] = decode(src[index[i] - row_offset])   if 0 <= index[i] - row_offset < row_count
    out[i] = 0                                     otherwise (another rank's row: never read)

With a second source (`src2`, `split`), rows r = index[i] - row_offset from `split` on are read
from src2[r - split] instead (same stride): a captured decode step through the GPU row cache
reads its hits from the cache in HBM and its misses from pinned staging in one launch, with no
copy in between.

`src` is uint8 [rows, stride] in device memory, in registered (pinned) host memory — the GPU then
reads it directly through unified virtual addressing — or, for the reference, anywhere.
The host path uses it with src = the rows staged for this lookup and index = which staged row
each output row decodes (-1 for another rank's ids).

Every format computes what `formats.RowFormat.decode_torch` computes, in the same order: products
of exactly representable factors in fp32, the one inexact product with an explicit
round-to-nearest PTX multiply (the compiler may not reassociate or fuse it), then one rounding to
bf16. tests/test_kernels.py checks bit identity on the GPU.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch

from plestore.formats import NF4_LEVELS, RowFormat, bf16_round
from plestore.kernels import announce_reference, triton_available

__all__ = ["gather_decode", "gather_decode_reference"]

_CODES = {"bf16": 0, "fp8_e4m3": 1, "nvfp4": 2, "fp8_ue8m0": 3, "nf4": 4, "fp16": 5, "fp32": 6}


def gather_decode_reference(
    src: torch.Tensor,
    index: torch.Tensor,
    row_offset: int,
    row_count: int,
    fmt: RowFormat,
    dim: int,
    scale: float,
    out: torch.Tensor,
    src2: torch.Tensor | None = None,
    split: int | None = None,
) -> torch.Tensor:
    """Plain torch: gather where src lives, decode with formats, move to out's device."""
    rb = fmt.row_bytes(dim)
    if src.shape[0] == 0 and src2 is None:  # no row of this rank was read: every row is another's
        return out.zero_()
    local = index.to(src.device) - row_offset
    valid = (local >= 0) & (local < row_count)
    if src2 is None:
        raw = torch.index_select(src, 0, torch.where(valid, local, 0))[:, :rb]  # [n, rb]
    else:  # (fixed shapes, no boolean indexing: capturable where both sources are on the GPU)
        second = local >= split
        raw = torch.where(
            second[:, None],
            torch.index_select(
                src2, 0, torch.where(valid & second, local - split, 0).to(src2.device)
            ).to(src.device),
            torch.index_select(src, 0, torch.where(valid & ~second, local, 0)),
        )[:, :rb]  # [n, rb]
    decoded = fmt.decode_torch(raw.contiguous(), scale, dim)  # [n, dim] bf16
    decoded = torch.where(valid[:, None], decoded, decoded.new_zeros(()))
    out.copy_(decoded)
    return out


def gather_decode(
    src: torch.Tensor,
    index: torch.Tensor,
    row_offset: int,
    row_count: int,
    fmt: RowFormat,
    dim: int,
    scale: float,
    out: torch.Tensor,
    src2: torch.Tensor | None = None,
    split: int | None = None,
) -> torch.Tensor:
    """The Triton kernel where out is on CUDA, else the reference. index: int64 [n] on out's
    device (or pinned); out: contiguous [n, dim] of the format's dtype (bf16 but for fp16 /
    fp32); src2 / split: see the module docstring."""
    if (src2 is None) != (split is None) or (src2 is not None and src2.stride() != src.stride()):
        raise ValueError("a second source needs a split and the first source's strides")
    if src2 is not None and (split > src.shape[0] or row_count - split > src2.shape[0]):
        raise ValueError(  # (the kernel would read past a source's end)
            f"rows [0, {split}) must be in src ({src.shape[0]} rows) and [{split}, {row_count}) "
            f"in src2 ({src2.shape[0]} rows)"
        )
    if not (out.is_cuda and triton_available()):
        if out.is_cuda:
            announce_reference("gather_decode")
        return gather_decode_reference(
            src, index, row_offset, row_count, fmt, dim, scale, out, src2, split
        )
    n = index.numel()
    if n == 0:
        return out
    if not out.is_contiguous() or out.dtype != fmt.torch_dtype or src.stride(1) != 1:
        raise ValueError(
            f"gather_decode needs a contiguous {fmt.torch_dtype} out and rows with unit stride"
        )
    grid = (triton.cdiv(n * dim, _BLOCK),)  # one program per _BLOCK output values
    _gather_decode_kernel[grid](
        src,
        src if src2 is None else src2,
        index,
        out,
        _nf4_lut(out.device),
        n,
        row_offset,
        row_count,
        row_count if split is None else split,
        src.stride(0),
        _kernel_scale(fmt.name, scale),
        TWO=src2 is not None,
        FORMAT=_CODES[fmt.name],
        DIM=dim,
        BLOCK=_BLOCK,
        num_warps=_WARPS,
    )
    return out


# output values per program and its warps: rows laid end to end, one lane a value, beat a
# program per 8 rows. measured: RESULTS.md "lookup: the decode kernel"
_BLOCK, _WARPS = 2048, 8
_LUTS: dict[torch.device, torch.Tensor] = {}


@cache
def _kernel_scale(name: str, scale: float) -> float:
    """The table scale as the kernel multiplies by it: fp32, and for fp8_e4m3 the engines'
    bf16(scale) (made once: numpy's rounding costs more than a launch)."""
    if name == "fp8_e4m3":
        scale = bf16_round(np.array([scale], np.float32))[0]
    return float(np.float32(scale))


def _nf4_lut(device: torch.device) -> torch.Tensor:
    if device not in _LUTS:
        _LUTS[device] = torch.from_numpy(NF4_LEVELS).to(device)
    return _LUTS[device]


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _mul_rn(a, b):
        # fp32 a*b rounded once to nearest even; opaque to reassociation and FMA contraction
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )

    @triton.jit
    def _e4m3(b):
        return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)

    # n / row_offset / row_count vary per call: no divisibility specialisation (recompiles)
    @triton.jit(do_not_specialize=["n", "row_offset", "row_count", "split"])
    def _gather_decode_kernel(
        src,
        src2,
        index,
        out,
        lut,
        n,
        row_offset,
        row_count,
        split,
        src_stride,
        scale,
        TWO: tl.constexpr,
        FORMAT: tl.constexpr,
        DIM: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # out viewed flat: every lane one output value, its row and column by division; each
        # value loads its own code / scale bytes (neighbouring lanes share them: one transaction)
        e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] output values
        emask = e < n.to(tl.int64) * DIM  # (n * DIM may pass 2**31)
        r = e // DIM  # [BLOCK] output row
        d = e % DIM  # [BLOCK] value index in the row
        row = tl.load(index + r, mask=emask, other=-1) - row_offset  # [BLOCK] source row
        present = emask & (row >= 0) & (row < row_count)
        row = tl.where(present, row, 0)
        if TWO:  # rows from `split` on live in the second source
            base = tl.where(row < split, src + row * src_stride, src2 + (row - split) * src_stride)
        else:
            base = src + row * src_stride  # [BLOCK] row start
        sc = tl.full([BLOCK], scale, tl.float32)
        if FORMAT == 0:  # bf16: one 16-bit load per value
            src16 = base.to(tl.pointer_type(tl.uint16))
            val = tl.load(src16 + d, mask=present, other=0).to(tl.bfloat16, bitcast=True)
        elif FORMAT == 1:  # fp8_e4m3 x bf16(table scale)
            val = _mul_rn(_e4m3(tl.load(base + d, mask=present, other=0)), sc).to(tl.bfloat16)
        elif FORMAT == 2:  # nvfp4: (fp4 x e4m3 block scale, exact) x fp32 table scale
            code = tl.load(base + d // 2, mask=present, other=0).to(tl.int32)
            nib = (code >> ((d & 1) * 4).to(tl.int32)) & 0xF  # value 2i = byte i's low nibble
            mag = nib & 7
            ex = mag >> 1
            half = (mag & 1).to(tl.float32) * 0.5
            pow2 = tl.where(ex == 3, 4.0, tl.where(ex == 2, 2.0, 1.0))
            fp4 = tl.where(ex == 0, half, (1.0 + half) * pow2)  # exact: 0, .5, 1, ..., 6
            # the sign goes in as a bit: negation may compile to 0 - x, which loses -0.0
            sign = ((nib >> 3) << 31).to(tl.uint32)
            fp4 = (fp4.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
            bs = _e4m3(tl.load(base + DIM // 2 + d // 16, mask=present, other=0))
            val = _mul_rn(_mul_rn(fp4, bs), sc).to(tl.bfloat16)
        elif FORMAT == 3:  # fp8_ue8m0: e4m3 x 2^(byte-127) via the fp32 exponent field
            v = _e4m3(tl.load(base + d, mask=present, other=0))
            sb = tl.load(base + DIM + d // 32, mask=present, other=0).to(tl.int32)
            val = _mul_rn(v, (sb << 23).to(tl.float32, bitcast=True)).to(tl.bfloat16)
        elif FORMAT == 5:  # fp16: one 16-bit load per value, stored as it is
            src16 = base.to(tl.pointer_type(tl.uint16))
            val = tl.load(src16 + d, mask=present, other=0).to(tl.float16, bitcast=True)
        elif FORMAT == 6:  # fp32: one 32-bit load per value (rows are 4-byte aligned)
            src32 = base.to(tl.pointer_type(tl.uint32))
            val = tl.load(src32 + d, mask=present, other=0).to(tl.float32, bitcast=True)
        else:  # nf4: LEVELS[code] x fp16 row scale
            code = tl.load(base + d // 2, mask=present, other=0).to(tl.int32)
            code = (code >> ((d & 1) * 4).to(tl.int32)) & 0xF
            level = tl.load(lut + code, mask=present, other=0.0)
            slo = tl.load(base + DIM // 2, mask=present, other=0).to(tl.uint16)
            shi = tl.load(base + DIM // 2 + 1, mask=present, other=0).to(tl.uint16)
            s = (slo | (shi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
            val = _mul_rn(level, s).to(tl.bfloat16)
        val = tl.where(present, val, tl.zeros_like(val))
        tl.store(out + e, val, mask=emask)
