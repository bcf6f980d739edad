"""The direct tier's host row cache, as the host core's DirectCore keeps it (compiled and numpy
reference alike): a hit always returns the row's own bytes, a set never holds a row twice, the
least recently used way is the one replaced, a read admits at most `ways` rows into one set,
each into its own way, and a repeated row once."""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import requires_native
from plestore import native
from plestore.io.memory import HostBuffer
from plestore.native.reference.direct import PARALLEL_ROWS, probe_numpy, probe_torch
from plestore.native.rowsets import set_of
from plestore.tiers.hostcache import HostRowCache

RB = 16  # bytes a row, back to back: 32 rows in each 512-B read unit
ROWS = 1 << 16
UNIT = 512
CORES = ["reference", pytest.param("compiled", marks=requires_native)]


def _bytes(rows: np.ndarray) -> np.ndarray:
    """Each row's bytes, a function of its id (so any hit can be checked)."""
    r = rows.astype(np.uint64)[:, None] * np.uint64(0x9E3779B1) + np.arange(RB, dtype=np.uint64)
    return (r % np.uint64(251)).astype(np.uint8)


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostcache") / "rows"
    path.write_bytes(_bytes(np.arange(ROWS)).tobytes())
    return path


class Direct:
    """A DirectCore of one host core over the rows file, with its cache; read() as the tier
    calls it."""

    def __init__(self, path, which: str, capacity_rows: int, ways: int) -> None:
        host = native.load("off" if which == "reference" else "on")
        self.cache = HostRowCache(capacity_rows, RB, ways)
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        self.staging, self.ahead = HostBuffer(64 * UNIT), HostBuffer(16 * UNIT)
        c = self.cache
        self.core = host.DirectCore(
            self.fd, os.fstat(self.fd).st_size, 0, UNIT, UNIT, RB, 1, RB, RB, self.staging.array,
            self.ahead.array, 16, c.tags, c.stamp, c.data, 2,
        )  # fmt: skip
        self.hits = self.misses = 0

    def read(self, rows: np.ndarray) -> tuple[np.ndarray, int]:
        out = np.zeros((rows.size, RB), np.uint8)
        hits, _, _, bad = self.core.read(rows, out, RB)
        assert bad == -1
        np.testing.assert_array_equal(out, _bytes(rows))  # every row its own bytes
        self.hits, self.misses = self.hits + hits, self.misses + rows.size - hits
        return out, hits

    def contains(self, rows: np.ndarray) -> np.ndarray:
        c = self.cache
        return (c.tags[set_of(rows, c.sets)] == rows[:, None]).any(1)

    def same_set(self, count: int, of: int, start: int = 0) -> np.ndarray:
        """`count` row ids from `start` on that share row `of`'s set."""
        rows = np.arange(start, ROWS)
        return rows[set_of(rows, self.cache.sets) == set_of(np.array([of]), self.cache.sets)][
            :count
        ]

    def close(self) -> None:
        self.core.close()
        os.close(self.fd)


@pytest.fixture
def direct(rows_file, request):
    made = []

    def make(which: str, capacity_rows: int, ways: int) -> Direct:
        made.append(Direct(rows_file, which, capacity_rows, ways))
        return made[-1]

    yield make
    for d in made:
        d.close()


@pytest.mark.parametrize("which", CORES)
def test_random_workload_hits_return_their_own_bytes_and_sets_stay_distinct(direct, which):
    d = direct(which, 64, 4)
    rng = np.random.default_rng(0)
    for _ in range(300):
        rows = np.unique(rng.integers(0, 400, rng.integers(1, 40)))
        before = d.contains(rows).sum()
        _, hits = d.read(rows)
        assert hits == before  # exactly the rows cached are hits
        held = d.cache.tags[d.cache.tags >= 0]
        assert len(held) == len(np.unique(held)) <= d.cache.capacity_rows
    assert d.hits > 0 and d.misses > 0


