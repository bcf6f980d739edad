"""The direct tier's host row cache: bounded, set-associative, packed rows in host memory.

    tags   int64 [sets, ways]          the row in each slot (-1: empty)
    stamp  int64 [sets, ways]          its last use, for LRU
    data   uint8 [sets * ways, row_bytes]

Each row maps to one set of `ways` slots (a multiplicative hash of its id); within a set the
least recently used slot is replaced, and at most `ways` rows of one read are admitted to a set.
The arrays are this object's; the host core's `DirectCore` probes and admits inside each read,
under its own lock and by its own clock (`plestore.native`: the C core, or the numpy reference
with the same rules), and clears them. The data array is the cache's whole footprint.
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["HostRowCache"]


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
        self.tags = np.full((self.sets, self.ways), -1, dtype=np.int64)
        self.stamp = np.full((self.sets, self.ways), 0, dtype=np.int64)
        self.data = np.full((slots, row_bytes), 0, dtype=np.uint8)
        self._counts = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def capacity_rows(self) -> int:
        return self.sets * self.ways

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.tags.nbytes + self.stamp.nbytes

    def count(self, hits: int, misses: int) -> None:
        """Reads' hits and misses (a lookup's, or a graph feed's steps) into the totals."""
        with self._counts:
            self.hits += hits
            self.misses += misses
