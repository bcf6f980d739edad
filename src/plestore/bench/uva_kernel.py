"""The SGLang/vLLM pinned-memory gathers as baselines, reading rows' bytes from pinned host memory
through UVA: one Triton program per requested id (Qwen4Exp's PLE: shared/spec/qwen4exp-ple.md
§4.1, §4.2), or a persistent grid of programs walking 16-row tiles (vLLM's Engram lookup:
shared/spec/vllm.md "DeepSeek-V4.1 Engram"). On a machine without CUDA both degrade to a host
gather + copy."""

from __future__ import annotations

import torch

from plestore.kernels import triton_available

__all__ = ["one_row_per_program_gather", "persistent_grid_gather"]

TILE_ROWS = 16  # rows a tile (vLLM's Engram lookup's BLOCK_R)

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

    @triton.jit
    def _tile_kernel(
        src, ids, out, n, RB: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr, GRID
    ):
        lanes = tl.arange(0, BLOCK)
        for tile in range(tl.program_id(0), tl.cdiv(n, TILE), GRID):  # [TILE, BLOCK] a tile
            i = tile * TILE + tl.arange(0, TILE)
            mask = (i < n)[:, None] & (lanes < RB)[None, :]
            row = tl.load(ids + i, mask=i < n, other=0).to(tl.int64)
            raw = tl.load(src + row[:, None] * RB + lanes[None, :], mask=mask)
            tl.store(out + i.to(tl.int64)[:, None] * RB + lanes[None, :], raw, mask=mask)


def one_row_per_program_gather(src: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """uint8 [n, row_bytes] on ids' device: src [rows, row_bytes] (pinned host) rows by id."""
    n, rb = ids.numel(), src.shape[1]
    if not (ids.is_cuda and triton_available()):
        return torch.index_select(src, 0, ids.cpu()).to(ids.device)
    out = torch.empty((n, rb), dtype=torch.uint8, device=ids.device)
    if n:
        _one_row_kernel[(n,)](src, ids, out, RB=rb, BLOCK=triton.next_power_of_2(rb))
    return out


def persistent_grid_gather(src: torch.Tensor, ids: torch.Tensor, background: bool) -> torch.Tensor:
    """As one_row_per_program_gather, by min(tiles, SMs) programs each walking 16-row tiles —
    half the SMs where `background` (a side stream's lookup leaves the rest to the model)."""
    n, rb = ids.numel(), src.shape[1]
    if not (ids.is_cuda and triton_available()):
        return torch.index_select(src, 0, ids.cpu()).to(ids.device)
    out = torch.empty((n, rb), dtype=torch.uint8, device=ids.device)
    sms = torch.cuda.get_device_properties(ids.device).multi_processor_count
    grid = max(1, min(triton.cdiv(n, TILE_ROWS), sms // 2 if background else sms))
    if n:
        _tile_kernel[(grid,)](
            src, ids, out, n, RB=rb, BLOCK=triton.next_power_of_2(rb), TILE=TILE_ROWS, GRID=grid
        )
    return out
