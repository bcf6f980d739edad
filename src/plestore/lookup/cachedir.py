"""Which rows the GPU row cache holds: the host's directory of it, in numpy.

Regions of slots, each slot one packed row:

    resident [0, R)       a whole range of rows [r0, r0 + R) (a cascade's device budget): a
                          row's slot is its id - r0
    static   [R, R + S)   the hot rows of a profile of real text (`plestore profile`), sorted by
                          id: a row's slot is its position (found by a binary search); never evicted
    dynamic  [R + S, ..)  `sets` x `ways`, set-associative by a multiplicative hash of the row id;
                          a missed row is admitted by frequency (TinyLFU-like): once it was seen
                          `admit_min` times, into its set's least recently used way, if that way is
                          empty or holds a row seen less often

Frequencies live in a counting sketch of ~2 16-bit counters per dynamic slot (one hash;
collisions only overcount), all halved every `age_every` counted ids so old popularity fades.

The directory is pure numpy, shared by the GPU cache (`plestore.lookup.gpucache`: device data
and device tags follow its decisions) and by the hit-rate simulation (`plestore.bench.hitrate`),
so what the benchmark reports is what the cache does.
"""

from __future__ import annotations

import numpy as np

__all__ = ["CacheDirectory"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX = np.uint64(0xBF58476D1CE4E5B9)
_SATURATED = 30000  # counters stop here (16 bits)
_MAX_SKETCH_BITS = 27  # 256 MiB of counters at most (collisions only overcount)


class CacheDirectory:
    def __init__(
        self,
        static_rows: np.ndarray | None,
        dynamic_rows: int,
        ways: int = 8,
        admit_min: int = 2,
        sketch_per_slot: int = 2,
        resident: tuple[int, int] = (0, 0),
    ) -> None:
        self.resident = (int(resident[0]), int(resident[1]))
        if not 0 <= self.resident[0] <= self.resident[1]:
            raise ValueError(f"resident rows must be a range [start, end), got {resident}")
        static = np.zeros(0, np.int64) if static_rows is None else np.asarray(static_rows)
        if static.ndim != 1 or (static.size and static.dtype.kind not in "iu"):
            raise ValueError("static rows must be a 1-D integer array of row ids")
        static = np.unique(static.astype(np.int64))  # sorted, distinct
        r0, r1 = self.resident
        self.static = static[(static < r0) | (static >= r1)]  # (resident rows are cached anyway)
        if dynamic_rows < 0:
            raise ValueError(f"dynamic rows must be >= 0, got {dynamic_rows}")
        self.ways = max(1, min(ways, dynamic_rows)) if dynamic_rows else 1
        self.sets = dynamic_rows // self.ways
        self.admit_min = admit_min
        self.tags = np.full((self.sets, self.ways), -1, np.int64)  # row per dynamic slot
        self.stamp = np.zeros((self.sets, self.ways), np.int64)  # last use, for LRU
        want = max(1, self.dynamic_capacity * sketch_per_slot) - 1
        bits = min(_MAX_SKETCH_BITS, max(10, int(want).bit_length()))
        self._sketch_mask = np.uint64((1 << bits) - 1)
        self.sketch = np.zeros(1 << bits, np.uint16) if self.sets else np.zeros(0, np.uint16)
        self.age_every = 10 * (1 << bits) // max(1, sketch_per_slot)
        self._counted = 0
        self._clock = 0

    @property
    def resident_rows(self) -> int:
        return self.resident[1] - self.resident[0]

    @property
    def static_capacity(self) -> int:
        return int(self.static.size)

    @property
    def first_dynamic(self) -> int:
        return self.resident_rows + self.static_capacity

    @property
    def dynamic_capacity(self) -> int:
        return self.sets * self.ways

    @property
    def slots(self) -> int:
        return self.first_dynamic + self.dynamic_capacity

    # -- probing -----------------------------------------------------------------------------
    def _set_of(self, rows: np.ndarray) -> np.ndarray:
        h = rows.astype(np.uint64) * _GOLDEN
        return ((h >> np.uint64(32)) % np.uint64(max(1, self.sets))).astype(np.int64)

    def _static_slot(self, rows: np.ndarray) -> np.ndarray:
        """Slots of resident and static rows (-1 for others)."""
        r0, r1 = self.resident
        slot = np.where((rows >= r0) & (rows < r1), rows - r0, -1)
        if self.static.size:
            pos = np.minimum(np.searchsorted(self.static, rows), self.static.size - 1)
            slot = np.where(self.static[pos] == rows, self.resident_rows + pos, slot)
        return slot

    def locate(self, rows: np.ndarray, touch: bool = True) -> np.ndarray:
        """Slot of each row id (int64 [n], -1: not cached); touch: count a use (recency and
        frequency)."""
        rows = np.asarray(rows, np.int64).reshape(-1)
        slot = self._static_slot(rows)
        if self.sets:
            miss = slot < 0
            r = rows[miss]
            s = self._set_of(r)
            match = self.tags[s] == r[:, None]  # [m, ways]
            hit = match.any(1)
            way = match.argmax(1)
            dyn = np.where(hit, self.first_dynamic + s * self.ways + way, -1)
            slot[miss] = dyn
            if touch:
                self._clock += 1
                self.stamp[s[hit], way[hit]] = self._clock
                self._count(rows)
        return slot

    def _sketch_index(self, rows: np.ndarray) -> np.ndarray:
        h = (rows.astype(np.uint64) ^ np.uint64(0x5BD1E995)) * _MIX
        return ((h >> np.uint64(29)) & self._sketch_mask).astype(np.int64)

    def _count(self, rows: np.ndarray) -> None:
        idx = self._sketch_index(rows)
        np.add.at(self.sketch, idx, 1)
        full = idx[self.sketch[idx] > _SATURATED]  # (a lookup adds < 2^16 - _SATURATED to one)
        self.sketch[full] = _SATURATED
        self._counted += rows.size
        if self._counted >= self.age_every:
            self.sketch >>= 1
            self._counted = 0

    def frequency(self, rows: np.ndarray) -> np.ndarray:
        if not self.sets:
            return np.zeros(len(rows), np.int64)
        return self.sketch[self._sketch_index(np.asarray(rows, np.int64))].astype(np.int64)

    # -- admission ---------------------------------------------------------------------------
    def admit(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Admit some of `rows` (missed row ids, distinct) into dynamic slots. Returns (slots,
        which): row rows[which[i]] now lives in slots[i] (the row that slot held is evicted)."""
        rows = np.asarray(rows, np.int64)
        none = np.zeros(0, np.int64)
        if not self.sets or rows.size == 0:
            return none, none
        freq = self.frequency(rows)
        cand = np.flatnonzero(freq >= self.admit_min)
        if cand.size == 0:
            return none, none
        s = self._set_of(rows[cand])
        # group by set, most frequent first; at most `ways` candidates per set
        order = np.lexsort((-freq[cand], s))
        cand, s = cand[order], s[order]
        first = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
        rank = np.arange(cand.size) - np.repeat(first, np.diff(np.r_[first, cand.size]))
        keep = rank < self.ways
        cand, s, rank = cand[keep], s[keep], rank[keep]
        lru = np.argsort(self.stamp[s], axis=1, kind="stable")  # [k, ways] oldest first
        way = lru[np.arange(cand.size), rank]
        old = self.tags[s, way]
        ok = (old < 0) | (freq[cand] > self.frequency(np.maximum(old, 0)))
        cand, s, way = cand[ok], s[ok], way[ok]
        self._clock += 1
        self.tags[s, way] = rows[cand]
        self.stamp[s, way] = self._clock
        return self.first_dynamic + s * self.ways + way, cand

    def dynamic_tags(self) -> np.ndarray:
        """Row id per dynamic slot, int64 [D] (-1: empty)."""
        return self.tags.reshape(-1)

    def clear(self) -> None:
        """Forget the dynamic rows and frequencies (the static set stays)."""
        self.tags.fill(-1)
        self.stamp.fill(0)
        self.sketch.fill(0)
        self._counted = 0
