"""Identity row ids for Gemma 3n / Gemma 4 per-layer embeddings: row = token id.

The per-layer table has `vocab_size_per_layer_input` rows (262,144), which can be smaller than
the text vocabulary, and multimodal models feed it image/audio soft-token ids too. transformers'
multimodal Gemma models (`Gemma3nModel.get_per_layer_inputs`) replace every id outside
[0, vocab_size_per_layer_input) with 0 before the lookup; `out_of_range="zero"` does the same.
The default, `"error"`, raises instead: a text-only caller with such an id has a bug.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from plestore.hashing.backend import Array, Backend
from plestore.hashing.base import Hasher
from plestore.spec import IdentityHashSpec

__all__ = ["IdentityHash"]


class IdentityHash(Hasher):
    """`row_ids(input_ids)` -> int64 ids of the same shape (any shape, e.g. [B, S])."""

    kind = "identity"

    def __init__(self, vocab_size: int, out_of_range: str = "error") -> None:
        self.spec = IdentityHashSpec(vocab_size=vocab_size, out_of_range=out_of_range)
        self.vocab_size, self.out_of_range = vocab_size, out_of_range

    @classmethod
    def from_spec(cls, spec: IdentityHashSpec) -> IdentityHash:
        if not isinstance(spec, IdentityHashSpec):
            raise ValueError(f"IdentityHash needs an IdentityHashSpec, got {type(spec).__name__}")
        return cls(spec.vocab_size, spec.out_of_range)

    @property
    def heads(self) -> int:
        return self.spec.heads

    @property
    def num_rows(self) -> int:
        return self.spec.num_rows

    def fresh_state(self, num_requests: int, device: str | torch.device | None = None) -> None:
        return None

    def step(
        self,
        input_ids: Array,
        query_start_loc: Array,
        state: Any = None,
        *,
        check: bool = True,
        **extras: Any,
    ) -> tuple[Array, None]:
        if extras:
            raise ValueError(f"IdentityHash takes no {sorted(extras)}")
        return self.row_ids(input_ids, check=check).reshape(-1, 1), None  # [T, 1]

    def row_ids(self, input_ids: Array, *, check: bool = True) -> Array:
        """int64 row ids, same shape. With out_of_range="error", an id outside [0, vocab_size)
        raises (on CUDA: one sync; `check=False` skips it and the caller vouches for the ids)."""
        xp = Backend(input_ids)
        ids = xp.ints("input_ids", input_ids)
        if self.out_of_range == "zero":
            return xp.int64(xp.where((ids >= 0) & (ids < self.vocab_size), ids, 0))
        if check:
            xp.validate(lambda: ((ids >= 0) & (ids < self.vocab_size)).all(), self._raise, ids)
        return xp.int64(ids)

    def _raise(self, ids: np.ndarray) -> None:
        bad = (ids < 0) | (ids >= self.vocab_size)
        if not bad.any():
            return
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"input_ids{list(where)} = {int(ids[where])} is outside the per-layer vocabulary "
            f"[0, {self.vocab_size}); use out_of_range='zero' to map such ids to row 0 as "
            "transformers' multimodal Gemma does"
        )

    def __repr__(self) -> str:
        return f"IdentityHash(vocab_size={self.vocab_size}, out_of_range={self.out_of_range!r})"
