"""The direct tier's row cache: a hit always returns the row's own bytes, a set never holds a row
twice, the least recently used way is the one replaced, and a batch admits at most `ways` rows
into one set, each into its own way."""

from __future__ import annotations

import numpy as np

from plestore.tiers.hostcache import HostRowCache

RB = 12


def _bytes(rows: np.ndarray) -> np.ndarray:
    """Each row's bytes, a function of its id (so any hit can be checked)."""
    r = rows.astype(np.uint64)[:, None] * np.uint64(0x9E3779B1) + np.arange(RB, dtype=np.uint64)
    return (r % np.uint64(251)).astype(np.uint8)


def _same_set_rows(cache: HostRowCache, count: int, start: int = 0, of: int = 0) -> np.ndarray:
    """`count` row ids from `start` on that share row `of`'s set."""
    rows = np.arange(start, start + 200_000)
    return rows[cache._set_of(rows) == cache._set_of(np.array([of]))[0]][:count]


def test_random_workload_hits_return_their_own_bytes_and_sets_stay_distinct():
    cache = HostRowCache(capacity_rows=64, row_bytes=RB, ways=4)
    rng = np.random.default_rng(0)
    for _ in range(300):
        rows = np.unique(rng.integers(0, 400, rng.integers(1, 40)))
        out = np.zeros((len(rows), RB), np.uint8)
        hit = cache.get(rows, out)
        np.testing.assert_array_equal(out[hit], _bytes(rows[hit]))
        assert not out[~hit].any()  # misses are left alone
        miss = rows[~hit]
        cache.put(miss, _bytes(miss))
        assert cache.contains(rows).sum() >= hit.sum()
        held = cache.tags[cache.tags >= 0]
        assert len(held) == len(np.unique(held)) <= cache.capacity_rows
    assert cache.hits > 0 and cache.misses > 0


def test_the_least_recently_used_way_is_replaced():
    cache = HostRowCache(capacity_rows=8, row_bytes=RB, ways=2)
    a, b, c = _same_set_rows(cache, 3)
    for r in (a, b):
        cache.put(np.array([r]), _bytes(np.array([r])))
    cache.get(np.array([a]), np.zeros((1, RB), np.uint8))  # a is now the more recent
    cache.put(np.array([c]), _bytes(np.array([c])))
    assert cache.contains(np.array([a, b, c])).tolist() == [True, False, True]


def test_one_batch_admits_at_most_ways_rows_per_set_each_in_its_own_way():
    cache = HostRowCache(capacity_rows=16, row_bytes=RB, ways=4)
    rows = np.sort(_same_set_rows(cache, 6))
    assert cache.put(rows, _bytes(rows)) == 4
    held = cache.contains(rows)
    assert held.sum() == 4
    out = np.zeros((6, RB), np.uint8)
    hit = cache.get(rows, out)
    np.testing.assert_array_equal(out[hit], _bytes(rows[hit]))
    # a second batch for the same set replaces the least recently used (all equal: any 2)
    more = np.sort(_same_set_rows(cache, 2, start=300_000, of=int(rows[0])))
    assert cache.put(more, _bytes(more)) == 2
    assert cache.contains(more).all() and cache.contains(rows).sum() == 2


def test_large_batches_take_the_parallel_gathers_and_agree():
    """Batches past io.memory.PARALLEL_ROWS gather tags and rows on torch's threads; hits still
    return their own bytes, with every way count (the any-way test reads 1-8 ways as one int)."""
    from plestore.io.memory import PARALLEL_ROWS, take_rows

    rng = np.random.default_rng(3)
    src = rng.integers(0, 255, (5000, RB), dtype=np.uint8)
    idx = rng.integers(0, 5000, 3 * PARALLEL_ROWS)
    np.testing.assert_array_equal(take_rows(src, idx), src[idx])
    np.testing.assert_array_equal(take_rows(src, idx[:10]), src[idx[:10]])
    n, k = 2 * PARALLEL_ROWS + 100, 3 * PARALLEL_ROWS // 2  # k of n rows cached
    for ways in (8, 3):
        cache = HostRowCache(capacity_rows=10 * n, row_bytes=RB, ways=ways)
        rows = rng.permutation(np.unique(rng.integers(0, 1 << 40, n + 50)))[:n]
        cache.put(rows[:k], _bytes(rows[:k]))
        out = np.zeros((len(rows), RB), np.uint8)
        hit = cache.get(rows, out)
        assert hit[:k].mean() > 0.98 and not hit[k:].any()  # (a few lost to full sets)
        np.testing.assert_array_equal(out[hit], _bytes(rows[hit]))
        full = np.zeros((hit.sum(), RB), np.uint8)
        assert cache.get(rows[hit], full).all()  # every one a hit: written in place
        np.testing.assert_array_equal(full, _bytes(rows[hit]))


def test_the_numpy_and_torch_probes_agree():
    """Batches past PARALLEL_ROWS probe in torch ops (its int64 hash must name the same set as
    numpy's uint64 one, for any id); smaller ones in numpy: same hits, bytes and recency."""
    rng = np.random.default_rng(4)
    rows = np.unique(rng.integers(0, 1 << 62, 3000))
    rows[:3] = [0, (1 << 62) - 1, (1 << 31) + 7]
    caches = [HostRowCache(capacity_rows=4096, row_bytes=RB, ways=8) for _ in range(2)]
    for cache in caches:
        cache.put(rows[:2000], _bytes(rows[:2000]))
    ask = rng.permutation(rows)
    outs = [np.zeros((len(ask), RB), np.uint8) for _ in caches]
    hits = [caches[0]._get(ask, outs[0]), caches[1]._get_parallel(ask, outs[1])]
    np.testing.assert_array_equal(hits[0], hits[1])
    np.testing.assert_array_equal(outs[0][hits[0]], outs[1][hits[1]])
    np.testing.assert_array_equal(outs[0][hits[0]], _bytes(ask[hits[0]]))
    np.testing.assert_array_equal(caches[0].stamp, caches[1].stamp)
    assert 0.9 < hits[0].sum() / 2000 <= 1


def test_rows_that_repeat_are_admitted_once():
    cache = HostRowCache(capacity_rows=64, row_bytes=RB, ways=4)
    rows = np.array([5, 9, 5, 5, 9, 11])
    assert cache.put(rows, _bytes(rows), distinct=False) == 3
    out = np.zeros((3, RB), np.uint8)
    assert cache.get(np.array([5, 9, 11]), out).all()
    np.testing.assert_array_equal(out, _bytes(np.array([5, 9, 11])))
    assert (cache.tags >= 0).sum() == 3
