"""host_step's reference (hoststep.c): a host-fed staged lookup's host step — the ids checked,
this rank's ids, the GPU row cache directory's probe (under its lock; each id's held slot), the
misses split among the tier's parts and read into the feed's staging, the decode's index — with
the same plan, buffers, counters and returns."""

from __future__ import annotations

import errno
import time
import zlib

import numpy as np

from plestore.native.constants import (
    COLD_GRAIN,
    COLD_ROWS,
    COUNTERS,
    PROBE_ROWS,
    STATIC_WAYS,
    WARM_GRAIN,
    WARM_READS,
    C,
    S,
)
from plestore.native.plans import CachePlan, GatherPlan
from plestore.native.reference.direct import DirectCore
from plestore.native.reference.files import check_file, willneed
from plestore.native.reference.gather import (
    as_bytes,
    as_ids,
    check_ids,
    gather,
    layout_offsets,
    layout_ok,
)
from plestore.native.reference.gpudirectory import cache_locate

__all__ = ["WORDS", "check_feed", "check_plan", "host_step", "part_states", "run_step"]

#: the counters' words (constants.h's C_*)
WORDS = len(COUNTERS)


def _probe(c: CachePlan, rows: np.ndarray, held: np.ndarray | None, pos: np.ndarray):
    """The directory's slots of rows (cache_locate: clock, stamps, counts, aging), under its
    lock (hoststep.c's probe_cache)."""
    slot = np.empty(rows.size, np.int64)
    with c.lock:
        cache_locate(
            rows, slot, c.static_tags, c.tags, c.stamp, c.sketch, c.state, c.resident_start,
            c.resident_end, c.static_sets, c.sets, c.ways, True, c.sketch_mask, c.saturated,
            c.age_every,
        )  # fmt: skip
        if held is not None:
            first_dynamic = c.resident_end - c.resident_start + c.static_sets * STATIC_WAYS
            held.fill(-1)
            dyn = slot >= first_dynamic
            held[pos[dyn]] = slot[dyn] - first_dynamic
        c.state[2] += 1
    return slot


