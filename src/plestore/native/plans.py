"""What the host core's step takes from a table, by name: the GPU row cache's directory and a
gather part's source. hoststep.c parses each positionally, in these fields' order (one
definition: the lookup builds them by name, the numpy reference reads them by name)."""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["CachePlan", "GatherPlan"]


class GatherPlan(NamedTuple):
    """A part read by a gather from host memory (pinned, or a mapping): hoststep.c's
    parse_gather."""

    src: Any  # the bytes (a buffer)
    src_offset: int  # where row data starts in src
    row_bytes: int
    base: int  # the global id of src's first row
    rows_per_block: int  # the layout rule (native.layout_rule)
    block: int
    stride: int
    threads: int  # a warm read's pool threads
    cold_threads: int  # a cold mapping's
    clean: int  # reads in a row that needed no disk (cold below WARM_READS)
    file: tuple | None  # a mapping's file check (fd, size, nlink, ctime_ns), or None
    checks: tuple | None  # verify_reads: (crcs uint32, check unit, data bytes), or None


class CachePlan(NamedTuple):
    """The GPU row cache's directory as the step probes it: hoststep.c's parse_cache."""

    lock: Any  # the core's Mutex the directory is probed under
    static_tags: Any  # int64 [static_sets, STATIC_WAYS]
    tags: Any  # int64 [sets, ways]
    stamp: Any  # int64 [sets, ways]
    sketch: Any  # int32 [sketch_mask + 1]
    state: Any  # int64 [3]: clock, ids counted since the sketch's halving, holds' version
    resident_start: int  # rows [resident_start, resident_end) resident (a cascade's device part)
    resident_end: int
    static_sets: int
    sets: int
    ways: int
    sketch_mask: int
    saturated: int  # the sketch's ceiling
    age_every: int  # ids counted between the sketch's halvings
    base: int  # the first staging slot a miss takes (the cache's scratch rows)
