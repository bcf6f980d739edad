"""A bounded, set-associative cache of packed rows in host memory, vectorised over a batch.

Lookups and inserts for a whole batch of row ids are a handful of numpy operations, not a
Python loop: a batch of 65,536 ids costs well under a millisecond. Each row maps to one set of
`ways` slots (by a multiplicative hash of its id); within a set the least recently used slot is
replaced. When several rows of one batch fall into the same set, only the first is admitted —
at most `ways` rows per set are admitted per batch (into the set's least recently used slots).
Row bytes move as numpy void items (one memcpy per row). The data array is the cache's whole
footprint.
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["RowCache"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class RowCache:
    def __init__(self, capacity_rows: int, row_bytes: int, ways: int = 8) -> None:
        if capacity_rows < 0:
            raise ValueError(f"cache capacity must be >= 0 rows, got {capacity_rows}")
        self.ways = max(1, min(ways, capacity_rows)) if capacity_rows else 1
        self.sets = capacity_rows // self.ways
        self.row_bytes = row_bytes
        slots = self.sets * self.ways
        # every array is written once here: left lazy, the first touch of each page (a 2 MiB
        # zeroed hugepage under THP) landed inside lookups — 6 of the 7 ms a cold 16-row
        # direct lookup took on the H200 host (benchmarks/probe_inline_parts.py, 2026-11-29)
        self.tags = np.full((self.sets, self.ways), -1, dtype=np.int64)  # row id per slot
        self.stamp = np.full((self.sets, self.ways), 0, dtype=np.int64)  # last use, for LRU
        self.data = np.full((slots, row_bytes), 0, dtype=np.uint8)  # [slots, row_bytes]
        self._items = self.data.view(np.dtype((np.void, row_bytes)))[:, 0]  # [slots] rows
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

    def contains(self, rows: np.ndarray) -> np.ndarray:
        """Boolean mask [n] of rows cached now (no copy, no change to recency)."""
        if self.sets == 0 or len(rows) == 0:
            return np.zeros(len(rows), dtype=bool)
        with self._lock:
            return (self.tags[self._set_of(rows)] == rows[:, None]).any(axis=1)

    def get(self, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Copy cached rows into out[i]; return the boolean hit mask [n]."""
        n = len(rows)
        if self.sets == 0 or n == 0:
            self.misses += n
            return np.zeros(n, dtype=bool)
        with self._lock:
            s = self._set_of(rows)
            match = self.tags[s] == rows[:, None]  # [n, ways]
            hit = match.any(axis=1)
            way = match.argmax(axis=1)
            self._clock += 1
            self.stamp[s[hit], way[hit]] = self._clock
            slots = s[hit] * self.ways + way[hit]
            out_items = out.view(np.dtype((np.void, self.row_bytes)))[:, 0]
            out_items[np.flatnonzero(hit)] = self._items[slots]
            h = int(hit.sum())
            self.hits += h
            self.misses += n - h
        return hit

    def put(self, rows: np.ndarray, data: np.ndarray) -> int:
        """Admit rows (unique ids) with their bytes; returns how many were admitted."""
        if self.sets == 0 or len(rows) == 0:
            return 0
        with self._lock:
            s = self._set_of(rows)
            present = (self.tags[s] == rows[:, None]).any(axis=1)
            rows, s, data = rows[~present], s[~present], data[~present]
            order = np.argsort(s, kind="stable")
            rows, s, data = rows[order], s[order], data[order]
            starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])  # first of each set's group
            rank = np.arange(len(s)) - np.repeat(starts, np.diff(np.r_[starts, len(s)]))
            keep = rank < self.ways  # at most `ways` admissions per set per batch
            rows, s, data, rank = rows[keep], s[keep], data[keep], rank[keep]
            lru = np.argsort(self.stamp[s], axis=1)  # [n, ways] ways from least recently used
            victim = lru[np.arange(len(s)), rank]
            self._clock += 1
            self.tags[s, victim] = rows
            self.stamp[s, victim] = self._clock
            slots = s * self.ways + victim
            self._items[slots] = data.view(np.dtype((np.void, self.row_bytes)))[:, 0]
            return len(rows)

    def clear(self) -> None:
        with self._lock:
            self.tags.fill(-1)
            self.stamp.fill(0)
