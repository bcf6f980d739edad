"""The SGLang/vLLM pinned-memory gather as a baseline: one Triton program per requested id,
reading its row's bytes from pinned host memory through UVA (shared/spec/qwen4exp-ple.md §4.1,
§4.2). On a machine without CUDA it degrades to a host gather + copy."""

from __future__ import annotations

import torch

from plestore.kernels import triton_available

__all__ = ["one_row_per_program_gather"]

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _one_row_kernel(src, ids, out, RB: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)  # one program per requested id
        row = tl.load(ids + pid)
        lanes = tl.arange(0, BLOCK)
        mask = lanes < RB
        tl.store(out + pid * RB + lanes, tl.load(src + row * RB + lanes, mask=mask), mask=mask)


def one_row_per_program_gather(src: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """uint8 [n, row_bytes] on ids' device: src [rows, row_bytes] (pinned host) rows by id."""
    n, rb = ids.numel(), src.shape[1]
    if not (ids.is_cuda and triton_available()):
        return torch.index_select(src, 0, ids.cpu()).to(ids.device)
    out = torch.empty((n, rb), dtype=torch.uint8, device=ids.device)
    if n:
        _one_row_kernel[(n,)](src, ids, out, RB=rb, BLOCK=triton.next_power_of_2(rb))
    return out
