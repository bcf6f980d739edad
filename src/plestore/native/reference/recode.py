"""`recode_nvfp4` (recode.c) in numpy: NVFP4 rows' symbols through a symbol table, counted."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["recode_nvfp4"]


def recode_nvfp4(raw: Any, dim: int, lut: Any, out: Any, counts: Any) -> None:
    """out's symbols (block-scale byte << 8 | code byte: two values each, in row order) through
    lut (65536 symbols of w bytes); counts[symbol] += the times it was seen."""
    raw, lut = np.asarray(raw), np.asarray(lut).reshape(-1).view(np.uint8)
    out, counts = np.asarray(out), np.asarray(counts)
    row_bytes, w = dim // 2 + dim // 16, lut.size // 65536
    if dim <= 0 or dim % 16 or raw.size % row_bytes:
        raise ValueError(f"raw ({raw.size} B) is not NVFP4 rows of dim {dim}")
    n = raw.size // row_bytes
    if lut.size % 65536 or w not in (1, 2, 4, 8) or out.nbytes != n * (dim // 2) * w:
        raise ValueError("lut must hold 65536 symbols of 1, 2, 4 or 8 B, out n x dim/2 of them")
    if counts.dtype != np.int64 or counts.size != 65536:
        raise ValueError("counts must be int64 [65536]")
    rows = raw.reshape(n, row_bytes)
    pairs = np.empty((n, dim // 16, 8, 2), np.uint8)  # [n, blocks, 8, (code, scale)]
    pairs[..., 0] = rows[:, : dim // 2].reshape(n, dim // 16, 8)
    pairs[..., 1] = rows[:, dim // 2 :, None]
    idx = pairs.view("<u2").reshape(-1).astype(np.intp)  # [n * dim / 2]
    counts += np.bincount(idx, minlength=65536)
    table = lut.view(f"<u{w}") if w > 1 else lut
    np.take(table, idx, out=out.reshape(-1).view(table.dtype))