def _check_blocks(source: GatherPlan, rows: np.ndarray) -> tuple[int, int]:
    """hoststep.c's check_blocks: (-1, -1), (the first block of rows failing its CRC-32, -1),
    or (0, a row's index) whose bytes lie past the checked data."""
    g, (crcs, unit, data) = source, source.checks
    offs = layout_offsets(rows, g.base, g.rows_per_block, g.block, g.stride)
    past = np.flatnonzero(offs + g.row_bytes > data)
    if past.size:
        return 0, int(past[0])
    view, seen = as_bytes(g.src)[g.src_offset :], set()
    ends = (offs + g.row_bytes - 1) // unit
    for a, b in zip((offs // unit).tolist(), ends.tolist(), strict=True):
        for u in range(a, b + 1):
            if u in seen:
                continue
            at = u * unit
            if zlib.crc32(view[at : min(at + unit, data)]) != int(crcs[u]):
                return u, -1
            seen.add(u)
    return -1, -1


def _read_direct(source: DirectCore, rows, out, stride: int, streaming: bool, counters) -> tuple:
    """A DirectCore part's read (hoststep.c's read_part): (0, 0) or (state, its detail)."""
    try:
        hits, blocks, ahead, bad = source.read(rows, out, stride, streaming)
    except RuntimeError:  # closed
        return S.READ_FAILED, -1
    except ValueError:  # out too small
        return S.READ_FAILED, -2
    except OSError as e:
        return S.READ_FAILED, e.errno or errno.EIO
    if bad >= 0:
        return S.CORRUPT, bad
    counters[C.HOST_HITS] += hits
    counters[C.DIRECT_ROWS] += rows.size
    counters[C.BLOCKS] += blocks + ahead
    counters[C.DISK] += (blocks + ahead) * source.unit
    return 0, 0


def _read(part: tuple, rows: np.ndarray, out: np.ndarray, stride: int, counters) -> tuple:
    """One part's read of rows into out (row j at j * stride): (0, 0), (S.BAD_ROW, the row) or
    (state, its detail). clean: [reads in a row that needed no disk] (cold below 2)."""
    lo, hi, streaming, source, clean = part
    outside = np.flatnonzero((rows < lo) | (rows >= hi))
    if outside.size:
        return S.BAD_ROW, int(outside[0])
    if isinstance(source, DirectCore):
        return _read_direct(source, rows, out, stride, streaming, counters)
    g, mapped = source, source.file is not None
    layout = (g.base, g.rows_per_block, g.block, g.stride)
    advised = -1  # a cold mapping: every page's read in flight before the faults
    if mapped and clean[0] < WARM_READS:
        advised = willneed(g.src, rows, g.row_bytes, *layout, g.src_offset, PROBE_ROWS)
    many = clean[0] < WARM_READS and rows.size >= COLD_ROWS
    bad, major, minor, disk = gather(
        g.src, rows, out, stride, g.row_bytes, *layout, g.cold_threads if many else g.threads,
        COLD_GRAIN if many else WARM_GRAIN, mapped, g.src_offset, False, streaming,
    )  # fmt: skip
    if bad >= 0:
        return S.BAD_ROW, bad
    if g.checks is not None:  # (after the gather, as hoststep.c)
        failed, row = _check_blocks(source, rows)
        if row >= 0:
            return S.BAD_ROW, row
        if failed >= 0:
            return S.CORRUPT, failed
    clean[0] = 0 if major > 0 or advised > 0 else min(clean[0] + 1, WARM_READS)
    if mapped:
        counters[C.CLEAN] = clean[0]
    counters[C.MAJOR] += major
    counters[C.MINOR] += minor
    counters[C.DISK] += disk + max(advised, 0)
    return 0, 0


def _named(plan: tuple) -> tuple:
    """plan with its gather sources and cache as plans.py's types: hoststep.c parses a tuple of
    their fields by position, and so, by these names, does this reference."""
    rows_total, start, end, parts, cache = plan
    parts = tuple(
        (*p[:3], GatherPlan._make(p[3]) if _holds(p[3], GatherPlan) else p[3]) for p in parts
    )
    return (
        rows_total,
        start,
        end,
        parts,
        CachePlan._make(cache) if _holds(cache, CachePlan) else cache,
    )


def _holds(t, kind) -> bool:
    return isinstance(t, tuple) and len(t) == len(kind._fields)


def check_plan(plan: tuple) -> tuple:
    """hoststep.c's checks of a plan, with its messages; the plan by name (what part_states and
    run_step take)."""
    plan = _named(plan)
    rows_total, start, end, parts, cache = plan
    if not 1 <= len(parts) <= 2 or not 0 <= start <= end <= rows_total:
        raise ValueError("host step: 1 or 2 parts and a row range in the table")
    for _, _, _, source in parts:
        if isinstance(source, DirectCore):
            continue
        if not isinstance(source, GatherPlan):
            raise TypeError("host step: a part reads by a gather or a DirectCore")
        g = source
        if not layout_ok(g.rows_per_block, g.block, g.stride, g.row_bytes) or g.src_offset < 0:
            raise ValueError("host step: a part's layout is not one RowLayout makes")
        if g.checks is not None:
            _check_checks(g.checks, as_bytes(g.src).size - g.src_offset)
    if cache is not None and (not isinstance(cache, CachePlan) or cache.age_every < 1):
        raise ValueError("host step: the cache's arrays or geometry disagree")
    return plan


def _check_checks(checks: tuple, src_bytes: int) -> None:
    """hoststep.c's parse_checks: crcs (uint32) covering data_bytes of the part's src."""
    crcs, unit, data = checks
    n = np.asarray(crcs)
    if n.itemsize != 4 or unit < 1 or not 0 <= data <= src_bytes or n.size < -(-data // unit):
        raise ValueError("host step: a part's crcs (uint32) do not cover it")


def part_states(plan: tuple) -> list[list[int]]:
    """Each part's state between steps, as a call of feed_serve keeps it: [clean reads in a
    row], as the plan (check_plan's) says (a gather's `clean`, within [0, WARM_READS])."""
    return [
        [WARM_READS if isinstance(s, DirectCore) else min(max(s.clean, 0), WARM_READS)]
        for *_, s in plan[3]
    ]


def check_feed(feed: tuple) -> None:
    """feedserve.c's checks of a feed's buffers (box, out, index, held), with its message."""
    box, _, index, held = feed
    n = np.size(box)
    if not n or np.size(index) != n or (held is not None and np.size(held) != n):
        raise ValueError("feed_serve: a feed's staging does not fit its ids")


def host_step(plan: tuple, feed: tuple, counters: np.ndarray) -> tuple[int, int]:
    """One step of `feed` (box, out, index, held) by `plan`, alone (feedserve.c's host_step: a
    staged lookup's stage()): (0, 0) staged, or (state, detail); the parts' clean state as the
    plan says, the step's in counters[C.CLEAN]."""
    c = np.asarray(counters).reshape(-1)
    if c.dtype != np.int64 or c.size < WORDS:
        raise ValueError("host_step: counters too short")
    plan = check_plan(plan)
    check_feed(feed)
    return run_step(plan, feed, c, part_states(plan))


def run_step(plan: tuple, feed: tuple, counters: np.ndarray, states: list) -> tuple[int, int]:
    """One step of `feed` (box, out, index, held) by `plan` (check_plan's): (0, 0) staged, or
    (state, detail). states: part_states(plan), kept by the caller between steps."""
    rows_total, start, end, parts, cache = plan
    box, out, index, held = feed
    ids, index = as_ids(box), np.asarray(index).reshape(-1)
    held = None if held is None else np.asarray(held).reshape(-1)
    out = as_bytes(out, writable=True)
    n = ids.size
    stride = out.size // n
    bad = check_ids(ids, rows_total)
    if bad >= 0:
        return S.BAD_ID, bad
    for *_, source in parts:
        file = None if isinstance(source, DirectCore) else source.file
        if file is not None and (state := check_file(*file)):
            return S.FILE_CHANGED, state
    pos = np.flatnonzero((ids >= start) & (ids < end))  # this rank's, repeats included
    rows, u = ids[pos], pos.size
    index.fill(-1)
    base = 0
    if cache is not None:
        slot = _probe(cache, rows, held, pos)
        hit = slot >= 0
        index[pos[hit]] = slot[hit]
        counters[C.GPU_HITS] += int(hit.sum())
        rows, pos, base = rows[~hit], pos[~hit], cache.base
    if len(parts) > 1:  # part 0's rows first, in order
        lo, hi = parts[0][:2]
        order = np.argsort(~((rows >= lo) & (rows < hi)), kind="stable")
        rows, pos = rows[order], pos[order]
        first = int(((rows >= lo) & (rows < hi)).sum())
    else:
        first = rows.size
    index[pos] = base + np.arange(rows.size)
    t0 = time.perf_counter_ns()
    at = 0
    for i, part in enumerate(parts):
        k = first if i + 1 < len(parts) else rows.size - at
        if k:
            view = out[at * stride :]
            state, which = _read((*part, states[i]), rows[at : at + k], view, stride, counters)
            if state:
                return state, int(pos[at + which]) if state == S.BAD_ROW else which
        at += k
    counters[C.GATHER_NS] += time.perf_counter_ns() - t0
    counters[C.STEPS] += 1
    counters[C.ROWS] += n
    counters[C.ABSENT] += n - u
    return 0, 0
