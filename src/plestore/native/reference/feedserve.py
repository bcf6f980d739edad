"""feed_serve's reference (feedserve.c): a graph feed's host side — wait for a post (spinning
while steps keep coming, then short sleeps), check the ids, this rank's index, the rows'
gather into the feed's staging, READY = seq — with the same arguments, returns and counters."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from plestore.native import FEED_STATES
from plestore.native.reference.files import check_file
from plestore.native.reference.gather import as_bytes, check_ids, gather

__all__ = ["feed_serve"]

POSTED, READY, TIMED_OUT, KEY = 0, 8, 24, 32  # the header's words (kernels/feed.py)
STOP, STEPS, ROWS, ABSENT, MAJOR, MINOR, DISK, GATHER_NS = range(8)  # the counters' words
_COLD_ROWS = 64


def _words(obj: Any, name: str, least: int) -> np.ndarray:
    arr = np.asarray(obj)
    if arr.dtype != np.int64 or arr.size < least:
        raise ValueError(f"feed_serve: {name} must hold int64 (at least {least})")
    return arr.reshape(-1)


def _step(plan: tuple, feed: tuple, words: np.ndarray, counters: np.ndarray, seq: int):
    """One posted step served: (0, 0) with READY written, or (state, detail)."""
    src, off, rb, base, rpb, block, stride, rows, start, end, warm, cold_t, stream, file = plan
    box, out, index = feed
    ids, index = _words(box, "box", 1), _words(index, "index", 1)
    out = as_bytes(out, writable=True)
    n = ids.size
    bad = check_ids(ids, rows)
    if bad >= 0:
        return FEED_STATES.index("bad_id"), bad
    if file is not None and (state := check_file(*file)):
        return FEED_STATES.index("file"), state
    mine = (ids >= start) & (ids < end)  # this rank's ids in order, repeats included
    u = int(mine.sum())
    index.fill(-1)
    index[mine] = np.arange(u)
    t0 = time.perf_counter_ns()
    bad, major, minor, disk = gather(
        src, np.ascontiguousarray(ids[mine]), out, out.size // n, rb, base, rpb, block, stride,
        warm, 2048, file is not None, off, False, stream,
    )  # fmt: skip
    if bad >= 0:
        return FEED_STATES.index("bad_row"), int(np.flatnonzero(mine)[bad])
    for i, v in ((STEPS, 1), (ROWS, n), (ABSENT, n - u), (MAJOR, major), (MINOR, minor)):
        counters[i] += v
    counters[DISK] += disk
    counters[GATHER_NS] += time.perf_counter_ns() - t0
    words[READY] = seq
    return 0, 0


def feed_serve(
    words: Any,
    counters: Any,
    feeds: tuple,
    plan: tuple | None,
    last: int,
    timed_out: int,
    posted_ns: int,
    spin_s: float,
    sleep_s: float,
    sleep_max_s: float,
    return_s: float,
) -> tuple[int, int, int, int]:
    """(state, the last seq seen, detail, posted_ns): see feedserve.c (the sleeps between polls
    from sleep_s doubling up to sleep_max_s)."""
    w, c = _words(words, "words", 40), _words(counters, "counters", 8)
    entered, nap = time.monotonic_ns(), sleep_s
    while True:
        seq = int(w[POSTED])
        if seq != last:
            posted_ns = time.monotonic_ns()
            if plan is None:
                return FEED_STATES.index("posted"), seq, 0, posted_ns
            key = int(w[KEY])
            if not 0 <= key < len(feeds):
                return FEED_STATES.index("no_feed"), last, key, posted_ns
            state, detail = _step(plan, feeds[key], w, c, seq)
            last, nap = seq, sleep_s
            if state:
                return state, last, detail, posted_ns
            continue
        if c[STOP]:
            return FEED_STATES.index("stop"), last, 0, posted_ns
        if int(w[TIMED_OUT]) != timed_out:
            return FEED_STATES.index("timed_out"), last, 0, posted_ns
        now = time.monotonic_ns()
        if now - posted_ns < spin_s * 1e9:
            time.sleep(0)  # (the GIL to the thread that posts)
            continue
        if now - entered > return_s * 1e9:
            return FEED_STATES.index("quiet"), last, 0, posted_ns
        time.sleep(nap)
        nap = min(2 * nap, sleep_max_s)
