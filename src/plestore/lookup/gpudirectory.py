"""Which rows the GPU row cache holds: the host's directory of it, numpy arrays.

Regions of slots, each slot one packed row:

    resident [0, R)       a whole range of rows [r0, r0 + R) (a cascade's device budget): a
                          row's slot is its id - r0
    static   [R, R + S)   the hot rows of a profile of real text (`plestore profile`) in 16-way
                          sets by a hash of the row id (a full set keeps its most used rows);
                          never evicted
    dynamic  [R + S, ..)  `sets` x `ways`, set-associative by a multiplicative hash of the row id;
                          a missed row is admitted by frequency (TinyLFU-like): once it was seen
                          `admit_min` times (option `gpu_cache_admit_min`), into its set's least
                          recently used way, if that way is empty or holds a row seen less often

Frequencies live in a counting sketch of ~2 int32 counters per dynamic slot (one hash;
collisions only overcount), all halved every `age_every` counted ids so old popularity fades.

A probe reads one set's tags per id (set-associative, not a search of a sorted list), and a
probe or an admission is one call of the host core (`plestore.native`: cache_locate,
cache_admit). Its scalars live in `state` (clock, ids counted since the last aging, the holds'
version) beside the arrays, so a graph feed's host step (native hoststep.c) probes it without
Python; callers sharing it across threads take `lock` (the host core's Mutex, which that step
takes too) around each call. The directory is shared by the GPU cache
(`plestore.lookup.gpucache`: device data and tags follow its decisions) and by the hit-rate
simulation (`plestore.bench.hitrate`), so what the benchmark reports is what the cache does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from plestore import native
from plestore.native.constants import STATIC_WAYS
from plestore.native.rowsets import set_of, sketch_index

__all__ = ["SATURATED", "GpuCacheDirectory", "static_slots_for"]

SATURATED = 30000  # counters stop here (a lookup adds < 2^31 - SATURATED to one)
_MAX_SKETCH_BITS = 26  # 256 MiB of int32 counters at most (collisions only overcount)
#: static rows per static slot: 16-way sets filled to 80% overflow a small share of the rows;
#: those go to the dynamic region at the start
STATIC_LOAD = 0.8


def static_slots_for(rows: int, budget: int) -> int:
    """Static slots for `rows` profiled rows within `budget` slots (a multiple of the ways)."""
    want = -(-int(np.ceil(rows / STATIC_LOAD)) // STATIC_WAYS) * STATIC_WAYS
    return min(want, budget // STATIC_WAYS * STATIC_WAYS)


def _place(tags: np.ndarray, sets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Put rows (most used first) into the empty ways of their sets of `tags` [sets, ways];
    returns (placed rows, rows of full sets)."""
    free = (tags < 0).sum(1)  # empty ways per set, filled from the last way down
    order = np.argsort(sets, kind="stable")  # by set, most used first within each
    s = sets[order]
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    rank = np.arange(s.size) - np.repeat(starts, np.diff(np.r_[starts, s.size]))
    keep = rank < free[s]
    way = tags.shape[1] - free[s] + rank  # (empty ways are the last ones: filled in order)
    tags[s[keep], way[keep]] = rows[order][keep]
    return rows[order][keep], rows[order][~keep]


