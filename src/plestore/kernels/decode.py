"""Decode packed rows and scatter them to their output positions in one pass.

out[i] = decode(raw[inverse[i]]) for inverse[i] >= 0, and zeros where inverse[i] < 0 (rows
another rank owns). `decode_scatter_reference` is built on `formats.RowFormat.decode_torch`,
which is bit-identical to the numpy decode; the Triton kernel is tested against it.
"""

from __future__ import annotations

import torch

from plestore.formats import RowFormat

__all__ = ["decode_scatter", "decode_scatter_reference"]


def decode_scatter_reference(
    raw: torch.Tensor,
    inverse: torch.Tensor,
    fmt: RowFormat,
    dim: int,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """raw: uint8 [u, row_bytes]; inverse: int64 [N]; out: bf16 [N, dim] (same device)."""
    u = raw.shape[0]
    decoded = fmt.decode_torch(raw, scale, dim)  # [u, dim] bf16
    padded = torch.cat([decoded, decoded.new_zeros(1, dim)])  # row u = zeros (absent)
    idx = torch.where(inverse < 0, u, inverse)
    torch.index_select(padded, 0, idx, out=out)
    return out


def decode_scatter(
    raw: torch.Tensor,
    inverse: torch.Tensor,
    fmt: RowFormat,
    dim: int,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """The fastest available implementation (the Triton kernel on CUDA, else the reference)."""
    if raw.is_cuda:
        from plestore.kernels import decode_triton

        if decode_triton.supports(fmt):
            return decode_triton.decode_scatter(raw, inverse, fmt, dim, scale, out)
    return decode_scatter_reference(raw, inverse, fmt, dim, scale, out)
