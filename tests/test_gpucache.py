"""The GPU row cache in front of every host tier: hits, misses and evictions return the tier's
bytes (bit-identical to a resident gather + decode), through lookup, prefetch and staged
lookups; the directory's admission rules; the device probe agrees with the host directory;
profiles are keyed by the table's data."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import plestore
from conftest import assert_bit_identical, devices, requires_cuda
from plestore.lookup.gpudirectory import GpuCacheDirectory
from plestore.lookup.plan import RowSource
from plestore.lookup.profile import load_profile, profile_path, write_profile
from plestore.tablefile import TableFile
from tier_tables import make_table as _make_table
from tier_tables import resident_rows as _want

HOST_TIERS = ["pinned", "mapped", "direct"]


@pytest.fixture(scope="module", params=["nvfp4", "fp8_e4m3"])
def table(request, tmp_path_factory):
    dim = 160
    return _make_table(tmp_path_factory.mktemp(f"gc-{request.param}"), request.param, dim)


def _zipf_ids(rng, shape, rows):
    return np.minimum(rng.zipf(1.3, size=shape), rows) - 1  # hot low rows, a long tail


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("tier", HOST_TIERS)
def test_hits_misses_evictions_are_exact(table, tier, device):
    path, ref = table
    tf = TableFile.open(path)
    hot = np.arange(40, dtype=np.int64)[::-1].copy()  # a profile: rows 0..39, most used first
    write_profile(tf, hot, np.arange(40, 0, -1), {"test": True})
    rng = np.random.default_rng(1)
    cache_rows = 96  # 40 static (share 0.5 of 96 > 40), 56 dynamic: evictions happen
    rb = tf.layout.row_bytes
    stride = -(-rb // 16) * 16 if tier == "pinned" else rb  # (pinned pads rows to 16 B)
    opts = {"gpu_cache_bytes": cache_rows * stride, "gpu_cache_static": 0.5}
    with plestore.open_table(path, tier=tier, device=device, cache_bytes=1 << 20, **opts) as t:
        cache = t.gpu_cache
        d = cache.directory  # 48 static slots (3 sets of 16) for the 40 profiled rows
        assert d.static_capacity == 48 and set(d.static_tags[d.static_tags >= 0]) <= set(hot)
        assert d.static_rows >= 30
        evicted = 0
        for step in range(60):
            ids = _zipf_ids(rng, (int(rng.integers(1, 9)), 4), tf.spec.rows)
            ids[0] = rng.integers(200, 280, 4)  # warm rows past the static set: they contend
            before = cache.directory.dynamic_tags().copy()
            got = t.lookup(ids, label="decode") if step % 2 else t.prefetch(ids).result()
            assert_bit_identical(got, _want(ref, ids))
            after = cache.directory.dynamic_tags()
            evicted += int(((before >= 0) & (before != after)).sum())
        ph = t.stats()["phases"]
        hits = sum(p["gpu_cache_hits"] for p in ph.values())
        rows = sum(p["rows"] for p in ph.values())
        assert 0 < hits < rows and evicted > 0
        assert (
            ph["decode"]["gpu_cache_hit_bytes"]
            == ph["decode"]["gpu_cache_hits"] * tf.layout.row_bytes
        )
        assert 0 < ph["decode"]["gpu_cache_hit_rate"] < 1
        assert "plestore_gpu_cache_hit_rate" in t.metrics.prometheus()
        assert t.stats()["gpu_cache"]["static_rows"] == d.static_rows
        # the device directory follows the host's: probe == locate for every row
        every = torch.arange(tf.spec.rows, device=t.device)
        assert np.array_equal(
            cache.probe(every).cpu().numpy(), cache.directory.locate(every.cpu().numpy(), False)
        )
        # cold: the dynamic part forgotten, the static set kept; still exact
        t.drop_caches()
        assert (cache.directory.dynamic_tags() < 0).all()
        ids = np.arange(64).reshape(16, 4)
        assert_bit_identical(t.lookup(ids), _want(ref, ids))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("tier", HOST_TIERS)
def test_staged_and_other_ranks_through_the_cache(table, tier, device):
    path, ref = table
    tf = TableFile.open(path)
    write_profile(tf, np.arange(500, 530), np.ones(30, np.int64), {})
    lo, hi = 500, 2500
    rng = np.random.default_rng(2)
    with plestore.open_table(
        path, tier=tier, device=device, row_start=lo, row_end=hi, gpu_cache_bytes=64 << 10
    ) as t:
        staged = t.staged((8, 4))
        assert staged.source is RowSource.GPU_CACHE
        for _ in range(12):
            ids = rng.integers(0, tf.spec.rows, (8, 4))
            ids[:4] = rng.integers(500, 540, (4, 4))  # static hits
            absent = (ids < lo) | (ids >= hi)
            t.lookup(ids)  # admits some rows while the staged lookup holds its slots
            staged.stage(ids)
            t.lookup(rng.integers(lo, hi, (64, 4)))  # evictions between stage and decode
            assert_bit_identical(staged.decode(), _want(ref, ids, absent))
        assert t.stats()["phases"]["decode"]["gpu_cache_hits"] > 0


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("cache_bytes", [0, 64 << 10])
@pytest.mark.parametrize("tier", HOST_TIERS)
def test_host_lookups_never_make_the_host_wait_for_the_device(table, tier, cache_bytes):
    """Once warm, a host tier's lookup, through the cache or not (its index and admissions
    copied from pinned staging), queues its GPU work without a blocking copy or a stream sync:
    a host that waited there would wait for the layer freeing its output."""
    path, ref = table
    rng = np.random.default_rng(5)
    with plestore.open_table(path, tier=tier, device="cuda", gpu_cache_bytes=cache_bytes) as t:
        rows = TableFile.open(path).spec.rows
        hot, seen_once = rng.integers(0, rows, (2, 64, 4))
        for _ in range(4):  # staging, the kernel and admissions warm
            t.lookup(hot)
            t.prefetch(hot).result()
        t.lookup(seen_once)  # counted once: admitted at its next lookup
        torch.cuda.synchronize()
        d = t.gpu_cache.directory if cache_bytes else None
        cached_before = 0 if d is None else (d.locate(seen_once.ravel(), touch=False) >= 0).sum()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = [t.lookup(hot), t.prefetch(seen_once).result()]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if d is not None:  # admitted
            assert (d.locate(seen_once.ravel(), touch=False) >= 0).sum() > cached_before
        for ids, rows_got in zip((hot, seen_once), got, strict=True):
            assert_bit_identical(rows_got, _want(ref, ids))


def test_held_slots_are_never_evicted_until_released(table):
    path, _ = table
    rng = np.random.default_rng(3)
    with plestore.open_table(path, tier="pinned", device="cpu", gpu_cache_bytes=32 << 10) as t:
        cache, d = t.gpu_cache, t.gpu_cache.directory
        hot = rng.integers(0, 3000, 600)
        for _ in range(3):
            t.lookup(hot.reshape(-1, 4))  # seen thrice: admitted
        filled = np.flatnonzero(d.dynamic_tags() >= 0)
        assert filled.size > 20
        keep = filled[::2]
        owner = object()
        cache.hold_array(owner, keep.astype(np.int64))  # (dynamic positions)
        rows_kept = d.dynamic_tags()[keep].copy()
        rows_free = d.dynamic_tags()[filled[1::2]].copy()
        for _ in range(4):  # other frequent rows: admissions want every way
            t.lookup(rng.integers(0, 3000, (400, 4)))
        tags = d.dynamic_tags()
        assert (tags[keep] == rows_kept).all()
        assert (tags[filled[1::2]] != rows_free).any()  # the others were evicted meanwhile
        cache.hold_array(owner, None)  # released: evictable again
        assert cache.held().size == 0
        for _ in range(4):
            t.lookup(rng.integers(0, 3000, (400, 4)))
        assert (d.dynamic_tags()[keep] != rows_kept).any()


def test_directory_admits_by_frequency_and_spares_static_rows():
    d = GpuCacheDirectory(np.array([7, 3, 5]), dynamic_rows=8, ways=2, resident=(20, 30))
    got = d.locate(np.array([3, 5, 7, 9, 20, 29]))
    assert got[3] == -1 and list(got[4:]) == [0, 9]  # resident rows: slot = id - 20
    assert len(set(got[:3])) == 3 and all(10 <= g < d.first_dynamic == 10 + 16 for g in got[:3])
    assert d.static_rows == 3 and d.locate(np.array([25]), touch=False)[0] == 5
    once = np.array([100])
    d.locate(once)
    assert d.admit(once)[0].size == 0  # seen once: not admitted
    d.locate(once)
    slots, which = d.admit(once)
    assert slots.size == 1 and d.locate(once, touch=False)[0] == slots[0] >= d.first_dynamic
    # a set of 2 ways: a third frequent row evicts the least recently used one
    cands = np.arange(1000, 100000)
    a, b = cands[d._set_of(cands) == d._set_of(once)[0]][:2]
    for _ in range(3):
        d.locate(np.array([a, b]))
    d.admit(np.array([a]))
    d.locate(np.array([a]))
    slots, _ = d.admit(np.array([b]))
    assert slots.size == 1 and d.locate(np.array([100]), touch=False)[0] == -1  # 100 went
    # admit_min=1: a row is admitted at its first miss, into an empty way; a full set evicts
    # only for a row seen more often than its least recently used one
    d = GpuCacheDirectory(None, 4, ways=2, admit_min=1)
    a, b, c = cands[d._set_of(cands) == d._set_of(once)[0]][:3]
    for row in (a, b):
        d.locate(np.array([row]))
        assert d.admit(np.array([row]))[0].size == 1
    d.locate(np.array([c]))
    assert d.admit(np.array([c]))[0].size == 0  # seen once, as often as the ways' rows
    d.locate(np.array([c]))
    assert (
        d.admit(np.array([c]))[0].size == 1 and (d.locate(np.array([a, b]), False) < 0).sum() == 1
    )


def test_profile_is_keyed_by_the_table_data(tmp_path):
    path, _ = _make_table(tmp_path, "fp8_e4m3", 160, rows=300)
    tf = TableFile.open(path)
    assert load_profile(tf) is None
    write_profile(tf, np.array([5, 1]), np.array([9, 4]), {"stream": "x"})
    assert list(load_profile(tf)) == [5, 1]
    meta = profile_path(tf).with_suffix(".json")
    meta.write_text(meta.read_text().replace(tf.data_id, "0" * len(tf.data_id)))
    assert load_profile(tf) is None  # another table's profile is not used
    with pytest.raises(ValueError, match="rows must lie"):
        write_profile(tf, np.array([300]), np.array([1]), {})


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("cached", [False, True])
def test_cascade_serves_every_part_exactly(table, device, cached):
    path, ref = table
    tf = TableFile.open(path)
    rb = tf.layout.row_bytes
    lo, hi = 100, 2900  # this rank's rows: device [100, 600), pinned [600, 1600), file the rest
    opts = dict(device_budget_bytes=500 * rb, pinned_budget_bytes=1000 * -(-rb // 16) * 16)
    with plestore.open_table(
        path,
        tier="cascade",
        device=device,
        row_start=lo,
        row_end=hi,
        gpu_cache_bytes=(64 << 10) if cached else 0,
        **opts,
    ) as t:
        plan = t.stats()["tier_detail"]["cascade"]
        assert (plan["device"], plan["pinned"], plan["file"]) == (
            [100, 600],
            [600, 1600],
            [1600, 2900],
        )
        assert "requested" in plan["reason"] and plan["file_tier"] == "direct"
        rng = np.random.default_rng(3)
        staged = t.staged((4, 4))
        for _ in range(6):
            ids = rng.integers(0, tf.spec.rows, (32, 4))
            ids[0] = [150, 700, 2000, 50]  # one row of each part, and another rank's
            absent = (ids < lo) | (ids >= hi)
            assert_bit_identical(t.lookup(ids), _want(ref, ids, absent))
            staged.stage(ids[:4])
            assert_bit_identical(staged.decode(), _want(ref, ids[:4], absent[:4]))
        ph = t.stats()["phases"]["lookup"]
        assert ph["gpu_cache_hits"] >= 6 * 4 * 2  # the device part: every lookup's first rows
    with plestore.open_table(path, tier="cascade", device="cpu") as t:  # budgets from memory
        plan = t.stats()["tier_detail"]["cascade"]
        assert plan["device"] == [0, 0] and plan["pinned"] == [0, tf.spec.rows]
        assert "available less" in plan["reason"]
        ids = np.arange(12).reshape(3, 4)
        assert_bit_identical(t.lookup(ids), _want(ref, ids))


def test_rows_the_cache_holds_are_never_read_from_disk(table):
    path, ref = table
    tf = TableFile.open(path)
    write_profile(tf, np.arange(64), np.full(64, 9), {})
    with plestore.open_table(
        path, tier="direct", device="cpu", gpu_cache_bytes=1 << 20, cache_bytes=0
    ) as t:
        ids = np.arange(64).reshape(16, 4)
        held = t.gpu_cache.directory.locate(ids.reshape(-1), touch=False) >= 0
        assert held.sum() >= 60  # (a full static set's rows start in the dynamic region)
        loaded = t.tier.blocks_read  # (the static rows, read at open)
        assert_bit_identical(t.prefetch(ids, label="decode").result(), _want(ref, ids))
        ph = t.stats()["phases"]["decode"]
        assert ph["gpu_cache_hits"] == 64 and ph["blocks_read"] == 0
        assert t.tier.blocks_read == loaded  # (counts what prefetch submitted, too): none
        ids = np.arange(64, 72).reshape(2, 4)  # not cached: read, one block per row at most
        assert_bit_identical(t.prefetch(ids, label="decode").result(), _want(ref, ids))
        assert 0 < t.stats()["phases"]["decode"]["blocks_read"] <= 8 and t.tier.blocks_read > loaded


def test_staged_lookups_of_any_number_and_size_go_through_the_cache(table):
    """Staged lookups read their misses from their own staging: any number of them, of any
    size, open at once or one after another (one per batch shape, per generate call), are
    served by the cache and exact."""
    path, ref = table
    with plestore.open_table(path, tier="pinned", device="cpu", gpu_cache_bytes=64 << 10) as t:
        for _ in range(2):
            staged = [t.staged((n, 4)) for n in (4096, 8192, 1)]
            for s in staged:
                assert s.source is RowSource.GPU_CACHE
                ids = np.arange(s.n).reshape(-1, 4) % 97
                s.stage(ids)
                assert_bit_identical(s.decode(), _want(ref, ids, np.zeros(ids.shape, bool)))
            for s in staged:
                s.close()
        assert t.stats()["phases"]["decode"]["gpu_cache_hits"] > 0


def test_gather_decode_reference_reads_past_split_from_the_second_source():
    from plestore.formats import get_format
    from plestore.kernels.gather_decode import gather_decode

    fmt, rng = get_format("bf16"), np.random.default_rng(6)
    first = torch.from_numpy(rng.integers(0, 256, (60, 128), np.uint8))
    second = torch.from_numpy(rng.integers(0, 256, (20, 128), np.uint8))
    index = torch.tensor([3, 60, -1, 59, 79, 80, 0])
    got = gather_decode(
        first, index, 0, 80, fmt, 64, 1.0, torch.empty((7, 64), dtype=torch.bfloat16), second, 60
    )
    raw = got.view(torch.uint8)
    assert torch.equal(raw[0], first[3]) and torch.equal(raw[3], first[59])
    assert torch.equal(raw[1], second[0]) and torch.equal(raw[4], second[19])
    assert (got[[2, 5]] == 0).all()  # absent: -1, and 80 (past row_count)
    assert torch.equal(raw[6], first[0])
    with pytest.raises(ValueError, match="second source"):
        gather_decode(first, index, 0, 80, fmt, 64, 1.0, got, second, None)
    with pytest.raises(ValueError, match="must be in src"):  # past either source's end
        gather_decode(first, index, 0, 81, fmt, 64, 1.0, got, second, 60)


@pytest.mark.parametrize("tier", ["mapped", "direct", "cascade"])
def test_a_large_static_set_is_picked_from_the_file_streamed_in_order(table, tier, monkeypatch):
    """A profile touching many of a table's blocks loads by streaming the file in order (a
    random read per block costs more disk time); the slots hold the same bytes either way,
    and a lookup of every profiled row is all hits, exact, with no read. A cascade's pinned
    rows come from its memory: only the file part's span is streamed."""
    from plestore.lookup import gpucache

    path, ref = table
    tf = TableFile.open(path)
    hot = np.random.default_rng(3).permutation(tf.spec.rows)[: tf.spec.rows // 4]
    write_profile(tf, hot, np.ones(hot.size, np.int64), {})
    sparse = np.sort(hot)[:: max(1, hot.size // 4)]  # a few rows far apart: read one by one
    assert gpucache.stream_cheaper(tf, np.sort(hot)) and not gpucache.stream_cheaper(tf, sparse)
    streamed, data = [], {}
    real = gpucache.GpuRowCache._stream

    def spy(self, rows, *a, **k):
        streamed.append(rows)
        return real(self, rows, *a, **k)

    monkeypatch.setattr(gpucache.GpuRowCache, "_stream", spy)
    for way, cost in (("read", 0), ("streamed", 1 << 40)):
        monkeypatch.setattr(gpucache, "_RANDOM_READ_BYTES", cost)
        pinned = 1000  # cascade: rows [0, 1000) pinned, the rest read from the file
        opts = {"pinned_budget_bytes": pinned * -(-tf.layout.row_bytes // 16) * 16}
        with plestore.open_table(
            path,
            tier=tier,
            device="cpu",
            gpu_cache_bytes=hot.size * 2 * tf.layout.row_bytes,
            **(opts if tier == "cascade" else {}),
        ) as t:
            cache = t.gpu_cache
            assert cache.directory.static_rows > 0.8 * hot.size
            data[way] = cache.data.clone()
            held = hot[cache.directory.locate(hot, touch=False) >= 0][:512].reshape(-1, 1)
            assert_bit_identical(t.lookup(held, label="hits"), _want(ref, held))
            assert t.stats()["phases"]["hits"]["gpu_cache_hits"] == held.size
            got = t.stats()["gpu_cache"]
            assert got["load"] == ("file streamed" if way == "streamed" else "static rows read")
            assert got["load_seconds"] > 0
        assert len(streamed) == (way == "streamed")
    assert streamed[0][0] >= (pinned if tier == "cascade" else 0)
    assert torch.equal(data["read"], data["streamed"])


def test_admit_min_option_reaches_the_directory_and_admits_at_first_miss(table):
    path, ref = table
    with pytest.raises(ValueError, match="gpu_cache_admit_min"):
        plestore.open_table(path, tier="pinned", device="cpu", gpu_cache_admit_min=0)
    write_profile(TableFile.open(path), np.zeros(0, np.int64), np.zeros(0, np.int64), {})
    ids = np.arange(2000, 2064).reshape(16, 4)
    for admit_min in (2, 1):
        with plestore.open_table(
            path,
            tier="pinned",
            device="cpu",
            gpu_cache_bytes=64 << 10,
            gpu_cache_admit_min=admit_min,
        ) as t:
            d = t.gpu_cache.directory
            assert d.admit_min == admit_min
            missed = (d.locate(ids.reshape(-1), False) < 0).sum()
            assert missed == ids.size  # (an empty cache: no profile)
            assert_bit_identical(t.lookup(ids), _want(ref, ids))
            admitted = missed - (d.locate(ids.reshape(-1), False) < 0).sum()
            assert admitted == (missed if admit_min == 1 else 0)  # at its first miss, or not yet
