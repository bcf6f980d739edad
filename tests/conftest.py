"""Shared fixtures: golden vectors, device parametrisation, bit-exact comparison helpers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

GOLDEN = Path(__file__).parent / "golden"

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA GPU (CI has none; run on the H200 test machine)"
)


def load_golden(name: str) -> dict:
    return json.loads((GOLDEN / name).read_text())


def devices() -> list:
    """torch devices to test: cpu always, cuda where present (the cuda case skips in CI)."""
    return ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.gpu])]


def as_bits(x) -> np.ndarray:
    """bf16 values (torch bf16 or float32 holding bf16 values) -> uint16 bit patterns,
    with every NaN mapped to one canonical pattern (payloads may differ across backends)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().float().cpu().numpy()
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)
    bits[np.isnan(x)] = 0x7FC0
    return bits


def assert_bit_identical(a, b) -> None:
    ba, bb = as_bits(a), as_bits(b)
    assert ba.shape == bb.shape, (ba.shape, bb.shape)
    bad = np.argwhere(ba != bb)
    if bad.size:
        i = tuple(bad[0])
        raise AssertionError(
            f"{len(bad)} of {ba.size} values differ; first at {list(i)}: "
            f"{ba[i]:#06x} vs {bb[i]:#06x}; others at {[b.tolist() for b in bad[1:6]]}"
        )
