"""GPU kernels (Triton), each next to the torch reference it is tested against."""

from __future__ import annotations

import logging
from functools import cache

__all__ = ["announce_reference", "triton_available"]

log = logging.getLogger("plestore")


@cache
def triton_available() -> bool:
    """Triton importable and a CUDA device present."""
    try:
        import torch
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@cache
def announce_reference(kernel: str) -> None:
    """Say once that a CUDA call of `kernel` runs its torch reference: Triton is missing."""
    log.warning(
        "plestore: Triton is not installed (pip install plestore[gpu]): %s runs its torch "
        "reference on the GPU (the same bits, slower)",
        kernel,
    )
