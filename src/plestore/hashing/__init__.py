"""Exact row ids for hashed n-gram tables (Qwen4Exp PLE, DeepSeek Engram) and identity tables.

| hasher         | table                        | call                                          |
|----------------|------------------------------|-----------------------------------------------|
| `Qwen4ExpHash` | Qwen3.8-Flash-Next PLE layer | `row_ids(ids, qsl, context) -> (ids, ctx)`    |
| `EngramHash`   | DeepSeek-V4.1 Engram layers  | `row_ids(ids, qsl, lookback, dead, ...)`      |
| `IdentityHash` | Gemma 3n / 4 per-layer table | `row_ids(ids)`                                |

`make_hash(spec)` builds the hasher of a `TableSpec.hash`; every hasher has the uniform
`step(ids, qsl, state) -> (ids [T, heads], next_state)` and `fresh_state(R)`.

Names are imported lazily: the hashers import torch, which the token map (numpy only) and a
bare `import plestore.hashing` do not need.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "EngramHash",
    "EngramState",
    "Hasher",
    "IdentityHash",
    "Qwen4ExpHash",
    "compressed_token_map",
    "load_token_map",
    "make_hash",
    "save_token_map",
]

_WHERE = {
    "EngramHash": "engram",
    "EngramState": "engram",
    "Hasher": "base",
    "IdentityHash": "identity",
    "Qwen4ExpHash": "qwen4exp",
    "compressed_token_map": "token_map",
    "load_token_map": "token_map",
    "make_hash": "registry",
    "save_token_map": "token_map",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'plestore.hashing' has no attribute {name!r}")
    return getattr(importlib.import_module(f"plestore.hashing.{_WHERE[name]}"), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