class GpuCacheDirectory:
    def __init__(
        self,
        static_rows: np.ndarray | None,
        dynamic_rows: int,
        ways: int = 8,
        admit_min: int = 2,
        sketch_per_slot: int = 2,
        resident: tuple[int, int] = (0, 0),
        static_slots: int | None = None,
        core: Any = None,
        threads: int = 1,
    ) -> None:
        """static_rows: the profile's rows, most used first; static_slots: the slots they may
        take (default: static_slots_for all of them); a full set keeps its most used rows;
        core: the host core (`plestore.native.load`) that probes and admits (default: auto);
        threads: its probe's, for a large batch of ids."""
        self._core = native.load() if core is None else core
        self.threads = threads
        self.resident = (int(resident[0]), int(resident[1]))
        if not 0 <= self.resident[0] <= self.resident[1]:
            raise ValueError(f"resident rows must be a range [start, end), got {resident}")
        static = np.zeros(0, np.int64) if static_rows is None else np.asarray(static_rows)
        if static.ndim != 1 or (static.size and static.dtype.kind not in "iu"):
            raise ValueError("static rows must be a 1-D integer array of row ids")
        r0, r1 = self.resident
        static = static.astype(np.int64)
        static = static[(static < r0) | (static >= r1)]  # (resident rows are cached anyway)
        _, first = np.unique(static, return_index=True)
        static = static[np.sort(first)]  # distinct, in profile order
        if static_slots is None:
            static_slots = static_slots_for(static.size, 1 << 62)
        self.static_sets = static_slots // STATIC_WAYS
        self.static_tags = np.full((self.static_sets, STATIC_WAYS), -1, np.int64)
        spill = static[:0]  # rows a full static set turned away (none without static sets)
        if self.static_sets and static.size:
            static = static[: self.static_capacity]  # (the rest could not fit anyway)
            _, spill = _place(self.static_tags, set_of(static, self.static_sets), static)
        if dynamic_rows < 0:
            raise ValueError(f"dynamic rows must be >= 0, got {dynamic_rows}")
        self.ways = max(1, min(ways, dynamic_rows)) if dynamic_rows else 1
        self.sets = dynamic_rows // self.ways
        self.admit_min = admit_min
        self.tags = np.full((self.sets, self.ways), -1, np.int64)  # row per dynamic slot
        self.stamp = np.full((self.sets, self.ways), 0, np.int64)  # last use, for LRU (written)
        want = max(1, self.dynamic_capacity * sketch_per_slot) - 1
        bits = min(_MAX_SKETCH_BITS, max(10, int(want).bit_length()))
        self.sketch_mask = (1 << bits) - 1
        # written here (a lazily zeroed array's first touches would land inside lookups)
        self.sketch = np.full(1 << bits if self.sets else 0, 0, np.int32)
        self.age_every = 10 * (1 << bits) // max(1, sketch_per_slot)
        #: [clock, ids counted since the sketch was last halved, holds' version]
        self.state = np.zeros(3, np.int64)
        self.lock = self._core.Mutex()
        if self.sets and spill.size:  # static rows of full sets start in the dynamic region
            _place(self.tags, self._set_of(spill), spill)

    @property
    def resident_rows(self) -> int:
        return self.resident[1] - self.resident[0]

    @property
    def static_capacity(self) -> int:
        """Slots of the static region (some may be empty)."""
        return self.static_sets * STATIC_WAYS

    @property
    def static_rows(self) -> int:
        return int((self.static_tags >= 0).sum())

    @property
    def first_dynamic(self) -> int:
        return self.resident_rows + self.static_capacity

    @property
    def dynamic_capacity(self) -> int:
        return self.sets * self.ways

    @property
    def slots(self) -> int:
        return self.first_dynamic + self.dynamic_capacity

    # -- probing and admission: one call of the host core each ------------------------------
    def _set_of(self, rows: np.ndarray) -> np.ndarray:
        return set_of(rows, self.sets)

    def _sketch_index(self, rows: np.ndarray) -> np.ndarray:
        return sketch_index(rows, self.sketch_mask)

    def locate(self, rows: np.ndarray, touch: bool = True) -> np.ndarray:
        """Slot of each row id (int64 [n], -1: not cached); touch: count a use (recency and
        frequency; the counters halved every `age_every` ids counted, in the core's probe)."""
        rows = np.ascontiguousarray(rows, np.int64).reshape(-1)
        slot = np.empty(rows.size, np.int64)
        self._core.cache_locate(
            rows,
            slot,
            self.static_tags,
            self.tags,
            self.stamp,
            self.sketch,
            self.state,
            *self.resident,
            self.static_sets,
            self.sets,
            self.ways,
            touch,
            self.sketch_mask,
            SATURATED,
            self.age_every,
            self.threads,
        )
        return slot

    def frequency(self, rows: np.ndarray) -> np.ndarray:
        if not self.sets:
            return np.zeros(len(rows), np.int64)
        return self.sketch[self._sketch_index(np.asarray(rows, np.int64))].astype(np.int64)

    def admit(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Admit some of `rows` (missed row ids; a repeated row counts once, at its first
        position) into dynamic slots: seen `admit_min` times, into the set's least recently
        used way if that is empty or holds a row seen less often. Returns (slots, which): row
        rows[which[i]] now lives in slots[i] (the row that slot held is evicted)."""
        rows = np.ascontiguousarray(rows, np.int64)
        none = np.zeros(0, np.int64)
        if not self.sets or rows.size == 0:
            return none, none
        slots, which = np.empty(rows.size, np.int64), np.empty(rows.size, np.int64)
        k, candidates = self._core.cache_admit(
            rows,
            slots,
            which,
            self.tags,
            self.stamp,
            self.sketch,
            self.sets,
            self.ways,
            self.first_dynamic,
            int(self.state[0]) + 1,
            self.sketch_mask,
            self.admit_min,
        )
        self.state[0] += int(candidates > 0)
        return slots[:k], which[:k]

    def dynamic_tags(self) -> np.ndarray:
        """Row id per dynamic slot, int64 [D] (-1: empty)."""
        return self.tags.reshape(-1)

    def clear(self) -> None:
        """Forget the dynamic rows and frequencies (the static set stays)."""
        self.tags.fill(-1)
        self.stamp.fill(0)
        self.sketch.fill(0)
        self.state[1] = 0
