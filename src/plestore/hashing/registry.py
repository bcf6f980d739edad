"""`make_hash(spec)`: the hasher of a `HashSpec`."""

from __future__ import annotations

from typing import Any

from plestore.hashing.base import Hasher
from plestore.hashing.engram import EngramHash
from plestore.hashing.identity import IdentityHash
from plestore.hashing.qwen4exp import Qwen4ExpHash
from plestore.spec import EngramHashSpec, HashSpec, IdentityHashSpec, Qwen4ExpHashSpec

__all__ = ["make_hash"]


def make_hash(spec: HashSpec, **kwargs: Any) -> Hasher:
    """The hasher of a `HashSpec` (e.g. `TableSpec.hash`). `kwargs` go to its constructor
    (Engram: `token_map=`)."""
    if isinstance(spec, Qwen4ExpHashSpec):
        return Qwen4ExpHash.from_spec(spec, **kwargs)
    if isinstance(spec, EngramHashSpec):
        return EngramHash.from_spec(spec, **kwargs)
    if isinstance(spec, IdentityHashSpec):
        return IdentityHash.from_spec(spec, **kwargs)
    raise ValueError(f"no hasher for {type(spec).__name__}; expected a plestore.spec HashSpec")
