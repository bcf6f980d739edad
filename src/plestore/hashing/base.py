"""The `Hasher` interface every hasher implements (the lookup engine and the layers call it).

A batch is ragged: `input_ids` [T] holds every request's new tokens back to back and
`query_start_loc` [R+1] says where each request starts (vLLM's convention). Hashers accept numpy
arrays (and Python lists) or torch tensors, and answer in kind: numpy in -> numpy out, torch in ->
torch out on the same device.

Validation is exact and names the culprit (request r, position j in its chunk), because a wrong
row id is silent: it fetches a real, plausible row. On CUDA the checks cost one device->host sync,
so every hasher takes `check=False` for callers that vouch for their ids (CUDA-graph capture);
the unchecked path has no host round trip and never reads out of bounds (indices are clamped),
but gives meaningless ids for invalid input.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

from plestore.hashing.backend import Array

if TYPE_CHECKING:
    from plestore.spec import HashSpec

__all__ = ["Hasher"]


class Hasher(ABC):
    """Token ids -> table row ids, one table (or a group of tables sharing a hash).

    The uniform call is `step(input_ids, query_start_loc, state, **extras) -> (ids, next_state)`
    with ids int64 [T, heads]; `fresh_state(R)` is the state of R new requests. Each hasher also
    has its own richer `row_ids(...)`; see the subclasses.
    """

    kind: str
    spec: HashSpec

    @property
    @abstractmethod
    def heads(self) -> int:
        """Row ids per token (columns of `step`'s output)."""

    @property
    @abstractmethod
    def num_rows(self) -> int:
        """Rows of the table the ids address (ids are in [0, num_rows))."""

    @abstractmethod
    def fresh_state(self, num_requests: int, device: str | torch.device | None = None) -> Any:
        """Per-request state of `num_requests` requests that have seen no token yet."""

    @abstractmethod
    def step(
        self,
        input_ids: Array,
        query_start_loc: Array,
        state: Any,
        *,
        check: bool = True,
        **extras: Any,
    ) -> tuple[Array, Any]:
        """Row ids [T, heads] of one engine step and the state to pass with the next step."""

    def check_checkpoint_constants(self, **stored: Any) -> None:
        """Refuse hash constants a checkpoint ships (e.g. `layer_multipliers=`,
        `ngram_heads_vocab_sizes=`, `ngram_heads_offsets=`) that disagree with this hash.

        The engines copy them over the derived values without comparing; a disagreement means
        the table was built with another hash, so we raise (`plestore.spec.check_hash_constants`).
        """
        from plestore.spec import check_hash_constants

        check_hash_constants(self.spec, **stored)
