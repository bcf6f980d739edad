"""The deterministic primitives under the layers: fixed-order sums, row-invariant projections,
float64 gate, and the ragged index arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import devices
from plestore.layers.ops import (
    history_index,
    ragged_positions,
    rows_invariant_linear,
    signed_sqrt_gate,
    tree_sum,
)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("n", [1, 2, 5, 64, 100])
def test_tree_sum_is_a_sum_and_layout_free(device, n):
    x = torch.randn(7, 3, n, dtype=torch.float64).to(device)
    assert torch.allclose(tree_sum(x), x.sum(-1))
    f = x.float()
    whole = tree_sum(f)
    for i in range(7):  # a row alone, or as a strided slice, gives the same bits
        assert torch.equal(tree_sum(f[i : i + 1].clone()), whole[i : i + 1])
    assert torch.equal(tree_sum(f.transpose(0, 1).contiguous()).transpose(0, 1), whole)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_invariant_linear(device, dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 40, generator=g).to(dtype).to(device)
    x = torch.randn(150, 40, generator=g).to(dtype).to(device)
    whole = rows_invariant_linear(x, w)
    assert whole.shape == (150, 96) and whole.dtype == dtype
    ref = x.double() @ w.double().T
    assert torch.allclose(whole.double(), ref, rtol=2**-7, atol=2**-7)
    for start, n in [(0, 1), (3, 1), (70, 9), (64, 64), (5, 145)]:
        assert torch.equal(rows_invariant_linear(x[start : start + n], w), whole[start : start + n])
    assert rows_invariant_linear(x[:0], w).shape == (0, 96)


def test_signed_sqrt_gate():
    d = torch.tensor([0.0, -0.0, 1e-9, -1e-9, 4.0, -4.0])
    g = signed_sqrt_gate(d)
    assert g.dtype == torch.float64
    assert g[0] == 0.5 and g[1] == 0.5
    assert math.isclose(g[2], 1 / (1 + math.exp(-1e-3)), rel_tol=1e-15)
    assert math.isclose(g[3], 1 / (1 + math.exp(1e-3)), rel_tol=1e-15)
    assert math.isclose(g[4], 1 / (1 + math.exp(-2.0)), rel_tol=1e-15)
    assert math.isclose(g[4] + g[5], 1.0, rel_tol=1e-15)


@pytest.mark.parametrize("device", devices())
def test_ragged_index_arithmetic(device):
    qsl = torch.tensor([0, 3, 3, 5], dtype=torch.int32, device=device)
    req, pos, inside = ragged_positions(qsl, 7)
    assert req.tolist() == [0, 0, 0, 2, 2, 2, 2]
    assert pos.tolist()[:5] == [0, 1, 2, 0, 1]
    assert inside.tolist() == [True] * 5 + [False] * 2
    # source rows: [R*width history | T tokens]; width 2, R 3 -> tokens start at row 6
    q = torch.tensor([-2, -1, 0, 1], device=device)
    r = torch.tensor([2, 0, 2, 0], device=device)
    assert history_index(qsl, r, q, 2).tolist() == [4, 1, 6 + 3, 6 + 1]
    empty = ragged_positions(torch.tensor([0], device=device), 3)
    assert empty[2].tolist() == [False] * 3
