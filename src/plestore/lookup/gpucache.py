"""A row cache in device memory (HBM) in front of a host tier: hits never touch the tier.

    data  uint8 [static S | dynamic D | scratch | trash 1, stride]  (device)

The host's `GpuCacheDirectory` decides which rows live in which slot (static hot set from a
profile, dynamic admission by frequency); the device holds their packed bytes, exactly as the
tier returns them, so a hit is decoded by the same `gather_decode` kernel as a tier's row and is
bit-identical by construction. One lookup through the cache:

    host    slot = directory.locate(ids); the tier reads only the misses into pinned staging
    device  staging -> scratch (one H2D); index = slot | scratch position; one gather_decode
            over `data`; then the admitted misses are copied scratch -> their slots (on the
            device: no second transfer)

Every device step has a fixed shape per lookup size, and the host never waits for the device.
Lookups on different streams are ordered through one event (`last`): each waits for the
previous lookup's copies before its own reads and writes. A staged lookup (`Table.staged`, for
CUDA graphs) only reads the cache: its one kernel takes hits from `data` and misses from its own
pinned staging (a decode step's: read where they are, no copy in the graph); the dynamic slots
it located stay held (never evicted) until its next stage(), by when the caller has run its
decode(). A graph feed's host step (native, no Python) probes the directory itself, under its
lock, and writes the slots its feed holds into an array registered here (`hold_array`).
Every call here that reads or writes the directory takes its lock.
`probe(ids)` is the directory's lookup done in torch ops on the device (fixed shapes, no sync),
for rows whose ids live on the device.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from plestore import native
from plestore.lookup.gpudirectory import SATURATED, GpuCacheDirectory, static_slots_for
from plestore.lookup.profile import load_profile
from plestore.native.constants import STATIC_WAYS
from plestore.native.plans import CachePlan
from plestore.native.rowsets import row_hash_torch
from plestore.options import TableOptions, Tuning

if TYPE_CHECKING:
    from plestore.tablefile import TableFile
    from plestore.tiers import Tier

__all__ = ["GpuRowCache", "open_gpu_cache", "stream_cheaper"]

log = logging.getLogger("plestore")

#: rows of scratch for the misses of one host-path lookup: a batch-64 prefill chunk of 128
#: tokens is 131,072 ids; larger lookups go through the cache in pieces of this many ids
SCRATCH_ROWS = 131072
_LOAD_ROWS = 65536  # static rows read from the tier per batch at open
#: a random block read costs the time streaming the file moves this many bytes in.
#: measured: RESULTS.md "GPU row cache: its start"
_RANDOM_READ_BYTES = 8 << 10


def stream_cheaper(file: TableFile, rows: np.ndarray) -> bool:
    """Whether reading the span of these (sorted) rows in order costs less disk time than
    reading their blocks one by one: one random read takes the time a sequential read moves
    _RANDOM_READ_BYTES in."""
    if rows.size == 0:
        return False
    offs = file.layout.offsets(rows)
    reads = np.unique(offs // (file.layout.block_bytes or 4096)).size  # (unblocked: pages)
    return reads * _RANDOM_READ_BYTES > int(offs[-1] - offs[0]) + file.layout.row_bytes


def open_gpu_cache(tier: Tier, options: TableOptions, core: Any) -> GpuRowCache | None:
    """A table's GPU row cache in front of its tier (`gpu_cache_bytes` > 0 on a tier that reads
    into host memory, or a cascade's device budget), filled with the profile's hot rows
    (`plestore profile`), its directory on the host core `core`; or None."""
    resident = getattr(tier, "resident", (0, 0))  # a cascade's device budget
    if not (options.gpu_cache_bytes or resident[1] > resident[0]) or not tier.can_read_host:
        return None
    hot = load_profile(tier.table)
    cache = GpuRowCache(
        tier,
        options.gpu_cache_bytes,
        hot,
        options.tuning.gpu_cache_static,
        resident=resident,
        admit_min=options.tuning.gpu_cache_admit_min,
        core=core,
        threads=native.memory_threads(options.tuning.threads),
    )
    d = cache.directory
    log.info(
        "plestore: table %s: GPU row cache of %.2f GiB, %d resident rows, %d static (%s), "
        "%d dynamic; filled in %.1f s (%s)",
        tier.spec.name,
        cache.nbytes / 2**30,
        d.resident_rows,
        d.static_rows,
        "profiled" if hot is not None else "no profile",
        d.dynamic_capacity,
        cache.load_seconds,
        cache.load_way,
    )
    return cache


class GpuRowCache:
    """Packed rows of one tier in device memory, chosen by a `GpuCacheDirectory`."""

    def __init__(
        self,
        tier: Tier,
        capacity_bytes: int,
        hot_rows: np.ndarray | None = None,
        static_share: float = Tuning.gpu_cache_static,
        ways: int = 8,
        resident: tuple[int, int] = (0, 0),
        admit_min: int = Tuning.gpu_cache_admit_min,
        core: Any = None,
        threads: int = 1,
    ) -> None:
        if not 0.0 <= static_share <= 1.0:
            raise ValueError(f"gpu_cache_static must be in [0, 1], got {static_share}")
        device = self.device = tier.device
        self.tier = tier
        self.stride = tier.staging_stride
        self.row_bytes = tier.row_bytes
        slots = capacity_bytes // self.stride
        hot = np.zeros(0, np.int64) if hot_rows is None else np.asarray(hot_rows, np.int64)
        rr = tier.row_range
        hot = hot[(hot >= rr.start) & (hot < rr.end)]  # this rank's rows only
        hot = hot[(hot < resident[0]) | (hot >= resident[1])]  # resident rows are there anyway
        n_static = static_slots_for(hot.size, int(slots * static_share))
        self.directory = GpuCacheDirectory(
            hot,
            slots - n_static,
            ways,
            admit_min,
            resident=resident,
            static_slots=n_static,
            core=core,
            threads=threads,
        )
        d = self.directory
        self.base = d.slots  # first scratch row
        self.trash = self.base + SCRATCH_ROWS
        self.data = torch.zeros((self.trash + 1, self.stride), dtype=torch.uint8, device=device)
        # each staged lookup's and graph feed's slots (by id(owner)), one per id (-1: none),
        # written by its host step: costs follow the held rows, not the cache (a scan of every
        # slot per lookup was slow. measured: RESULTS.md "GPU row cache on the full-size table")
        self._hold_arrays: dict[int, np.ndarray] = {}
        # (the holds' version when it was made, their union): the directory's state[2] is
        # bumped by every hold, a feed's step's included
        self._held_now: tuple[int, np.ndarray] = (-1, np.zeros(0, np.int64))
        # the directory on the device, for probe(): static and dynamic tags [sets, ways]
        self.static_tags = torch.from_numpy(d.static_tags).to(device)
        self.dyn_tags = torch.full((d.dynamic_capacity + 1,), -1, dtype=torch.int64, device=device)
        self.cuda = device.type == "cuda"
        self.last: torch.cuda.Event | None = None
        self.load_way = "static rows read"  # or "file streamed": how _load_static filled it
        t0 = time.perf_counter()
        try:
            self._load_static()
        except BaseException:  # (a bad block, an I/O error): the device memory goes back now
            self.close()
            raise
        self.load_seconds = time.perf_counter() - t0

    def close(self) -> None:
        """Let the device memory go (the table closes the cache after its last lookup)."""
        self.data = self.static_tags = self.dyn_tags = None
        self.last = None

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.static_tags.numel() * 8 + self.dyn_tags.numel() * 8

    def _load_static(self) -> None:
        """The resident range streamed from the file in order; the static rows into their slots,
        read from the tier in batches of _LOAD_ROWS, or, for those on storage, picked from the
        file streamed in order where that costs the disk less (a profile touching over ~6% of a
        table's 512-B blocks)."""
        d, tier = self.directory, self.tier
        if d.resident_rows:
            r0 = d.resident[0]

            def put_resident(first: int, rows: np.ndarray) -> None:
                dst = self.data[first - r0 : first - r0 + len(rows), : self.row_bytes]
                dst.copy_(torch.from_numpy(np.ascontiguousarray(rows)))

            self._stream(d.resident, put_resident, "GPU row cache, resident rows")
        # static rows, and the static rows of full sets that start in the dynamic region
        tags = np.r_[d.static_tags.reshape(-1), d.dynamic_tags()]
        pos = np.flatnonzero(tags >= 0)  # the slots (after the resident ones) holding a row
        order = np.argsort(tags[pos], kind="stable")
        rows, slots = tags[pos][order], d.resident_rows + pos[order]  # by row: reads ascend
        buf = np.zeros((min(pos.size, _LOAD_ROWS), self.stride), np.uint8)

        def put(at: np.ndarray, packed: np.ndarray | None = None) -> None:  # rows[at]
            if packed is None:
                tier.read(rows[at], buf[: at.size])
            else:
                buf[: at.size, : self.row_bytes] = packed
            dst = torch.from_numpy(slots[at]).to(self.device)
            self.data.index_copy_(0, dst, torch.from_numpy(buf[: at.size]).to(self.device))

        disk = tier.on_storage(rows)
        if not stream_cheaper(tier.table, rows[disk]):
            disk[:] = False
        streamed, read = np.flatnonzero(disk), np.flatnonzero(~disk)
        for a in range(0, read.size, _LOAD_ROWS):
            put(read[a : a + _LOAD_ROWS])
        if streamed.size:
            on = rows[streamed]

            def pick(first: int, packed: np.ndarray) -> None:  # a piece of the span, in order
                a, b = np.searchsorted(on, [first, first + len(packed)])
                for c in range(a, b, _LOAD_ROWS):
                    e = min(b, c + _LOAD_ROWS)
                    put(streamed[c:e], packed[on[c:e] - first])

            self._stream((int(on[0]), int(on[-1]) + 1), pick, "GPU row cache, static rows")
            self.load_way = "file streamed"
        self.dyn_tags[:-1].copy_(torch.from_numpy(d.dynamic_tags()))
        if pos.size:
            self.tier.drop_cache()  # what the tier cached while loading is not the workload's

    def _stream(self, rows: tuple[int, int], sink, what: str) -> None:
        """TableFile.stream with the tier's block checks and, with `progress`, a bar."""
        bar = None
        if self.tier.options.progress:
            from tqdm import tqdm

            n = (rows[1] - rows[0]) * self.row_bytes
            bar = tqdm(total=n, unit="B", unit_scale=True, desc=what, leave=False)
        try:
            self.tier.table.stream(*rows, sink, self.tier.checks, bar and bar.update)
        finally:
            if bar is not None:
                bar.close()

    # -- ordering ----------------------------------------------------------------------------
    def begin(self, stream) -> None:
        """Make `stream` wait for the cache's last writes (no host wait)."""
        if self.cuda and self.last is not None:
            stream.wait_event(self.last)

    def end(self, stream) -> None:
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(stream)
            self.last = ev

    # -- host-path lookups -------------------------------------------------------------------
    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slot of each row or -1, positions of the misses): the tier reads rows[misses]."""
        with self.directory.lock:
            slot = self.directory.locate(rows)
        return slot, np.flatnonzero(slot < 0)

    def misses(self, rows: np.ndarray) -> np.ndarray:
        """The rows not cached now: a hint for a tier's prefetch, taken outside the host jobs'
        lock (a lookup admitting after it may make it stale: a row read twice or found later)."""
        with self.directory.lock:
            return rows[self.directory.locate(rows, touch=False) < 0]

    def index(self, slot: np.ndarray, misses: np.ndarray, scratch: int) -> np.ndarray:
        """The kernel's index into `data`: a hit's slot, a miss's scratch row."""
        idx = slot.copy()
        idx[misses] = scratch + np.arange(misses.size, dtype=np.int64)
        return idx

    def admissions(self, missed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slots, scratch positions) of the admitted ones of a lookup's missed rows, in the
        order they were staged (repeats included: admit takes a row's first)."""
        with self.directory.lock:  # (the holds as the admission sees them)
            held = self.held()
            if held.size:  # slots a staged lookup will read stay as they are
                return self._admit_unheld(missed, held)
            return self.directory.admit(missed)

    def _admit_unheld(self, missed: np.ndarray, held: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """directory.admit with the held slots (dynamic positions) made the newest of their
        sets, and any admission into one undone."""
        d = self.directory
        stamp, tags = d.stamp.reshape(-1), d.tags.reshape(-1)
        saved_stamp, saved_tags = stamp[held], tags[held]
        stamp[held] = np.iinfo(np.int64).max  # never the LRU way
        slots, which = d.admit(missed)
        stamp[held], tags[held] = saved_stamp, saved_tags
        ok = ~np.isin(slots - d.first_dynamic, held)
        return slots[ok], which[ok]

    def admission_index(
        self, slots: np.ndarray, scratch_pos: np.ndarray, rows: np.ndarray, out: np.ndarray
    ) -> None:
        """out int64 [4 * k] (pinned staging, for apply): the admitted misses' scratch rows,
        their slots, their positions among the dynamic slots and their row ids."""
        admitted = out.reshape(4, -1)  # [4, k]
        admitted[0], admitted[1] = self.base + scratch_pos, slots
        admitted[2], admitted[3] = slots - self.directory.first_dynamic, rows

    def apply(self, admitted: torch.Tensor) -> None:
        """On the current stream, from admission_index's [4, k] on the device: each admitted
        miss copied from scratch into its slot; the device tags follow."""
        self.data.index_copy_(0, admitted[1], self.data.index_select(0, admitted[0]))
        self.dyn_tags.index_copy_(0, admitted[2], admitted[3])

    # -- staged lookups ----------------------------------------------------------------------
    def hold_array(self, owner: object, held: np.ndarray | None) -> None:
        """`owner` (a staged lookup, a graph feed) holds the slots in `held` (int64, a dynamic
        position an id, -1: none; no admission evicts them), written by its host step under the
        directory's lock; None: no more."""
        with self.directory.lock:
            if held is None:
                self._hold_arrays.pop(id(owner), None)
            else:
                self._hold_arrays[id(owner)] = held
            self.directory.state[2] += 1

    def held(self) -> np.ndarray:
        """The held dynamic slots (positions in the dynamic region), distinct; under the
        directory's lock. (A staged lookup closed by another thread meanwhile only makes the
        union one hold too many, once.)"""
        version, union = self._held_now
        if version != self.directory.state[2]:
            version = int(self.directory.state[2])
            parts = [a[a >= 0] for a in self._hold_arrays.values()]
            union = np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
            self._held_now = (version, union)
        return union

    def feed_plan(self) -> CachePlan:
        """The directory as a graph feed's host step takes it (hoststep.c's cache plan)."""
        d = self.directory
        r0, r1 = d.resident
        return CachePlan(
            lock=d.lock, static_tags=d.static_tags, tags=d.tags, stamp=d.stamp, sketch=d.sketch,
            state=d.state, resident_start=r0, resident_end=r1, static_sets=d.static_sets,
            sets=d.sets, ways=d.ways, sketch_mask=d.sketch_mask, saturated=SATURATED,
            age_every=d.age_every, base=self.base,
        )  # fmt: skip

    # -- device probe ------------------------------------------------------------------------
    def probe(self, ids: torch.Tensor) -> torch.Tensor:
        """Slot of each id (int64 [n], -1: not cached) from the device copy of the directory:
        torch ops of fixed shapes, no host sync (capturable). Equals directory.locate(ids,
        touch=False) once the device has run every admission so far."""
        d = self.directory
        slot = torch.full_like(ids, -1)
        r0, r1 = d.resident
        if r1 > r0:
            slot = torch.where((ids >= r0) & (ids < r1), ids - r0, slot)
        h = row_hash_torch(ids) if d.static_sets or d.sets else None  # (set_of's, once)
        if d.static_sets:
            s = h % d.static_sets
            match = self.static_tags.index_select(0, s) == ids[:, None]  # [n, STATIC_WAYS]
            pos = d.resident_rows + s * STATIC_WAYS + match.to(torch.uint8).argmax(1)
            slot = torch.where(match.any(1), pos, slot)
        if d.sets:
            s = h % d.sets
            tags = self.dyn_tags[:-1].view(d.sets, d.ways).index_select(0, s)  # [n, ways]
            match = tags == ids[:, None]
            way = match.to(torch.uint8).argmax(1)
            dyn = d.first_dynamic + s * d.ways + way
            slot = torch.where((slot < 0) & match.any(1), dyn, slot)
        return slot

    def clear(self) -> None:
        """Forget the dynamic rows (cold measurements); the static set stays."""
        with self.directory.lock:
            self.directory.clear()
        self.dyn_tags.fill_(-1)

    def describe(self) -> dict:
        d = self.directory
        return {
            "bytes": self.nbytes,
            "row_stride": self.stride,
            "resident_rows": [d.resident[0], d.resident[1]],
            "static_rows": d.static_rows,
            "static_slots": d.static_capacity,
            "dynamic_rows": d.dynamic_capacity,
            "ways": d.ways,
            "admit_min": d.admit_min,
            "load_seconds": self.load_seconds,
            "load": self.load_way,
        }