@pytest.mark.parametrize("which", CORES)
def test_the_least_recently_used_way_is_replaced(direct, which):
    d = direct(which, 8, 2)
    a, b, c = d.same_set(3, of=0)
    for r in (a, b):
        d.read(np.array([r]))
    assert d.read(np.array([a]))[1] == 1  # a is now the more recent
    d.read(np.array([c]))
    assert d.contains(np.array([a, b, c])).tolist() == [True, False, True]


@pytest.mark.parametrize("which", CORES)
def test_one_read_admits_at_most_ways_rows_per_set_each_in_its_own_way(direct, which):
    d = direct(which, 16, 4)
    rows = d.same_set(6, of=0)
    d.read(rows)
    assert d.contains(rows).sum() == 4
    assert d.read(rows)[1] == 4  # (every held way now equally recent)
    more = d.same_set(2, of=int(rows[0]), start=int(rows[-1]) + 1)
    d.read(more)  # a second read for the same set replaces its least recently used ways
    assert d.contains(more).all() and d.contains(rows).sum() == 2


@pytest.mark.parametrize("which", CORES)
def test_large_reads_probe_in_parallel_and_agree(direct, which):
    """Reads past PARALLEL_ROWS probe on several threads (the compiled core's pool, the
    reference's torch ops); hits still return their own bytes, with every way count."""
    rng = np.random.default_rng(3)
    n, k = 2 * PARALLEL_ROWS + 100, 3 * PARALLEL_ROWS // 2  # k of n rows cached
    for ways in (8, 3):
        d = direct(which, 10 * n, ways)
        rows = rng.permutation(ROWS)[:n]
        d.read(rows[:k])
        hit = d.contains(rows)
        _, hits = d.read(rows)
        assert hits == hit.sum() and hit[:k].mean() > 0.98 and not hit[k:].any()
        assert d.read(rows[hit])[1] == hit.sum()  # every one a hit


def test_the_numpy_and_torch_probes_agree():
    """The reference probes past PARALLEL_ROWS in torch ops (its int64 hash must name the same
    set as numpy's uint64 one, for any id), smaller ones in numpy: same hits, bytes, recency."""
    rng = np.random.default_rng(4)
    rows = np.unique(rng.integers(0, 1 << 62, 3000))
    rows[:3] = [0, (1 << 62) - 1, (1 << 31) + 7]
    caches = [HostRowCache(capacity_rows=4096, row_bytes=RB, ways=8) for _ in range(2)]
    for c in caches:
        s = set_of(rows[:2000], c.sets)
        for r, st in zip(rows[:2000].tolist(), s.tolist(), strict=True):  # fill free ways
            free = np.flatnonzero(c.tags[st] < 0)
            if free.size:
                c.tags[st, free[0]] = r
                c.data[st * c.ways + free[0]] = _bytes(np.array([r]))[0]
    ask = rng.permutation(rows)
    outs = [np.zeros((len(ask), RB), np.uint8) for _ in caches]
    hits = [
        probe(c.tags, c.stamp, c.data, ask, out, 7)
        for probe, c, out in zip((probe_numpy, probe_torch), caches, outs, strict=True)
    ]
    np.testing.assert_array_equal(hits[0], hits[1])
    np.testing.assert_array_equal(outs[0][hits[0]], outs[1][hits[1]])
    np.testing.assert_array_equal(outs[0][hits[0]], _bytes(ask[hits[0]]))
    np.testing.assert_array_equal(caches[0].stamp, caches[1].stamp)
    assert 0.9 < hits[0].sum() / 2000 <= 1


@pytest.mark.parametrize("which", CORES)
def test_rows_that_repeat_are_admitted_once(direct, which):
    d = direct(which, 64, 4)
    d.read(np.array([5, 9, 5, 5, 9, 11]))
    assert (d.cache.tags >= 0).sum() == 3
    assert d.read(np.array([5, 9, 11]))[1] == 3
