"""The direct tier's host row cache: bounded, set-associative, packed rows in host memory,
vectorised over a batch.

Each row maps to one set of `ways` slots (a multiplicative hash of its id); within a set the
least recently used slot is replaced, and at most `ways` rows of one batch are admitted to a
set. A batch's get or put is a handful of numpy operations (gets past PARALLEL_ROWS ids: torch
operations on torch's threads), each a random pass over tags, stamps or rows, so a batch costs
its memory latency (measured: RESULTS.md "host time, part by part"). Rows move as numpy void
items (one memcpy per row); the data array is the cache's whole footprint.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from plestore.io.memory import PARALLEL_ROWS, take_rows

__all__ = ["HostRowCache"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_GOLDEN_I64 = int(_GOLDEN.view(np.int64))  # the same bits as a signed 64-bit integer


class HostRowCache:
    def __init__(self, capacity_rows: int, row_bytes: int, ways: int = 8) -> None:
        if capacity_rows < 0:
            raise ValueError(f"cache capacity must be >= 0 rows, got {capacity_rows}")
        self.ways = max(1, min(ways, capacity_rows)) if capacity_rows else 1
        self.sets = capacity_rows // self.ways
        self.row_bytes = row_bytes
        slots = self.sets * self.ways
        # every array is written here: left lazy, each page's first touch (a zeroed 2 MiB
        # hugepage) lands inside a lookup. measured: RESULTS.md "host time, part by part"
        self.tags = np.full((self.sets, self.ways), -1, dtype=np.int64)  # row id per slot
        self.stamp = np.full((self.sets, self.ways), 0, dtype=np.int64)  # last use, for LRU
        self.data = np.full((slots, row_bytes), 0, dtype=np.uint8)  # [slots, row_bytes]
        self._items = self.data.view(np.dtype((np.void, row_bytes)))[:, 0]  # [slots] rows
        # torch views of the same memory, for batches large enough to use torch's threads
        self._t_tags, self._t_data = torch.from_numpy(self.tags), torch.from_numpy(self.data)
        self._t_stamp = torch.from_numpy(self.stamp).view(-1)
        self._clock = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def capacity_rows(self) -> int:
        return self.sets * self.ways

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.tags.nbytes + self.stamp.nbytes

    def _set_of(self, rows: np.ndarray) -> np.ndarray:
        h = rows.astype(np.uint64) * _GOLDEN
        return ((h >> np.uint64(32)) % np.uint64(self.sets)).astype(np.int64)

    def _match(self, s: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """[n, ways]: which way of each row's set holds it. Whole set rows are gathered at once
        (np.take: 3-4x faster than fancy indexing, 65,536 rows 2.0 vs 7.3 ms on the dev VM; on
        torch's threads for large batches)."""
        return take_rows(self.tags, s) == rows[:, None]

    def contains(self, rows: np.ndarray) -> np.ndarray:
        """Boolean mask [n] of rows cached now (no copy, no change to recency)."""
        if self.sets == 0 or len(rows) == 0:
            return np.zeros(len(rows), dtype=bool)
        with self._lock:
            return _any_way(self._match(self._set_of(rows), rows))

    def get(self, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Copy cached rows into out[i]; return the boolean hit mask [n]."""
        n = len(rows)
        if self.sets == 0 or n == 0:
            self.misses += n
            return np.zeros(n, dtype=bool)
        with self._lock:
            self._clock += 1
            hit = (self._get_parallel if n > PARALLEL_ROWS else self._get)(rows, out[:n])
            h = int(hit.sum())
            self.hits += h
            self.misses += n - h
        return hit

    def _get(self, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        s = self._set_of(rows)
        match = self._match(s, rows)  # [n, ways]
        hit = _any_way(match)
        if not hit.any():  # a cold batch: nothing to stamp or copy
            return hit
        everything = bool(hit.all())
        s_hit, way = (s, match.argmax(axis=1)) if everything else (s[hit], match[hit].argmax(1))
        self.stamp[s_hit, way] = self._clock
        slots = s_hit * self.ways + way  # [h]
        dst = out[:, : self.row_bytes]
        if everything and dst.flags.c_contiguous:
            take_rows(self.data, slots, out=dst)
        else:
            dst[np.flatnonzero(hit)] = take_rows(self.data, slots)
        return hit

    def _get_parallel(self, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """_get in torch ops, every one on torch's threads: a large batch's probe is a few
        random passes over memory, bound by its latency, and numpy's run on one core.
        measured: RESULTS.md "host time, part by part" (the row-cache probe)."""
        r = torch.from_numpy(rows)
        # _set_of in int64: the product wraps to the same low 64 bits; the mask makes the shift
        # logical
        s = ((r * _GOLDEN_I64) >> 32 & 0xFFFFFFFF) % self.sets
        match = self._t_tags.index_select(0, s) == r[:, None]  # [n, ways]
        way = match.to(torch.uint8).argmax(1)  # the first way that holds the row (0 if none)
        hit = match.any(1)
        slots = s * self.ways + way
        everything = bool(hit.all())
        if not everything:
            slots, where = slots[hit], hit.nonzero().view(-1)
        self._t_stamp.index_fill_(0, slots, self._clock)
        dst = torch.from_numpy(out)[:, : self.row_bytes]
        if everything and dst.is_contiguous():
            torch.index_select(self._t_data, 0, slots, out=dst)
        elif everything:
            dst.copy_(self._t_data.index_select(0, slots))
        else:
            dst.index_copy_(0, where, self._t_data.index_select(0, slots))
        return hit.numpy()

    def put(self, rows: np.ndarray, data: np.ndarray, distinct: bool = True) -> int:
        """Admit rows with their bytes; returns how many were admitted. distinct=False: rows
        may repeat (each is admitted once)."""
        if self.sets == 0 or len(rows) == 0:
            return 0
        if not distinct:
            rows, first = np.unique(rows, return_index=True)
            data = np.take(data, first, axis=0)
        with self._lock:
            s = self._set_of(rows)
            new = ~_any_way(self._match(s, rows))
            data = np.ascontiguousarray(data).view(np.dtype((np.void, self.row_bytes)))[:, 0]
            rows, s, data = rows[new], s[new], data[new]
            n = len(rows)
            if n == 0:
                return 0
            # group by set (sorting packed (set, position) keys: no argsort), rank within set
            bits = max(1, n.bit_length())
            order = np.sort((s << bits) | np.arange(n, dtype=np.int64)) & ((1 << bits) - 1)
            rows, s, data = rows[order], s[order], np.take(data, order)
            starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])  # first of each set's group
            rank = np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n]))
            keep = rank < self.ways  # at most `ways` admissions per set per batch
            rows, s, data, rank = rows[keep], s[keep], data[keep], rank[keep]
            stamps = np.take(self.stamp, s, axis=0)  # [k, ways]
            victim = stamps.argmin(axis=1)  # the least recently used way (first of equals)
            more = np.flatnonzero(rank > 0)  # a set's 2nd, 3rd, ... admission: its next LRU way
            if len(more):
                lru = np.argsort(stamps[more], axis=1, kind="stable")  # [m, ways], [:, 0] = argmin
                victim[more] = lru[np.arange(len(more)), rank[more]]
            self._clock += 1
            self.tags[s, victim] = rows
            self.stamp[s, victim] = self._clock
            self._items[s * self.ways + victim] = data
            return len(rows)

    def clear(self) -> None:
        with self._lock:
            self.tags.fill(-1)
            self.stamp.fill(0)


def _any_way(match: np.ndarray) -> np.ndarray:
    """match.any(axis=1) for a bool [n, ways] array: each row read as one integer where ways is
    1, 2, 4 or 8 (131,072 rows: 0.03 vs 3.0 ms on the dev VM)."""
    ways = match.shape[1]
    if ways in (1, 2, 4, 8) and match.flags.c_contiguous:
        return match.view(f"u{ways}")[:, 0] != 0
    return match.any(axis=1)
