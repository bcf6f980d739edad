"""native feed_serve (feedserve.c) against its numpy reference: a graph feed's host side —
the ids checked, this rank's index, the rows gathered into the feed's staging, READY — the
same bytes, index, counters and returns from both cores."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from conftest import requires_native
from plestore import native
from plestore.kernels.feed import HEADER_WORDS, KEY, POSTED, READY, TIMED_OUT
from plestore.lookup.graphfeed import ABSENT, ROWS, STEPS, STOP

reference = native.load("off")
core = native.load("on") if native.available() else None
CORES = [
    pytest.param(reference, id="reference"),
    pytest.param(core, id="compiled", marks=requires_native),
]
RB, STRIDE, RPB, BLOCK, TOTAL = 90, 96, 5, 512, 400  # a blocked layout of 400 rows
STATE = {s: i for i, s in enumerate(native.FEED_STATES)}


def _source():
    """Host memory of TOTAL rows (global ids from 0) at a blocked layout, after a 64-B header."""
    blocks = -(-TOTAL // RPB)
    return np.random.default_rng(1).integers(0, 256, 64 + blocks * BLOCK, dtype=np.uint8)


def _want(src, ids, start, end):
    """(staged rows [n, STRIDE] in order of this rank's ids, index [n]) as stage_staging."""
    mine = [int(i) for i in ids if start <= i < end]
    rows = np.zeros((len(ids), STRIDE), np.uint8)
    for j, i in enumerate(mine):
        off = 64 + (i // RPB) * BLOCK + (i % RPB) * STRIDE
        rows[j, :RB] = src[off : off + RB]
    index = np.full(len(ids), -1, np.int64)
    index[[k for k, i in enumerate(ids) if start <= i < end]] = np.arange(len(mine))
    return rows, index


class _Feed:
    def __init__(self, n):
        self.box = np.zeros(n, np.int64)
        self.rows = np.zeros(n * STRIDE, np.uint8)
        self.index = np.zeros(n, np.int64)

    def buffers(self):
        return self.box, self.rows, self.index


def _serve(host, words, counters, feeds, src, start, end, last, timed_out=0):
    plan = (src, 64, RB, 0, RPB, BLOCK, STRIDE, TOTAL, start, end, 2, 2, False, None)
    bufs = tuple(f.buffers() for f in feeds)
    return host.feed_serve(words, counters, bufs, plan, last, timed_out, 0, 0.0, 20e-6, 40e-6, 0.02)


def _post(words, feed, key, ids):
    feed.box[:] = ids
    words[KEY] = key
    words[POSTED] += 1


@pytest.mark.parametrize("host", CORES)
@pytest.mark.parametrize("start, end", [(0, TOTAL), (100, 250)])
def test_feed_serve_stages_a_step_as_the_python_staging_does(host, start, end):
    src, rng = _source(), np.random.default_rng(2)
    words, counters = np.zeros(HEADER_WORDS, np.int64), np.zeros(8, np.int64)
    feeds = [_Feed(3), _Feed(12)]
    last, absent = 0, 0
    for step in range(4):
        key = step % 2
        ids = rng.integers(0, TOTAL, feeds[key].box.size)
        ids[-1] = ids[0]  # a repeat
        _post(words, feeds[key], key, ids)
        state, last, _, _ = _serve(host, words, counters, feeds, src, start, end, last)
        assert native.FEED_STATES[state] == "quiet" and last == step + 1 == words[READY]
        rows, index = _want(src, ids, start, end)
        got = feeds[key].rows.reshape(-1, STRIDE)
        u = int((index >= 0).sum())
        assert np.array_equal(got[:u, :RB], rows[:u, :RB])
        assert np.array_equal(feeds[key].index, index)
        absent += int((index < 0).sum())
    assert counters[STEPS] == 4 and counters[ROWS] == 30 and counters[ABSENT] == absent


@pytest.mark.parametrize("host", CORES)
def test_feed_serve_returns_what_only_python_does(host):
    """A bad id (its position; no READY), an unknown feed, a TIMED_OUT the GPU wrote, stop, and
    with no plan a post to stage in Python."""
    src = _source()
    words, counters = np.zeros(HEADER_WORDS, np.int64), np.zeros(8, np.int64)
    feed = _Feed(4)
    for bad in (-1, TOTAL):
        _post(words, feed, 0, [1, 2, bad, 3])
        state, last, at, _ = _serve(host, words, counters, [feed], src, 0, TOTAL, words[POSTED] - 1)
        assert (state, last, at) == (STATE["bad_id"], words[POSTED], 2)
        assert words[READY] == 0 and counters[STEPS] == 0
    _post(words, feed, 5, [1, 2, 3, 4])
    state, last, at, _ = _serve(host, words, counters, [feed], src, 0, TOTAL, words[POSTED] - 1)
    assert (state, last, at) == (STATE["no_feed"], words[POSTED] - 1, 5)
    words[TIMED_OUT] = 9
    state, *_ = _serve(host, words, counters, [feed], src, 0, TOTAL, words[POSTED])
    assert state == STATE["timed_out"]
    _post(words, feed, 0, [1, 2, 3, 4])
    state, last, *_ = host.feed_serve(words, counters, (), None, last, 9, 0, 0.0, 20e-6, 4e-5, 1)
    assert (state, last) == (STATE["posted"], words[POSTED])
    counters[STOP] = 1
    state, *_ = _serve(host, words, counters, [feed], src, 0, TOTAL, last, timed_out=9)
    assert state == STATE["stop"]


@pytest.mark.parametrize("host", CORES)
def test_feed_serve_wakes_on_a_post_from_another_thread(host):
    """Sleeping between polls (no spin, sleeps growing to 1 ms): a post from another thread is
    served within a few sleeps, the GIL free meanwhile."""
    src = _source()
    words, counters = np.zeros(HEADER_WORDS, np.int64), np.zeros(8, np.int64)
    feed = _Feed(2)

    def post():
        time.sleep(0.05)
        _post(words, feed, 0, [7, 8])

    poster = threading.Thread(target=post)
    poster.start()
    plan = (src, 64, RB, 0, RPB, BLOCK, STRIDE, TOTAL, 0, TOTAL, 1, 1, False, None)
    t0 = time.monotonic()
    while words[READY] != 1 and time.monotonic() - t0 < 5:
        host.feed_serve(words, counters, (feed.buffers(),), plan, 0, 0, 0, 0.0, 50e-6, 1e-3, 0.2)
    poster.join()
    assert words[READY] == 1 and time.monotonic() - t0 < 2


def test_both_cores_stage_the_same_bytes():
    if core is None:
        pytest.skip("the native core is not built")
    src, rng = _source(), np.random.default_rng(5)
    ids = rng.integers(0, TOTAL, 16)
    got = []
    for host in (reference, core):
        words, counters, feed = np.zeros(HEADER_WORDS, np.int64), np.zeros(8, np.int64), _Feed(16)
        _post(words, feed, 0, ids)
        _serve(host, words, counters, [feed], src, 50, 300, 0)
        got.append((feed.rows.copy(), feed.index.copy(), counters[1:4].copy()))
    u = int((got[0][1] >= 0).sum())
    rows = [g[0].reshape(-1, STRIDE)[:u, :RB] for g in got]
    assert np.array_equal(rows[0], rows[1])
    assert np.array_equal(got[0][1], got[1][1]) and np.array_equal(got[0][2], got[1][2])
