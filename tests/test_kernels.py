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
def test_decode_scatter_triton_matches_reference(name, dim):
    from plestore.kernels import decode_triton
    from plestore.kernels.decode import decode_scatter_reference

    fmt = get_format(name)
    if dim % fmt.block_size:
        pytest.skip("dim not a multiple of the block size")
    rng = np.random.default_rng(dim)
    for u, n in [(1, 1), (37, 300), (1000, 4096)]:
        raw = torch.from_numpy(_rows(fmt, u, dim, rng)).cuda()
        inv = torch.from_numpy(rng.integers(-1, u, n)).cuda()  # -1: absent -> zeros
        scale = 0.0123 if fmt.has_table_scale else 1.0
        want = torch.full((n, dim), 7.0, dtype=torch.bfloat16, device="cuda")  # poisoned
        got = torch.full((n, dim), 7.0, dtype=torch.bfloat16, device="cuda")
        decode_scatter_reference(raw, inv, fmt, dim, scale, want)
        decode_triton.decode_scatter(raw, inv, fmt, dim, scale, got)
        assert_bit_identical(got, want)
        assert (got[inv < 0] == 0).all()


@pytest.mark.parametrize("row_bytes,stride", [(160, 160), (90, 96), (90, 90), (265, 272), (7, 7)])
def test_gather_rows_from_pinned_and_device_memory(row_bytes, stride):
    from plestore.kernels.gather import gather_rows, gather_rows_reference

    rng = np.random.default_rng(row_bytes)
    R, n = 5000, 3000
    host = HostBuffer(R * stride, pin=True)
    try:
        src = host.tensor.view(R, stride)
        src.copy_(torch.from_numpy(rng.integers(0, 256, (R, stride), dtype=np.uint8)))
        rows = torch.from_numpy(rng.integers(0, R, n)).cuda()
        want = gather_rows_reference(src, rows.cpu(), row_bytes)
        for source in (src, src.cuda()):
            out = torch.full((n, row_bytes), 0xAB, dtype=torch.uint8, device="cuda")
            gather_rows(source, rows, out)
            assert torch.equal(out.cpu(), want)
    finally:
        host.close()


def test_gather_rows_skips_negative_ids_without_reading():
    from plestore.kernels.gather import gather_rows

    src = torch.arange(64, dtype=torch.uint8, device="cuda").view(8, 8)
    rows = torch.tensor([3, -1, 5], device="cuda")
    out = torch.full((3, 8), 0xEE, dtype=torch.uint8, device="cuda")
    gather_rows(src, rows, out)
    assert torch.equal(out[0], src[3]) and torch.equal(out[2], src[5])
    assert (out[1] == 0xEE).all()  # untouched: the row was never loaded
