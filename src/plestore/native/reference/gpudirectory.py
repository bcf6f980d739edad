"""The GPU row cache directory's probe and admission in numpy: `cache_locate`, `cache_admit`
(gpudirectory.c), the same arguments, slots, stamps and counts (its hashes: native/rowsets.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from plestore.native.constants import STATIC_WAYS
from plestore.native.rowsets import set_of, sketch_index

__all__ = ["cache_admit", "cache_locate"]


def cache_locate(
    rows: Any,
    slot_out: Any,
    static_tags: np.ndarray,
    tags: np.ndarray,
    stamp: np.ndarray,
    sketch: np.ndarray,
    state: np.ndarray,
    resident_start: int,
    resident_end: int,
    static_sets: int,
    sets: int,
    ways: int,
    touch: bool,
    sketch_mask: int,
    saturated: int,
    age_every: int,
    threads: int = 1,
) -> None:
    """slot_out[i] = the slot of rows[i] (resident, static, dynamic) or -1 (gpudirectory.c's
    cache_probe). Touching (a directory with dynamic sets): the clock state[0] advanced, dynamic
    hits stamped with it, every row counted in the sketch (saturating), and every counter halved
    once age_every ids were counted since the last halving (state[1]): the directory's aging."""
    touch = bool(touch) and sets > 0
    if touch:
        state[0] += 1
    clock = int(state[0]) if touch else -1
    args = (resident_start, resident_end, static_sets, sets, ways, clock, sketch_mask, saturated)
    _locate(rows, slot_out, static_tags, tags, stamp, sketch, *args)
    if touch:
        state[1] += np.asarray(rows).size
        if state[1] >= age_every:
            sketch >>= 1
            state[1] = 0


def _locate(rows, slot_out, static_tags, tags, stamp, sketch, r0, r1, static_sets, sets, ways,
            clock, sketch_mask, saturated) -> None:  # fmt: skip
    """cache_locate's slots; clock >= 0 touches (stamps and counts)."""
    rows = np.asarray(rows)
    resident = r1 - r0
    slot = np.where((rows >= r0) & (rows < r1), rows - r0, -1)
    if static_sets:
        s = set_of(rows, static_sets)
        st = static_tags.reshape(static_sets, STATIC_WAYS)
        match = np.take(st, s, axis=0) == rows[:, None]  # [n, STATIC_WAYS]
        pos = resident + s * STATIC_WAYS + match.argmax(1)
        slot = np.where(match.any(1), pos, slot)
    if sets:
        first_dynamic = resident + static_sets * STATIC_WAYS
        miss = slot < 0
        r = rows[miss]
        s = set_of(r, sets)
        match = np.take(tags.reshape(sets, ways), s, axis=0) == r[:, None]  # [m, ways]
        hit, way = match.any(1), match.argmax(1)
        slot[miss] = np.where(hit, first_dynamic + s * ways + way, -1)
        if clock >= 0:
            stamp.reshape(sets, ways)[s[hit], way[hit]] = clock
            idx = sketch_index(rows, sketch_mask)
            torch.from_numpy(sketch).index_add_(  # (far faster than numpy's add.at)
                0, torch.from_numpy(idx), torch.ones(idx.size, dtype=torch.int32)
            )
            sketch[idx[sketch[idx] > saturated]] = saturated
    np.asarray(slot_out)[: rows.size] = slot


def cache_admit(
    rows: Any,
    slots_out: Any,
    which_out: Any,
    tags: np.ndarray,
    stamp: np.ndarray,
    sketch: np.ndarray,
    sets: int,
    ways: int,
    first_dynamic: int,
    clock: int,
    sketch_mask: int,
    admit_min: int,
) -> tuple[int, int]:
    """Admit some of `rows` (missed row ids; a repeated row once, at its first position):
    counted at least admit_min times, grouped by set, most frequent first (ties: lower row id),
    at most `ways` a set, the r-th into its set's r-th least recently used way if that is empty
    or holds a row counted less often. Returns (k: slots_out[:k] holds rows[which_out[:k]],
    stamped `clock`; the distinct candidates)."""
    rows = np.asarray(rows)
    if (rows < 0).any():
        raise ValueError(f"cache_admit: row {int(rows[rows < 0][0])} is negative")
    tags2, stamp2 = tags.reshape(sets, ways), stamp.reshape(sets, ways)
    freq = sketch[sketch_index(rows, sketch_mask)].astype(np.int64)
    cand = np.flatnonzero(freq >= admit_min)  # (the few seen often: dedup after)
    _, first = np.unique(rows[cand], return_index=True)
    cand = cand[first]  # the first of each row, by row id
    m = int(cand.size)
    if m == 0:
        return 0, 0
    s = set_of(rows[cand], sets)
    order = np.lexsort((-freq[cand], s))  # by set, most frequent first; at most `ways` a set
    cand, s = cand[order], s[order]
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    rank = np.arange(cand.size) - np.repeat(starts, np.diff(np.r_[starts, cand.size]))
    keep = rank < ways
    cand, s, rank = cand[keep], s[keep], rank[keep]
    lru = np.argsort(stamp2[s], axis=1, kind="stable")  # [k, ways] oldest first
    way = lru[np.arange(cand.size), rank]
    old = tags2[s, way]
    old_freq = sketch[sketch_index(np.maximum(old, 0), sketch_mask)].astype(np.int64)
    ok = (old < 0) | (freq[cand] > old_freq)
    cand, s, way = cand[ok], s[ok], way[ok]
    tags2[s, way] = rows[cand]
    stamp2[s, way] = clock
    k = int(cand.size)
    np.asarray(slots_out)[:k] = first_dynamic + s * ways + way
    np.asarray(which_out)[:k] = cand
    return k, m
