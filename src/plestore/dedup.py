"""Distinct row ids and the inverse map, fast: one sort of packed (id, position) keys.

np.unique(return_inverse=True) argsorts; sorting int64 keys that carry their position in the
low bits is ~2x faster for a 65,536-id prefill chunk (1.9 vs 4.2 ms on a 2-core dev VM), and
it is on the critical path of every host-tier lookup.
"""

from __future__ import annotations

import numpy as np

__all__ = ["is_distinct_small", "unique_inverse"]


def unique_inverse(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct ids, inverse) with uniq[inverse] == ids, for non-negative int64 ids."""
    n = ids.size
    if n == 0:
        return ids.astype(np.int64), np.zeros(0, np.int64)
    bits = max(1, int(n).bit_length())
    if int(ids.max()) >= 1 << (62 - bits):  # no room to pack: the general path
        uniq, inv = np.unique(ids, return_inverse=True)
        return uniq, inv.reshape(-1)
    keys = np.sort((ids.astype(np.int64) << bits) | np.arange(n, dtype=np.int64))
    sorted_ids = keys >> bits
    first = np.empty(n, dtype=bool)
    first[0] = True
    np.not_equal(sorted_ids[1:], sorted_ids[:-1], out=first[1:])
    inverse = np.empty(n, dtype=np.int64)
    inverse[keys & ((1 << bits) - 1)] = np.cumsum(first) - 1
    return sorted_ids[first], inverse


def is_distinct_small(ids: np.ndarray, limit: int = 256) -> bool:
    """True if ids has at most `limit` entries, all different: a small decode batch (16 ids a
    request) almost always is, and a Python set answers in ~2 us for 16 ids where the sort
    costs ~20 (ten numpy calls) on the critical path of a decode step; past a few hundred ids
    the sort is as cheap."""
    return ids.size <= limit and len(set(ids.tolist())) == ids.size
