"""GPU kernels against their torch references (the whole file needs CUDA + Triton)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import assert_bit_identical, requires_cuda
from plestore.formats import FORMATS, get_format
from plestore.io.memory import HostBuffer
from plestore.kernels import triton_available

pytestmark = [
    requires_cuda,
    pytest.mark.gpu,
    pytest.mark.skipif(not triton_available(), reason="needs Triton (the gpu extra)"),
]


def _rows(fmt, n, dim, rng):
    rows = rng.integers(0, 256, (n, fmt.row_bytes(dim)), dtype=np.uint8)  # NaN codes included
    if fmt.name == "nf4":
        rows[:, dim // 2 + 2 :] = 0
    return rows


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("dim", [32, 160, 256, 2048])
def test_gather_decode_triton_matches_reference(name, dim):
    from plestore.kernels.gather_decode import gather_decode, gather_decode_reference

    fmt = get_format(name)
    if dim % fmt.block_size:
        pytest.skip("dim not a multiple of the block size")
    rng = np.random.default_rng(dim)
    scale = 0.0123 if fmt.has_table_scale else 1.0
    for u, n, offset in [(1, 1, 0), (37, 300, 5), (1000, 4096, 0)]:
        src = torch.from_numpy(_rows(fmt, u, dim, rng)).cuda()
        index = torch.from_numpy(rng.integers(-3, u + offset + 3, n)).cuda()  # some absent
        want = torch.full((n, dim), 7.0, dtype=fmt.torch_dtype, device="cuda")  # poisoned
        got = want.clone()
        gather_decode_reference(src, index, offset, u, fmt, dim, scale, want)
        gather_decode(src, index, offset, u, fmt, dim, scale, got)
        assert_bit_identical(got, want)
        local = index - offset
        assert (got[(local < 0) | (local >= u)] == 0).all()


@pytest.mark.parametrize(
    "name,stride_pad", [("nvfp4", 6), ("fp8_e4m3", 0), ("bf16", 0), ("fp16", 0), ("fp32", 4)]
)
def test_gather_decode_reads_pinned_host_memory(name, stride_pad):
    from plestore.kernels.gather_decode import gather_decode, gather_decode_reference

    fmt, dim, rows = get_format(name), 160, 5000
    stride = fmt.row_bytes(dim) + stride_pad
    rng = np.random.default_rng(1)
    host = HostBuffer(rows * stride, pin=True)
    try:
        src = host.tensor.view(rows, stride)
        src.copy_(torch.from_numpy(_rows(get_format("bf16"), rows, stride // 2, rng)[:, :stride]))
        index = torch.from_numpy(rng.integers(-10, rows + 10, 3000)).cuda()
        scale = 0.5 if fmt.has_table_scale else 1.0
        want = torch.empty((3000, dim), dtype=fmt.torch_dtype)
        gather_decode_reference(src, index.cpu(), 0, rows, fmt, dim, scale, want)
        got = torch.empty((3000, dim), dtype=fmt.torch_dtype, device="cuda")
        gather_decode(src, index, 0, rows, fmt, dim, scale, got)
        assert_bit_identical(got, want)
    finally:
        host.close()


@pytest.mark.parametrize("name", ["nvfp4", "fp8_e4m3", "bf16", "nf4"])
def test_gather_decode_two_sources_device_and_pinned(name):
    """Rows before `split` from a device tensor, rows from it on from pinned host memory (the
    staged GPU-cache lookup's misses): the rows the one-source kernel gives for the two
    sources stacked."""
    from plestore.kernels.gather_decode import gather_decode

    fmt, dim = get_format(name), 160
    stride = fmt.row_bytes(dim) + (6 if name == "nvfp4" else 0)  # a whole row (and some pad)
    rng = np.random.default_rng(4)
    first = torch.from_numpy(_rows(get_format("bf16"), 700, stride // 2, rng)[:, :stride])
    second = torch.from_numpy(_rows(get_format("bf16"), 300, stride // 2, rng)[:, :stride])
    host = HostBuffer(300 * stride, pin=True)
    try:
        staged = host.tensor.view(300, stride)
        staged.copy_(second)
        split = 700  # rows 700.. are the second source's 0..
        index = np.r_[rng.integers(0, 700, 500), split + rng.integers(0, 300, 500), [-1, 5000]]
        index = torch.from_numpy(rng.permutation(index))
        scale = 0.25 if fmt.has_table_scale else 1.0
        both = torch.cat([first, second])
        want = torch.empty((index.numel(), dim), dtype=fmt.torch_dtype, device="cuda")
        gather_decode(both.cuda(), index.cuda(), 0, 1000, fmt, dim, scale, want)
        got = torch.full_like(want, 7.0)
        for idx in (index.cuda(), index.pin_memory()):  # the index on the device, or pinned
            gather_decode(first.cuda(), idx, 0, 1000, fmt, dim, scale, got, staged, split)
            assert_bit_identical(got, want)
    finally:
        host.close()
