"""native feed_serve (feedserve.c, hoststep.c) against its numpy reference: a graph feed's host
side — the ids checked, this rank's ids, the GPU row cache directory's probe, the misses read by
the tier's parts (a gather from host memory, the direct tier's core) into the feed's staging,
the index, READY — the same bytes, index, held slots, directory, counters and returns from both
cores."""

from __future__ import annotations

import os
import threading
import time
import zlib

import numpy as np
import pytest

from conftest import requires_native
from plestore import native
from plestore.io.memory import HostBuffer
from plestore.kernels.feed import HEADER_WORDS, KEY, POSTED, READY, TIMED_OUT
from plestore.lookup.gpudirectory import SATURATED, GpuCacheDirectory
from plestore.native.constants import WARM_READS, C
from plestore.native.plans import CachePlan, GatherPlan

reference = native.load("off")
core = native.load("on") if native.available() else None
CORES = [
    pytest.param(reference, id="reference"),
    pytest.param(core, id="compiled", marks=requires_native),
]
RB, STRIDE, RPB, BLOCK, TOTAL = 90, 96, 5, 512, 400  # a blocked layout of 400 rows
STATE = {s: i for i, s in enumerate(native.FEED_STATES)}
WORDS = len(native.FEED_COUNTERS)


def _source():
    """Host memory of TOTAL rows (global ids from 0) at a blocked layout, after a 64-B header."""
    blocks = -(-TOTAL // RPB)
    return np.random.default_rng(1).integers(0, 256, 64 + blocks * BLOCK, dtype=np.uint8)


def _row(src, i):
    off = 64 + (i // RPB) * BLOCK + (i % RPB) * STRIDE
    return src[off : off + RB]


def _want(src, ids, start, end):
    """(staged rows [n, STRIDE] in order of this rank's ids, index [n]) as stage_staging."""
    mine = [int(i) for i in ids if start <= i < end]
    rows = np.zeros((len(ids), STRIDE), np.uint8)
    for j, i in enumerate(mine):
        rows[j, :RB] = _row(src, i)
    index = np.full(len(ids), -1, np.int64)
    index[[k for k, i in enumerate(ids) if start <= i < end]] = np.arange(len(mine))
    return rows, index


class _Feed:
    def __init__(self, n, held=False):
        self.box = np.zeros(n, np.int64)
        self.rows = np.zeros(n * STRIDE, np.uint8)
        self.index = np.zeros(n, np.int64)
        self.held = np.full(n, -1, np.int64) if held else None

    def buffers(self):
        return self.box, self.rows, self.index, self.held

    def staged(self, index_at):
        """The row the decode reads for output position i: staging row index_at[i]."""
        return self.rows.reshape(-1, STRIDE)[index_at, :RB]


def _gather(src, file=None, clean=WARM_READS, checks=None):
    """A gather part's source; clean: reads in a row that needed no disk (cold below 2);
    checks: (crcs, check unit, data bytes) of src's rows (verify_reads)."""
    return GatherPlan(src, 64, RB, 0, RPB, BLOCK, STRIDE, 2, 2, clean, file, checks)


def _plan(src, start, end, parts=None, cache=None):
    parts = parts or ((start, end, False, _gather(src)),)
    return (TOTAL, start, end, parts, cache)


def _serve(host, words, counters, feeds, plan, last, timed_out=0):
    bufs = tuple(f.buffers() for f in feeds)
    return host.feed_serve(words, counters, bufs, plan, last, timed_out, 0, 0.0, 20e-6, 40e-6, 0.02)


def _post(words, feed, key, ids):
    feed.box[:] = ids
    words[KEY] = key
    words[POSTED] += 1


def _fresh(n=1):
    return np.zeros(HEADER_WORDS, np.int64), np.zeros(WORDS, np.int64), [_Feed(k) for k in (n,)]


@pytest.mark.parametrize("host", CORES)
@pytest.mark.parametrize("start, end", [(0, TOTAL), (100, 250)])
def test_feed_serve_stages_a_step_as_the_python_staging_does(host, start, end):
    src, rng = _source(), np.random.default_rng(2)
    words, counters = np.zeros(HEADER_WORDS, np.int64), np.zeros(WORDS, np.int64)
    feeds = [_Feed(3), _Feed(12)]
    last, absent = 0, 0
    for step in range(4):
        key = step % 2
        ids = rng.integers(0, TOTAL, feeds[key].box.size)
        ids[-1] = ids[0]  # a repeat
        _post(words, feeds[key], key, ids)
        state, last, _, _ = _serve(host, words, counters, feeds, _plan(src, start, end), last)
        assert native.FEED_STATES[state] == "quiet" and last == step + 1 == words[READY]
        rows, index = _want(src, ids, start, end)
        got = feeds[key].rows.reshape(-1, STRIDE)
        u = int((index >= 0).sum())
        assert np.array_equal(got[:u, :RB], rows[:u, :RB])
        assert np.array_equal(feeds[key].index, index)
        absent += int((index < 0).sum())
    assert counters[C.STEPS] == 4 and counters[C.ROWS] == 30 and counters[C.ABSENT] == absent


def _crcs(src, data):
    """verify_reads' CRC-32 of each BLOCK of src's first `data` row bytes (after its header)."""
    return np.array(
        [zlib.crc32(src[64 + a : 64 + min(a + BLOCK, data)]) for a in range(0, data, BLOCK)],
        np.uint32,
    )


def test_both_cores_check_a_steps_blocks_alike():
    """A gather part with block CRC-32s (verify_reads): the rows' blocks checked in the step,
    call by call the same on both cores: rows exact where every block matches; the first
    failing block of the step's rows (CORRUPT, the block) once a byte flips; a row past the
    checked bytes refused at its position."""
    if core is None:
        pytest.skip("the native core is not built")
    src = _source()
    data = src.size - 64
    ids = np.array([5, 300, 6, 42, 399, 5])  # blocks 1, 60, 1, 8, 79 (a block seen twice)
    calls = [
        (src, _crcs(src, data), data, ids, ("quiet", 0)),
        (src, _crcs(src, data), data, ids[::-1].copy(), ("quiet", 0)),
    ]
    bad = src.copy()
    bad[64 + 60 * BLOCK + 7] ^= 0x10  # row 300's block
    bad[64 + 8 * BLOCK + 7] ^= 0x10  # row 42's
    calls += [
        (bad, _crcs(src, data), data, ids, ("corrupt", 60)),  # (row 300 comes before 42)
        (bad, _crcs(src, data), data, ids[::-1].copy(), ("corrupt", 8)),
        (src, _crcs(src, 60 * BLOCK), 60 * BLOCK, ids, ("bad_row", 1)),  # row 300: unchecked
    ]
    for buf, crcs, nbytes, step_ids, want in calls:
        got = []
        for host in (reference, core):
            words, counters, (feed,) = _fresh(ids.size)
            part = _gather(buf, checks=(crcs, BLOCK, nbytes))
            _post(words, feed, 0, step_ids)
            state, _, detail, _ = _serve(
                host, words, counters, [feed], _plan(buf, 0, TOTAL, ((0, TOTAL, False, part),)), 0
            )
            got.append((native.FEED_STATES[state], detail))
            if state == 0:
                want_rows = np.array([_row(buf, i) for i in step_ids])
                assert np.array_equal(feed.staged(feed.index), want_rows)
        assert got == [want, want]


@pytest.mark.parametrize("host", CORES)
def test_two_parts_each_read_their_rows_and_the_index_finds_them(host):
    """A cascade's plan: rows [150, 260) from part 0 (another copy: its bytes differ), the rest
    from part 1; part 0's rows come first in staging, in order, and the index points each id at
    its row; a row no part holds is refused at its position."""
    src, other = _source(), _source()[::-1].copy()
    words, counters, (feed,) = _fresh(10)
    parts = ((150, 260, False, _gather(other)), (0, TOTAL, False, _gather(src)))
    ids = np.array([5, 200, 399, 150, 259, 260, 200, 17, 300, 151])
    _post(words, feed, 0, ids)
    state, *_ = _serve(host, words, counters, [feed], _plan(src, 0, TOTAL, parts), 0)
    assert state == STATE["quiet"] and words[READY] == 1
    first = (ids >= 150) & (ids < 260)
    order = np.r_[np.flatnonzero(first), np.flatnonzero(~first)]
    assert np.array_equal(feed.index[order], np.arange(ids.size))
    want = [_row(other, i) if 150 <= i < 260 else _row(src, i) for i in ids]
    assert np.array_equal(feed.staged(feed.index), np.array(want))
    parts = ((150, 260, False, _gather(other)), (0, 300, False, _gather(src)))
    _post(words, feed, 0, ids)
    state, _, at, _ = _serve(host, words, counters, [feed], _plan(src, 0, TOTAL, parts), 1)
    assert (state, at) == (STATE["bad_row"], 2)  # rows 399 and 300: in no part; the first


@pytest.fixture
def direct_cores(tmp_path):
    """Both cores' DirectCore over one file of TOTAL rows of RB bytes back to back, each with a
    row cache of its own; closed after."""
    path = tmp_path / "rows"
    data = np.random.default_rng(7).integers(0, 256, (TOTAL, RB), np.uint8)
    path.write_bytes(data.tobytes())
    made = []

    def make(host):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        bufs = HostBuffer(64 * 512), HostBuffer(16 * 512)
        tags, stamp = np.full((8, 4), -1, np.int64), np.zeros((8, 4), np.int64)
        cache = np.zeros((32, RB), np.uint8)
        c = host.DirectCore(
            fd, os.fstat(fd).st_size, 0, 1024, 512, RB, 1, RB, RB, bufs[0].array, bufs[1].array,
            16, tags, stamp, cache, 1,
        )  # fmt: skip
        made.append((c, fd, bufs))
        return c, tags

    yield data, make
    for c, fd, bufs in made:
        c.close()
        os.close(fd)
        for b in bufs:
            b.close()


@pytest.mark.parametrize("host", CORES)
def test_a_direct_part_reads_through_its_core(host, direct_cores):
    """The direct tier's core as a part: its rows exact, its row cache hit on the second step
    (counted), a closed core's step refused as a failed read (-1: closed)."""
    data, make = direct_cores
    direct, tags = make(host)
    words, counters, (feed,) = _fresh(6)
    plan = _plan(None, 0, TOTAL, ((0, TOTAL, False, direct),))
    ids = np.array([3, 90, 91, 399, 3, 250])
    for step in (1, 2):
        _post(words, feed, 0, ids)
        state, *_ = _serve(host, words, counters, [feed], plan, step - 1)
        assert state == STATE["quiet"] and words[READY] == step
        assert np.array_equal(feed.staged(feed.index), data[ids])
    assert counters[C.DIRECT_ROWS] == 12 and counters[C.HOST_HITS] >= 6 and counters[C.BLOCKS] >= 1
    assert (tags >= 0).sum() > 0
    direct.close()
    _post(words, feed, 0, ids)
    state, _, detail, _ = _serve(host, words, counters, [feed], plan, 2)
    assert (state, detail) == (STATE["read_failed"], -1) and words[READY] == 2


def _directory(host, resident=(0, 40)):
    d = GpuCacheDirectory(np.arange(300, 320), 64, ways=4, admit_min=1, resident=resident,
                          static_slots=32, core=host)  # fmt: skip
    d.admit(np.arange(100, 140))  # dynamic rows 100..139, seen once: admitted
    return d


def _cache_plan(d, base):
    r0, r1 = d.resident
    return CachePlan(d.lock, d.static_tags, d.tags, d.stamp, d.sketch, d.state, r0, r1,
                     d.static_sets, d.sets, d.ways, d.sketch_mask, SATURATED, d.age_every,
                     base)  # fmt: skip


@pytest.mark.parametrize("host", CORES)
def test_the_gpu_cache_probe_gives_slots_and_stages_only_the_misses(host):
    """Hits (resident, static, dynamic) indexed by their slot, misses staged from `base` on,
    each id's dynamic slot held, the directory touched as locate() touches it."""
    src = _source()
    d, twin = _directory(host), _directory(host)
    base = d.slots
    words, counters = np.zeros(HEADER_WORDS, np.int64), np.zeros(WORDS, np.int64)
    feed = _Feed(8, held=True)
    ids = np.array([5, 310, 120, 200, 120, 399, 39, 131])
    _post(words, feed, 0, ids)
    plan = _plan(src, 0, TOTAL, cache=_cache_plan(d, base))
    state, *_ = _serve(host, words, counters, [feed], plan, 0)
    assert state == STATE["quiet"] and words[READY] == 1
    slot = twin.locate(ids)  # what the probe must have found (and done to the directory)
    assert np.array_equal(d.stamp, twin.stamp) and np.array_equal(d.sketch, twin.sketch)
    assert d.state[0] == twin.state[0] and d.state[1] == twin.state[1] and d.state[2] == 1
    hit = slot >= 0
    assert np.array_equal(feed.index[hit], slot[hit])
    misses = np.flatnonzero(~hit)
    assert np.array_equal(feed.index[misses], base + np.arange(misses.size))
    assert np.array_equal(feed.staged(feed.index[misses] - base), [_row(src, i) for i in ids[~hit]])
    dyn = slot >= d.first_dynamic
    assert np.array_equal(feed.held, np.where(dyn, slot - d.first_dynamic, -1))
    assert counters[C.GPU_HITS] == hit.sum() and counters[C.STEPS] == 1


@pytest.mark.parametrize("host", CORES)
def test_feed_serve_returns_what_only_python_does(host):
    """A bad id (its position; no READY), an unknown feed, a TIMED_OUT the GPU wrote, stop, and
    with no plan a post to stage in Python."""
    src = _source()
    plan = _plan(src, 0, TOTAL)
    words, counters, (feed,) = _fresh(4)
    for bad in (-1, TOTAL):
        _post(words, feed, 0, [1, 2, bad, 3])
        state, last, at, _ = _serve(host, words, counters, [feed], plan, words[POSTED] - 1)
        assert (state, last, at) == (STATE["bad_id"], words[POSTED], 2)
        assert words[READY] == 0 and counters[C.STEPS] == 0
    _post(words, feed, 5, [1, 2, 3, 4])
    state, last, at, _ = _serve(host, words, counters, [feed], plan, words[POSTED] - 1)
    assert (state, last, at) == (STATE["no_feed"], words[POSTED] - 1, 5)
    words[TIMED_OUT] = 9
    state, *_ = _serve(host, words, counters, [feed], plan, words[POSTED])
    assert state == STATE["timed_out"]
    _post(words, feed, 0, [1, 2, 3, 4])
    state, last, *_ = host.feed_serve(words, counters, (), None, last, 9, 0, 0.0, 20e-6, 4e-5, 1)
    assert (state, last) == (STATE["posted"], words[POSTED])
    counters[C.STOP] = 1
    state, *_ = _serve(host, words, counters, [feed], plan, last, timed_out=9)
    assert state == STATE["stop"]


@pytest.mark.parametrize("host", CORES)
def test_a_moved_file_is_refused(host, tmp_path):
    """A mapped part's file, checked before each step: unlinked (another change time and link
    count), the step is refused as file_changed with file_state's 2 (the tier says what moved)."""
    path = tmp_path / "f"
    path.write_bytes(b"x" * 64)
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        file = (fd, st.st_size, st.st_nlink, st.st_ctime_ns)
        src = _source()
        parts = ((0, TOTAL, False, _gather(src, file)),)
        words, counters, (feed,) = _fresh(2)
        _post(words, feed, 0, [1, 2])
        assert _serve(host, words, counters, [feed], _plan(src, 0, TOTAL, parts), 0)[0] == 0
        os.unlink(path)
        _post(words, feed, 0, [1, 2])
        state, _, detail, _ = _serve(host, words, counters, [feed], _plan(src, 0, TOTAL, parts), 1)
        assert (state, detail) == (STATE["file_changed"], 2) and words[READY] == 1  # unlinked
    finally:
        os.close(fd)


@pytest.mark.parametrize("host", CORES)
@pytest.mark.parametrize("cold", [True, False])
def test_a_cold_mappings_pages_are_advised_before_its_faults(host, cold, tmp_path):
    """A mapped part the plan calls cold: its step's pages go to the kernel at once
    (WILLNEED: the faults then find them, no major fault; the bytes counted), until two steps
    in a row need no disk; one called warm faults them in (major faults)."""
    path = tmp_path / "rows"
    path.write_bytes(_source().tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        st = os.fstat(fd)
        src = np.memmap(path, np.uint8, "r")
        file = (fd, st.st_size, st.st_nlink, st.st_ctime_ns)
        words, counters, (feed,) = _fresh(12)
        ids = np.arange(12) * 33  # 12 rows, each on its own page
        disk, clean = 0, 0 if cold else WARM_READS
        for step in range(4):  # each call's plan seeded with the last (as GraphFeeder's)
            parts = ((0, TOTAL, False, _gather(src, file, clean)),)
            _post(words, feed, 0, ids)
            _serve(host, words, counters, [feed], _plan(src, 0, TOTAL, parts), step)
            if step == 0:
                if counters[C.MAJOR] + counters[C.DISK] == 0:
                    pytest.skip("the file could not be evicted here (its pages stay cached)")
                assert (counters[C.MAJOR] == 0) == cold
            # the mapping's reads in a row that needed no disk, for the tier (cold below 2)
            needed = counters[C.MAJOR] + counters[C.DISK] > disk
            clean = 0 if needed else min(clean + 1, WARM_READS)
            disk = counters[C.MAJOR] + counters[C.DISK]
            assert counters[C.CLEAN] == clean
            assert words[READY] == step + 1
            assert np.array_equal(feed.staged(feed.index), [_row(src, i) for i in ids])
    finally:
        os.close(fd)


@pytest.mark.parametrize("host", CORES)
def test_feed_serve_wakes_on_a_post_from_another_thread(host):
    """Sleeping between polls (no spin, sleeps growing to 1 ms): a post from another thread is
    served within a few sleeps, the GIL free meanwhile."""
    src = _source()
    words, counters, (feed,) = _fresh(2)

    def post():
        time.sleep(0.05)
        _post(words, feed, 0, [7, 8])

    poster = threading.Thread(target=post)
    poster.start()
    plan = _plan(src, 0, TOTAL)
    t0 = time.monotonic()
    while words[READY] != 1 and time.monotonic() - t0 < 5:
        host.feed_serve(words, counters, (feed.buffers(),), plan, 0, 0, 0, 0.0, 50e-6, 1e-3, 0.2)
    poster.join()
    assert words[READY] == 1 and time.monotonic() - t0 < 2


@pytest.mark.parametrize("host", CORES)
def test_a_bad_plan_is_a_clear_error(host):
    src, few = _source(), np.zeros(1, np.uint32)  # (1,024 bytes need 2 CRCs of 512)
    words, counters, (feed,) = _fresh(2)
    cases = {
        "1 or 2 parts": _plan(src, 0, TOTAL, parts=((0, 1, False, _gather(src)),) * 3),
        "row range": (TOTAL, 10, 5, ((0, TOTAL, False, _gather(src)),), None),
        "a gather or a DirectCore": _plan(src, 0, TOTAL, parts=((0, 5, False, 7),)),
        "layout": _plan(
            src,
            0,
            TOTAL,
            parts=((0, 5, False, (src, 64, 600, 0, RPB, BLOCK, STRIDE, 2, 2, False, None, None)),),
        ),
        "crcs": _plan(
            src, 0, TOTAL, parts=((0, TOTAL, False, _gather(src, checks=(few, 512, 1024))),)
        ),
    }
    for what, plan in cases.items():
        with pytest.raises((ValueError, TypeError), match=what):
            _serve(host, words, counters, [feed], plan, 0)


def test_both_cores_stage_the_same_bytes_index_and_directory():
    if core is None:
        pytest.skip("the native core is not built")
    src, rng = _source(), np.random.default_rng(5)
    got = []
    for host in (reference, core):
        d = _directory(host)
        words, counters = np.zeros(HEADER_WORDS, np.int64), np.zeros(WORDS, np.int64)
        feed = _Feed(16, held=True)
        parts = ((200, 300, False, _gather(src[::-1].copy())), (50, 350, False, _gather(src)))
        plan = _plan(src, 50, 350, parts, _cache_plan(d, d.slots))
        for step in range(3):
            ids = np.r_[rng.integers(0, TOTAL, 12), [100, 120, 310, 39]]
            _post(words, feed, 0, ids)
            _serve(host, words, counters, [feed], plan, step)
        rng = np.random.default_rng(5)
        got.append((feed.rows.copy(), feed.index.copy(), feed.held.copy(), counters.copy(),
                    d.stamp.copy(), d.sketch.copy(), d.state.copy()))  # fmt: skip
    counters = [g[3] for g in got]
    for c in counters:
        c[[7, 12]] = 0  # (the times)
    for a, b in zip(*got, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("host", CORES)
def test_host_step_alone_is_feed_serves_step(host):
    """host_step (a staged lookup's stage()) stages as feed_serve does — rows, index, held slots,
    the directory, the counters — a rank's range and a GPU row cache's probe included; a bad id
    is its state and position; its counters and feed are checked as feed_serve's."""
    src, rng = _source(), np.random.default_rng(4)
    d, twin = _directory(host), _directory(host)
    alone, served = _Feed(12, held=True), _Feed(12, held=True)
    counters, (words, fed, _) = np.zeros(WORDS, np.int64), _fresh()  # fed: feed_serve's
    for step in range(3):
        ids = rng.integers(0, TOTAL, 12)
        ids[-1] = ids[0]
        alone.box[:] = ids
        plan = _plan(src, 50, 350, cache=_cache_plan(d, d.slots))
        assert host.host_step(plan, alone.buffers(), counters) == (0, 0)
        _post(words, served, 0, ids)
        twin_plan = _plan(src, 50, 350, cache=_cache_plan(twin, twin.slots))
        assert _serve(host, words, fed, [served], twin_plan, step)[0] == STATE["quiet"]
        for a, b in zip(alone.buffers(), served.buffers(), strict=True):
            assert np.array_equal(a, b)
        assert np.array_equal(d.stamp, twin.stamp) and np.array_equal(d.sketch, twin.sketch)
    same = [C.STEPS, C.ROWS, C.ABSENT, C.GPU_HITS, C.MAJOR, C.DISK]
    assert np.array_equal(counters[same], fed[same]) and counters[C.STEPS] == 3
    alone.box[4] = TOTAL
    plan = _plan(src, 0, TOTAL)
    assert host.host_step(plan, alone.buffers(), counters) == (STATE["bad_id"], 4)
    with pytest.raises(ValueError, match="counters"):
        host.host_step(plan, alone.buffers(), np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="does not fit"):
        host.host_step(plan, (alone.box, alone.rows, alone.index[:3], None), counters)
