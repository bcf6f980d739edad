"""GPU kernels (Triton), each next to the torch reference it is tested against."""

from __future__ import annotations

from functools import cache

__all__ = ["triton_available"]


@cache
def triton_available() -> bool:
    """Triton importable and a CUDA device present."""
    try:
        import torch
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()
