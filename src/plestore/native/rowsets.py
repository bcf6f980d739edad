"""The hashes that place rows in sets, as the C computes them (direct.c's host row cache,
gpudirectory.c's GPU row cache directory): numpy for the host, torch ops for device tensors."""

from __future__ import annotations

from typing import Any

import numpy as np

from plestore.native.constants import HASH_GOLDEN, HASH_MIX, HASH_SKETCH_SEED

__all__ = ["row_hash_torch", "set_of", "sketch_index"]

_GOLDEN = np.uint64(HASH_GOLDEN)
_GOLDEN_I64 = int(_GOLDEN.view(np.int64))  # the same bits, signed (torch has no uint64 product)
_MIX = np.uint64(HASH_MIX)
_SEED = np.uint64(HASH_SKETCH_SEED)


def set_of(rows: np.ndarray, sets: int) -> np.ndarray:
    """Each row's set of `sets` (a multiplicative hash; the uint64 product wraps as in C)."""
    h = rows.astype(np.uint64) * _GOLDEN
    return ((h >> np.uint64(32)) % np.uint64(max(1, sets))).astype(np.int64)


def row_hash_torch(rows: Any) -> Any:
    """set_of's hash of an int64 tensor, before the modulo: `row_hash_torch(r) % sets` is
    set_of(r, sets) (the int64 product wraps to the same low 64 bits; the mask makes the shift
    logical)."""
    return (rows * _GOLDEN_I64) >> 32 & 0xFFFFFFFF


def sketch_index(rows: np.ndarray, mask: int) -> np.ndarray:
    """Each row's frequency counter in the sketch."""
    h = (rows.astype(np.uint64) ^ _SEED) * _MIX
    return ((h >> np.uint64(29)) & np.uint64(mask)).astype(np.int64)
