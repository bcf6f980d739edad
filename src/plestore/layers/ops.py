"""Deterministic building blocks for the layer modules.

The PLE and Engram layers must give the same bits for a token whether it arrives in one unsplit
prefill, in a chunk, or alone in a decode step, mixed with any other requests. Plain torch ops
do not promise that:

* reductions (`sum`, `mean`) pick their accumulation order from the tensor's shape, alignment
  and device; we sum over the last axis with a fixed pairwise tree instead (`tree_sum`);
* matmuls pick kernels by the number of rows (measured on this project's AMD EPYC dev box,
  torch 2.13 CPU: fp32 `F.linear`, 57 rows x 320 outputs, 15,987 of 18,240 outputs differ
  between one call per row and one call for all rows); we always multiply blocks of the same
  number of rows, `LINEAR_BLOCK_ROWS` for the device (`rows_invariant_linear`);
* vectorised transcendental functions on CPU differ from their scalar tail loop (same box:
  over 3,451 elements taken as slices at varying offsets, fp32 `torch.sigmoid` differs by 1 ulp
  in 10, bf16 `torch.rsqrt` in 212, float64 `torch.sigmoid` in 6); we compute the reciprocal
  square root as `1 / sqrt` (both IEEE correctly rounded) and sigmoid in float64, rounding
  once to the target dtype, so a 1-ulp float64 difference survives only at a rounding tie
  (about 2^-29 per element for fp32 targets, 2^-45 for bf16).

Everything else is elementwise IEEE arithmetic (+, *, /, sqrt, casts), which gives the same bits
at any position, in any batch, on CPU and CUDA alike.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "LINEAR_BLOCK_ROWS",
    "history_index",
    "ragged_positions",
    "rows_invariant_linear",
    "sigmoid64",
    "signed_sqrt_gate",
    "tree_sum",
]

# Rows per GEMM in rows_invariant_linear, per device type; fixed per device, never per call, so
# a row's result cannot depend on the batch it came in.
# cpu 16: decode (1 row) is fastest at 16 rows a GEMM on a CPU (the real key_proj, bf16
#   [10240, 2560]); at 128-512 rows no size is consistently ahead. Decode decides.
# cuda 256: each GEMM re-reads the whole weight (52 MB for key_proj), so an 8k-token prefill
#   costs 32 weight reads at 256 rows vs 128 at 64; padding a decode step to 256 rows adds
#   ~13 GFLOP, little for a GPU. (Neither is in RESULTS.md yet.)
LINEAR_BLOCK_ROWS = {"cpu": 16, "cuda": 256}
_DEFAULT_BLOCK_ROWS = 64


def tree_sum(x: Tensor) -> Tensor:
    """Sum over the last axis in a fixed pairwise order: pad to a power of two with zeros, then
    add the upper half onto the lower half until one column is left. The order depends only on
    the axis length, never on the other axes, the memory layout or the device."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = torch.nn.functional.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def rows_invariant_linear(x: Tensor, weight: Tensor, block_rows: int | None = None) -> Tensor:
    """`x @ weight.T` for x [T, in], weight [out, in], where every row is computed by a GEMM of
    exactly `block_rows` rows (zero-padded; default `LINEAR_BLOCK_ROWS` of x's device type), so
    a row's result does not depend on T.

    On CUDA this relies on cuBLAS picking the same kernel for the same shape, dtype and
    alignment (its heuristics take nothing else), and on a tiled GEMM computing each output
    from its own row and column only, so a row's place in the block does not matter (checked
    on CPU; the GPU case is what the cuda-parametrised tests check)."""
    if block_rows is None:
        block_rows = LINEAR_BLOCK_ROWS.get(x.device.type, _DEFAULT_BLOCK_ROWS)
    t, width = x.shape
    blocks = -(-t // block_rows)
    padded = x.new_zeros(blocks * block_rows, width)  # [B*rows, in], fresh and aligned
    padded[:t] = x
    wt = weight.t()
    outs = [padded[b * block_rows : (b + 1) * block_rows] @ wt for b in range(blocks)]
    if not outs:
        return x.new_zeros(0, weight.shape[0])
    return torch.cat(outs)[:t]  # [T, out]


def sigmoid64(x: Tensor) -> Tensor:
    """sigmoid in float64 (returns float64); see the module docstring for why."""
    return torch.sigmoid(x.double())


def signed_sqrt_gate(d: Tensor) -> Tensor:
    """`sigmoid(sign(d) * sqrt(max(|d|, 1e-6)))` in float64: sign(0) = 0 gives exactly 0.5."""
    d = d.double()
    return sigmoid64(torch.sign(d) * torch.sqrt(d.abs().clamp_min(1e-6)))


def ragged_positions(query_start_loc: Tensor, num_tokens: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per token of a ragged batch: (request index [T], position in its request [T], whether it
    lies inside a request at all [T]). Tokens at or after `query_start_loc[-1]` are padding; their
    request index is clamped to a valid one and must be masked with the third result."""
    qsl = query_start_loc.long()
    num_reqs = qsl.numel() - 1
    t = torch.arange(num_tokens, device=qsl.device)
    req = torch.searchsorted(qsl[1:].contiguous(), t, right=True)  # [T] in [0, R]
    inside = req < num_reqs
    req = req.clamp(max=max(num_reqs - 1, 0))
    return req, t - qsl[req], inside


def history_index(query_start_loc: Tensor, req: Tensor, q: Tensor, width: int) -> Tensor:
    """Row of the stacked source `[history of every request (R*width rows) | this step's tokens
    (T rows)]` that holds position `q` of request `req`, where q >= 0 counts this step's tokens
    of that request and -width <= q < 0 reaches back into its carried history (the last history
    row is q = -1). One gather from that source then serves any mix of prefill chunks, decode
    steps and requests, with no per-request loop."""
    qsl = query_start_loc.long()
    num_reqs = qsl.numel() - 1
    from_tokens = num_reqs * width + qsl[req] + q
    from_history = req * width + width + q
    return torch.where(q >= 0, from_tokens, from_history)
