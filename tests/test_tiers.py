"""One conformance suite for every tier: output bit-identical to a resident gather + decode, for
every format, device (cpu here; cuda on the GPU machine) and awkward input; I/O faults raise and
the table keeps working; concurrent lookups; timeouts; other ranks' ids are never read."""

from __future__ import annotations

import errno
import os
import threading
import time

import numpy as np
import pytest
import torch

import plestore
from conftest import HAS_CUDA, assert_bit_identical, devices, requires_cuda
from plestore.formats import get_format
from plestore.spec import RowLayout, TableSpec
from plestore.tablefile import TableWriter

TIERS = ["device", "pinned", "mapped", "direct"]
FORMATS = {
    "bf16": 64,
    "fp8_e4m3": 160,
    "nvfp4": 160,
    "fp8_ue8m0": 256,
    "nf4": 160,
    "fp16": 64,
    "fp32": 32,
}
ROWS = 3000


def _make_table(path, fmt_name, dim, rows=ROWS, block=4096, seed=0):
    """A real table file of encoded N(0,1) rows; returns (dir, reference decode of every row)."""
    fmt = get_format(fmt_name)
    x = np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32)
    enc = fmt.encode(x)
    spec = TableSpec(name="t", rows=rows, dim=dim, format=fmt_name, scale=enc.scale, heads=4)
    with TableWriter(path, spec, RowLayout(spec.row_bytes, block_bytes=block)) as w:
        w.write_rows(enc.rows[: rows // 3])
        w.write_rows(enc.rows[rows // 3 :])
        w.commit()
    return path, fmt.decode(enc.rows, scale=enc.scale)  # [rows, dim] float32 of bf16 values


@pytest.fixture(scope="module", params=list(FORMATS))
def table(request, tmp_path_factory):
    name = request.param
    return _make_table(tmp_path_factory.mktemp(name), name, FORMATS[name])


@pytest.fixture(scope="module")
def fp8_table(tmp_path_factory):
    return _make_table(tmp_path_factory.mktemp("fp8"), "fp8_e4m3", 160, block=512)


def _want(ref, ids, absent=None):
    flat = np.asarray(ids).reshape(-1)
    out = ref[flat].copy()
    if absent is not None:
        out[absent.reshape(-1)] = 0
    return out.reshape(*np.asarray(ids).shape[:-1], -1)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("tier", TIERS)
def test_bit_identical_to_resident_decode(table, tier, device):
    path, ref = table
    rng = np.random.default_rng(1)
    with plestore.open_table(path, tier=tier, device=device, cache_bytes=1 << 20) as t:
        for shape in [(7, 4), (1, 4), (64, 4), (2, 3, 4)]:
            ids = rng.integers(0, ROWS, shape)
            got = t.lookup(ids)
            assert got.shape == (*shape[:-1], shape[-1] * t.dim) and got.dtype == t.dtype
            assert got.device.type == device
            assert_bit_identical(got, _want(ref, ids))
        # the same ids again (warm: caches, page cache) and as a torch tensor on the device
        ids_t = torch.as_tensor(ids).to(device)
        assert_bit_identical(t.lookup(ids_t), _want(ref, ids))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("tier", TIERS)
def test_awkward_inputs(fp8_table, tier, device):
    path, ref = fp8_table
    with plestore.open_table(path, tier=tier, device=device) as t:
        edge = np.array([[0, ROWS - 1, 0, ROWS - 1]])
        assert_bit_identical(t.lookup(edge), _want(ref, edge))
        dup = np.full((16384, 4), 1234)  # one id repeated 65,536 times
        assert_bit_identical(t.lookup(dup), _want(ref, dup))
        mixed = np.random.default_rng(2).integers(0, 20, (500, 4))  # heavy duplication
        assert_bit_identical(t.lookup(mixed), _want(ref, mixed))
        empty = t.lookup(np.zeros((0, 4), np.int64))
        assert empty.shape == (0, 4 * t.dim)
        assert t.lookup(np.array([5], np.int32)).shape == (t.dim,)
        for bad in ([[0, ROWS]], [[-1, 0]]):
            with pytest.raises(IndexError, match="outside table t"):
                t.lookup(np.array(bad))
        with pytest.raises(ValueError, match="must be integers"):
            t.lookup(np.array([[1.0, 2.0]]))
        with pytest.raises(ValueError, match="at least one dimension"):
            t.lookup(np.int64(3))
        assert_bit_identical(t.lookup(edge), _want(ref, edge))  # still fine after errors


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("tier", TIERS)
def test_other_ranks_ids_are_zeros_and_never_read(fp8_table, tier, device):
    path, ref = fp8_table
    start, end = 1000, 2000
    with plestore.open_table(path, tier=tier, device=device, row_start=start, row_end=end) as t:
        seen = []
        if t.tier.can_read_host:
            orig = t.tier.read
            t.tier.read = lambda rows, out: (seen.append(rows.copy()), orig(rows, out))[1]
        ids = np.random.default_rng(3).integers(0, ROWS, (300, 4))
        absent = (ids < start) | (ids >= end)
        got = t.lookup(ids, label="prefill")
        assert_bit_identical(got, _want(ref, ids, absent))
        for rows in seen:
            assert rows.min() >= start and rows.max() < end
        if tier == "direct":  # every block read holds an in-range row
            assert t.tier.blocks_read <= int((~absent).sum())
        if t.tier.can_read_host and t._path(ids.reshape(-1)) == "host":
            assert t.stats()["phases"]["prefill"]["absent"] == int(absent.sum())
        none = np.random.default_rng(4).integers(end, ROWS, (5, 4))  # not one of this rank's
        assert not t.lookup(none).any()


def test_row_range_for_rank_matches_the_engines():
    from plestore.tiers import RowRange

    assert RowRange.for_rank(16896, 1, 4) == RowRange(4224, 8448)
    assert RowRange.for_rank(10, 3, 4) == RowRange(9, 10)
    with pytest.raises(ValueError):
        RowRange.for_rank(10, 4, 4)


@pytest.mark.parametrize("tier", TIERS)
def test_concurrent_lookups_from_threads(fp8_table, tier):
    path, ref = fp8_table
    errors = []
    with plestore.open_table(path, tier=tier, device="cpu", cache_bytes=64 << 10) as t:

        def worker(seed):
            rng = np.random.default_rng(seed)
            try:
                for _ in range(10):
                    ids = rng.integers(0, ROWS, (rng.integers(1, 200), 4))
                    got = t.prefetch(ids, label=f"w{seed}").result(timeout=60)
                    if not np.array_equal(got.float().numpy(), _want(ref, ids)):
                        errors.append(f"thread {seed}: wrong rows")
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(f"thread {seed}: {e!r}")

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert not errors, errors


@pytest.mark.parametrize("tier", ["mapped", "direct"])
def test_truncated_or_replaced_file_raises_and_table_recovers(tmp_path, tier):
    path, ref = _make_table(tmp_path, "fp8_e4m3", 160, block=4096)
    data = next(tmp_path.glob("*.rows"))
    saved = data.read_bytes()
    ids = np.array([[0, 1, ROWS - 1, ROWS - 2]])
    with plestore.open_table(path, tier=tier, device="cpu", cache_bytes=0) as t:
        assert_bit_identical(t.lookup(ids), _want(ref, ids))
        os.truncate(data, len(saved) // 2)
        with pytest.raises(OSError, match="truncated|short read"):
            t.lookup(ids)
        data.write_bytes(saved)  # restored in place (same inode)
        assert_bit_identical(t.lookup(ids), _want(ref, ids))
        if tier == "mapped":
            tmp = data.with_suffix(".new")
            tmp.write_bytes(saved)
            os.replace(tmp, data)  # a different file now
            with pytest.raises(OSError, match="replaced"):
                t.lookup(ids)


@pytest.mark.parametrize("tier", ["pinned", "mapped", "direct"])
def test_injected_eio_raises_and_next_lookup_works(fp8_table, tier):
    path, ref = fp8_table
    with plestore.open_table(path, tier=tier, device="cpu", cache_bytes=0) as t:
        orig = t.tier.read
        calls = {"n": 0}

        def failing(rows, out):
            calls["n"] += 1
            if calls["n"] == 1:
                raise OSError(errno.EIO, "injected I/O error")
            return orig(rows, out)

        t.tier.read = failing
        ids = np.arange(40).reshape(10, 4)
        with pytest.raises(OSError, match="injected"):
            t.lookup(ids)
        assert_bit_identical(t.lookup(ids), _want(ref, ids))


def test_timeout_raises_and_later_lookups_complete(fp8_table):
    path, ref = fp8_table
    # inline_ids=0: every lookup goes through the worker, the path whose wait can time out
    with plestore.open_table(path, tier="mapped", device="cpu", inline_ids=0) as t:
        orig = t.tier.read
        t.tier.read = lambda rows, out: (time.sleep(0.5), orig(rows, out))[1]
        ids = np.arange(8).reshape(2, 4)
        pending = t.prefetch(ids)
        assert not pending.done()  # prefetch returned while the tier is still working
        with pytest.raises(TimeoutError, match="did not finish within 0.05 s"):
            pending.result(timeout=0.05)
        assert_bit_identical(pending.result(timeout=30), _want(ref, ids))
        t.tier.read = orig
        assert_bit_identical(t.lookup(ids, timeout=30), _want(ref, ids))


@pytest.mark.parametrize("inline_ids", [0, 1 << 20])
def test_worker_and_inline_paths_agree_and_report_errors_at_result(fp8_table, inline_ids):
    """Small lookups run in the caller's thread, large ones on the worker: same rows, and an
    I/O error surfaces from result() on both."""
    path, ref = fp8_table
    with plestore.open_table(path, tier="mapped", device="cpu", inline_ids=inline_ids) as t:
        ids = np.random.default_rng(9).integers(0, ROWS, (64, 16))
        assert_bit_identical(t.lookup(ids), _want(ref, ids))
        orig = t.tier.read

        def failing(rows, out):
            raise OSError(errno.EIO, "injected")

        t.tier.read = failing
        pending = t.prefetch(ids)
        if inline_ids:
            assert not pending.done()  # deferred: runs in the caller's thread at result()
        with pytest.raises(OSError, match="injected"):
            pending.result(timeout=30)
        t.tier.read = orig
        assert_bit_identical(t.lookup(ids), _want(ref, ids))


@pytest.mark.parametrize("tier", ["pinned", "mapped", "direct"])
def test_deferred_lookups_run_in_the_callers_thread_at_any_size(fp8_table, tier):
    """prefetch(defer=True) leaves even a worker-sized lookup to the caller: nothing happens
    on the worker, run_now() does the host work (errors kept for result()), result() returns
    the rows."""
    path, ref = fp8_table
    with plestore.open_table(path, tier=tier, device="cpu", inline_ids=16) as t:
        ids = np.random.default_rng(3).integers(0, ROWS, (512, 4))
        seen = []
        orig = t.tier.read
        t.tier.read = lambda rows, out: (seen.append(threading.current_thread()), orig(rows, out))[
            1
        ]
        pending = t.prefetch(ids, defer=True)
        assert not pending.done() and not seen
        pending.run_now()
        assert pending.done() and set(seen) == {threading.current_thread()}
        assert_bit_identical(pending.result(), _want(ref, ids))

        def failing(rows, out):
            raise OSError(errno.EIO, "injected")

        t.tier.read = failing
        pending = t.prefetch(ids, defer=True)
        pending.run_now()  # the error waits for result()
        with pytest.raises(OSError, match="injected"):
            pending.result()


@pytest.mark.parametrize("tier", ["mapped", "direct"])
def test_lookups_waited_on_at_once_hint_only_tiers_that_gain(fp8_table, tier):
    """A decode-sized lookup() reads right after it starts: direct's read-ahead would only probe
    its cache twice, while mapped's WILLNEED (when cold) still puts the pages' reads in flight
    together. prefetch() hints both."""
    path, ref = fp8_table
    with plestore.open_table(path, tier=tier, device="cpu") as t:
        hinted = []
        orig = t.tier.prefetch
        t.tier.prefetch = lambda rows: (hinted.append(len(rows)), orig(rows))[1]
        ids = np.arange(32).reshape(2, 16)
        assert_bit_identical(t.lookup(ids), _want(ref, ids))
        assert hinted == ([32] if tier == "mapped" else [])
        assert_bit_identical(t.prefetch(ids).result(), _want(ref, ids))
        assert hinted[-1] == 32


def test_direct_inserts_rows_into_its_cache_off_the_read(fp8_table, monkeypatch):
    """Rows read from the disk enter the cache on the tier's own thread after read() returned
    them; the next read waits for that, so it hits them, and an insert's error reaches it."""
    import threading

    path, ref = fp8_table
    with plestore.open_table(path, tier="direct", device="cpu") as t:
        put, threads = t.tier.cache.put, []
        monkeypatch.setattr(
            t.tier.cache, "put", lambda *a: threads.append(threading.current_thread()) or put(*a)
        )
        ids = np.random.default_rng(11).integers(0, ROWS, (8, 4))
        assert_bit_identical(t.lookup(ids, label="a"), _want(ref, ids))
        assert threads and all(th.name.startswith("plestore-direct-cache") for th in threads)
        assert_bit_identical(t.lookup(ids, label="b"), _want(ref, ids))
        ph = t.stats()["phases"]
        assert ph["a"]["cache_hits"] == 0 and ph["b"]["blocks_read"] == 0
        monkeypatch.setattr(t.tier.cache, "put", lambda *a: 1 / 0)
        t.lookup((ids + 1) % ROWS)  # new rows: their insert fails, after the read
        with pytest.raises(ZeroDivisionError):
            t.lookup(ids)


def test_direct_counts_its_own_disk_bytes(fp8_table):
    """O_DIRECT reads are all the direct tier takes from the disk: a lookup's disk bytes are
    its block reads (no /proc/self/io read per lookup), inline and on the worker alike."""
    path, ref = fp8_table
    with plestore.open_table(path, tier="direct", device="cpu", cache_bytes=0) as t:
        for n in (4, 2000):  # inline, worker
            ids = np.random.default_rng(n).integers(0, ROWS, (n, 4))
            assert_bit_identical(t.lookup(ids, label=f"n{n}"), _want(ref, ids))
            ph = t.stats()["phases"][f"n{n}"]
            assert ph["disk_read_bytes"] == ph["bytes_read"] == ph["blocks_read"] * t.tier.unit > 0


def test_direct_engines_agree_and_count_blocks(tmp_path):
    path, ref = _make_table(tmp_path, "nvfp4", 160, block=512)
    ids = np.random.default_rng(4).integers(0, ROWS, (256, 4))
    for engine in ("io_uring", "threads"):
        try:
            t = plestore.open_table(
                path, tier="direct", device="cpu", io_engine=engine, cache_bytes=0
            )
        except OSError as e:
            pytest.skip(f"{engine} unavailable here: {e}")
        with t:
            assert t.tier.engine == engine
            assert_bit_identical(t.lookup(ids, label="decode"), _want(ref, ids))
            ph = t.stats()["phases"]["decode"]
            units = np.unique(t.file.row_offsets(np.unique(ids)) // t.tier.unit)
            assert ph["blocks_read"] == len(units)  # exactly the blocks holding the rows
            assert ph["bytes_read"] == len(units) * t.tier.unit


def test_direct_cache_serves_repeats_without_io(fp8_table):
    path, ref = fp8_table
    ids = np.arange(400).reshape(100, 4)
    with plestore.open_table(path, tier="direct", device="cpu", cache_bytes=1 << 20) as t:
        t.lookup(ids, label="cold")
        assert_bit_identical(t.lookup(ids, label="warm"), _want(ref, ids))
        warm = t.stats()["phases"]["warm"]
        assert warm["cache_hits"] == 400 and warm["blocks_read"] == 0
        assert t.tier.host_bytes() <= t.tier.host_budget()


def test_mapped_resident_set_is_held_to_budget(tmp_path):
    path, _ = _make_table(tmp_path, "bf16", 1024, rows=4000)  # 8 MiB of rows
    with plestore.open_table(path, tier="mapped", device="cpu", rss_budget_bytes=1 << 20) as t:
        t.lookup(np.arange(4000).reshape(-1, 4))  # touch every page
        assert t.tier.trim() <= 1 << 20
        assert t.tier.trims >= 1
        assert t.stats()["host_budget"] == 1 << 20


@pytest.mark.parametrize("tier", ["mapped", "direct"])
def test_drop_caches_sends_the_next_lookup_to_storage(fp8_table, tier):
    path, ref = fp8_table
    ids = np.arange(0, ROWS, 7)[:256].reshape(64, 4)
    with plestore.open_table(path, tier=tier, device="cpu") as t:
        t.lookup(ids)
        t.drop_caches()
        if tier == "mapped":
            from plestore.tiers.mapped import mapping_rss

            assert mapping_rss(t.tier.path) == 0
        else:
            assert_bit_identical(t.lookup(ids, label="again"), _want(ref, ids))
            again = t.stats()["phases"]["again"]
            assert again["cache_hits"] == 0 and again["blocks_read"] > 0


@pytest.mark.parametrize("n", [64, 2500])  # read in the caller's thread, and by the pool
def test_mapped_counts_the_page_faults_of_its_reads(tmp_path, n):
    path, ref = _make_table(tmp_path, "bf16", 1024, rows=4000)  # 2 KiB rows: 2 per page
    ids = np.arange(0, 4000, 4000 // n)[:n].reshape(-1, 1)  # >= n / 2 distinct pages
    with plestore.open_table(path, tier="mapped", device="cpu") as t:
        t.drop_caches()
        assert_bit_identical(t.lookup(ids, label="cold"), _want(ref, ids))
        cold = t.stats()["phases"]["cold"]
        assert cold["major_faults"] + cold["minor_faults"] >= n // 2


@pytest.mark.parametrize(
    "fmt, dim, block",
    [
        ("nvfp4", 160, 0),  # 90-B rows back to back: rows straddle every read unit's boundary
        ("bf16", 448, 512),  # 896-B rows over two 512-B blocks (not a divisor of 4 KiB)
        ("fp8_e4m3", 160, 512),  # rows within 512-B blocks
    ],
)
@pytest.mark.parametrize(  # O_DIRECT alignment as probed (512 here), or a 4 KiB device's
    "tier, align", [(t, None) for t in TIERS] + [("direct", 4096)]
)
def test_exact_rows_of_every_layout(tmp_path, monkeypatch, fmt, dim, block, tier, align):
    """Every tier returns exact rows whether rows share blocks, span them or run back to back;
    the direct tier reads, for each row, an aligned unit that holds all of it (the last rows'
    units may end past the end of the file), through read() and through reads started at
    prefetch."""
    import plestore.tiers.direct as direct

    if align:
        monkeypatch.setattr(direct, "o_direct_alignment", lambda *a: align)
    path, ref = _make_table(tmp_path, fmt, dim, rows=5000, block=block)
    every = np.arange(5000).reshape(-1, 4)
    with plestore.open_table(path, tier=tier, device="cpu", cache_bytes=1 << 20) as t:
        assert tier != "direct" or t.tier.unit % (align or 512) == 0
        assert_bit_identical(t.lookup(every), _want(ref, every))  # cold: all from the disk
        t.drop_caches()
        few = np.array([[4999, 0, 4998, 4997], [500, 1, 4999, 3]])  # the file's ends, repeats
        assert_bit_identical(t.prefetch(few).result(), _want(ref, few))
        t.drop_caches()  # scattered rows: the units read are not each other's neighbours
        scattered = np.random.default_rng(5).integers(0, 4900, (16, 4))
        assert_bit_identical(t.lookup(scattered), _want(ref, scattered))
        assert_bit_identical(t.lookup(every[::-1]), _want(ref, every[::-1]))  # warm


def test_direct_reads_start_at_prefetch_and_abandoned_ones_cost_nothing(fp8_table):
    """Decode-sized lookups submit their reads at prefetch(); result() collects them. A
    prefetch overtaken by another (or never consumed) is dropped, and its lookup still gets
    exact rows; each row's block is counted once."""
    from plestore.io.uring import uring_available

    if not uring_available():
        pytest.skip("io_uring is unavailable here: direct reads cannot start before result()")
    path, ref = fp8_table
    a, b = np.arange(0, 400, 5).reshape(20, 4), np.arange(1000, 1400, 5).reshape(20, 4)
    with plestore.open_table(path, tier="direct", device="cpu") as t:
        first = t.prefetch(a, label="a")
        assert t.tier._inflight is not None  # submitted, not yet waited for
        second = t.prefetch(b, label="b")  # drops a's reads in flight
        assert_bit_identical(second.result(), _want(ref, b))
        assert_bit_identical(first.result(), _want(ref, a))
        phases = t.stats()["phases"]
        assert phases["a"]["blocks_read"] > 0 and phases["b"]["blocks_read"] > 0
        assert phases["a"]["cache_hits"] == phases["b"]["cache_hits"] == 0
        assert_bit_identical(t.lookup(a, label="again"), _want(ref, a))
        assert t.stats()["phases"]["again"]["blocks_read"] == 0  # cached by a's lookup


def test_mapped_cold_mode_prefetches_pages_and_faults_in_parallel(fp8_table):
    """After a read that took major faults, the mapped tier advises WILLNEED at prefetch and
    gathers >= 64 rows on its pool; rows stay exact, and a warm read switches it back."""
    path, ref = fp8_table
    ids = np.random.default_rng(9).integers(0, ROWS, (40, 4))  # 160 ids
    with plestore.open_table(path, tier="mapped", device="cpu") as t:
        t.drop_caches()
        t.tier._recent_major = 1  # as after a cold read (eviction is not certain in CI)
        assert_bit_identical(t.lookup(ids), _want(ref, ids))
        assert_bit_identical(t.lookup(ids), _want(ref, ids))  # warm now: inline again
        assert t.tier._recent_major == 0


def test_mapped_leaves_its_cold_mode_when_the_rows_are_resident(fp8_table, monkeypatch):
    """After a cold phase (major faults) a lookup whose rows' pages are resident takes the
    warm path at once: no WILLNEED, no pool tasks."""
    path, ref = fp8_table
    ids = np.random.default_rng(10).integers(0, ROWS, (40, 4))  # 160 ids
    with plestore.open_table(path, tier="mapped", device="cpu") as t:
        assert_bit_identical(t.lookup(ids), _want(ref, ids))  # its pages are resident now
        t.tier._recent_major = 1  # as after cold reads of other rows
        pooled, advised = [], []
        submit = t.tier._pool.submit
        monkeypatch.setattr(t.tier._pool, "submit", lambda *a: pooled.append(1) or submit(*a))
        monkeypatch.setattr(t.tier, "_willneed", lambda offs: advised.append(len(offs)))
        assert_bit_identical(t.prefetch(ids).result(), _want(ref, ids))
        assert not pooled and not advised and t.tier._recent_major == 0


def test_lookup_of_a_memory_tier_runs_in_the_callers_thread_at_any_size(fp8_table, monkeypatch):
    """lookup() waits at once, so a memory tier's host path skips the worker handoff even for
    large lookups; prefetch() of the same size still hands its host work to the worker (and a
    storage tier's large lookups keep the worker, where their wait can time out)."""
    path, ref = fp8_table
    ids = np.random.default_rng(8).integers(0, ROWS, (2000, 4))  # 8,000 > inline_ids
    with plestore.open_table(path, tier="pinned", device="cpu", inline_ids=4096) as t:
        handed = []
        submit = t._worker.submit
        monkeypatch.setattr(t._worker, "submit", lambda *a: handed.append(1) or submit(*a))
        assert_bit_identical(t.lookup(ids), _want(ref, ids))
        assert not handed
        assert_bit_identical(t.prefetch(ids).result(), _want(ref, ids))
        assert handed


def test_mapping_rss_sums_every_mapping_of_the_file(tmp_path):
    """mapping_rss searches smaps as bytes; it must agree with a line-by-line reading, over two
    mappings of one file (and not count a file whose name extends this one's)."""
    import mmap

    from plestore.tiers.mapped import mapping_rss

    f, longer = tmp_path / "rows", tmp_path / "rows.bak"
    for p, n in ((f, 5 << 20), (longer, 1 << 20)):
        p.write_bytes(os.urandom(n))
    fds = [os.open(p, os.O_RDONLY) for p in (f, f, longer)]
    maps = [mmap.mmap(fd, 0, prot=mmap.PROT_READ) for fd in fds]
    try:
        for m, n in zip(maps, (3 << 20, 1 << 20, 1 << 20), strict=True):
            sum(m[i] for i in range(0, n, mmap.PAGESIZE))  # touch n bytes of pages
        want, inside = 0, False
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                if not line[0].isupper():
                    inside = line.rstrip("\n").endswith(" " + str(f))
                elif inside and line.startswith("Rss:"):
                    want += int(line.split()[1]) * 1024
        assert mapping_rss(str(f)) == want >= 4 << 20
    finally:
        for m, fd in zip(maps, fds, strict=True):
            m.close()
            os.close(fd)


class _DoneEvent:
    """A finished CUDA event: any two are 2 ms apart."""

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return 2.0


def test_metrics_read_finished_gpu_timings_without_being_asked():
    """CUDA events of every call used to pile up until stats(); now finished ones are read once
    enough are waiting, so a server that never asks holds a bounded list."""
    from plestore.lookup.metrics import _RESOLVE_AT, CallRecord, Metrics

    m = Metrics("t", "pinned")
    for _ in range(3 * _RESOLVE_AT):
        m.record(
            CallRecord(
                label="decode",
                path="host",
                rows=1,
                events=[("decode_s", _DoneEvent(), _DoneEvent())],
            )
        )
    assert len(m._pending) < _RESOLVE_AT
    assert m.snapshot()["phases"]["decode"]["decode_s"] == pytest.approx(3 * _RESOLVE_AT * 2e-3)


def test_gpu_times_are_sampled_and_scaled_to_every_call():
    """One host-path call in GPU_TIMING_EVERY records timing events (the first of a phase
    always); the phase's GPU time is scaled from the timed calls to all of them."""
    from plestore.lookup.metrics import GPU_TIMING_EVERY, CallRecord, Metrics

    m = Metrics("t", "mapped")
    calls = 3 * GPU_TIMING_EVERY + 1
    timed = []
    for _ in range(calls):
        timed.append(m.time_gpu("decode"))
        events = [("decode_s", _DoneEvent(), _DoneEvent())] if timed[-1] else []
        m.record(CallRecord(label="decode", path="host", rows=1, events=events))
    assert timed[0] and sum(timed) == 4 and m.time_gpu("prefill")  # each phase's first
    ph = m.snapshot()["phases"]["decode"]
    assert ph["calls"] == calls and ph["decode_s"] == pytest.approx(calls * 2e-3)


def test_metrics_json_and_prometheus(fp8_table):
    path, _ = fp8_table
    with plestore.open_table(path, tier="direct", device="cpu") as t:
        t.lookup(np.arange(64).reshape(16, 4), label="prefill")
        t.lookup(np.arange(4).reshape(1, 4), label="decode")
        snap = t.stats()
        assert set(snap["phases"]) == {"prefill", "decode"}
        assert snap["phases"]["prefill"]["rows"] == 64 and snap["phases"]["decode"]["calls"] == 1
        assert snap["tier"] == "direct" and snap["tier_detail"]["io_engine"] in (
            "io_uring",
            "threads",
        )
        text = t.metrics.prometheus()
        assert 'plestore_rows_total{table="t",tier="direct",phase="prefill"} 64' in text
        assert "plestore_host_bytes" in text


def test_auto_picks_a_tier_and_says_why(fp8_table):
    path, _ = fp8_table
    with plestore.open_table(path, device="cpu") as t:
        assert t.tier.name == "pinned" and "fits" in t.tier_choice.reason


def test_options_from_environment_and_errors(fp8_table, monkeypatch):
    path, _ = fp8_table
    monkeypatch.setenv("PLESTORE_TIER", "direct")
    monkeypatch.setenv("PLESTORE_CACHE_BYTES", "2M")
    with plestore.open_table(path, device="cpu") as t:
        assert t.tier.name == "direct" and t.options.cache_bytes == 2 << 20
    with plestore.open_table(path, tier="mapped", device="cpu") as t:  # explicit wins
        assert t.tier.name == "mapped"
    monkeypatch.setenv("PLESTORE_THREADS", "many")
    with pytest.raises(ValueError, match="PLESTORE_THREADS='many'"):
        plestore.open_table(path, device="cpu")
    monkeypatch.delenv("PLESTORE_THREADS")
    with pytest.raises(ValueError, match="tier must be one of"):
        plestore.open_table(path, tier="floppy", device="cpu")
    with pytest.raises(TypeError, match="unknown table options: colour"):
        plestore.open_table(path, colour="red")
    with pytest.raises(ValueError, match="row range ends at 99999"):
        plestore.open_table(path, device="cpu", row_start=0, row_end=99999)
    if not HAS_CUDA:
        with pytest.raises(ValueError, match="CUDA is not available"):
            plestore.open_table(path, device="cuda")


def test_closed_table_refuses_lookups(fp8_table):
    path, _ = fp8_table
    t = plestore.open_table(path, tier="pinned", device="cpu")
    t.close()
    t.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        t.lookup(np.zeros((1, 4), np.int64))


def test_lookup_into_caller_buffer(fp8_table):
    path, ref = fp8_table
    ids = np.arange(32).reshape(8, 4)
    with plestore.open_table(path, tier="pinned", device="cpu") as t:
        out = torch.empty(8, 4 * t.dim, dtype=torch.bfloat16)
        got = t.lookup_into(ids, out)
        assert got.data_ptr() == out.data_ptr()
        assert_bit_identical(out, _want(ref, ids))
        with pytest.raises(ValueError, match="contiguous tensor of shape"):
            t.lookup_into(ids, torch.empty(8, 5, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="must be bf16"):
            t.lookup_into(ids, torch.empty(8, 4 * t.dim))


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["device", "pinned"])
def test_device_path_survives_allocator_churn(fp8_table, tier):
    """The device path reads ids and writes out on the table's stream while the caller's stream
    allocates: both tensors must be recorded on the table's stream (regression: run-to-run drift
    of a batch-64 decoder on the H200, 2026-11-29)."""
    path, ref = fp8_table
    rng = np.random.default_rng(5)
    with plestore.open_table(path, tier=tier, device="cuda", gather="gpu") as t:
        for _ in range(40):
            ids = rng.integers(0, ROWS, (4096, 4))
            pending = t.prefetch(torch.from_numpy(ids).cuda())
            junk = torch.full((1 << 20,), -1, dtype=torch.int64, device="cuda")  # reuse bait
            got = pending.result()
            del junk
            assert_bit_identical(got, _want(ref, ids))


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["mapped", "direct", "pinned"])
@pytest.mark.parametrize("n", [4, 1000, 5000])  # inline: UVA read / copy; worker
def test_result_on_another_stream_than_prefetch(fp8_table, tier, n):
    """Rows are ordered on the stream that asks for them, even when prefetch ran on another
    (with GPU work queued on both, so a missing wait would show)."""
    path, ref = fp8_table
    ids = np.random.default_rng(7).integers(0, ROWS, (n, 4))
    opts = {"gather": "cpu"} if tier == "pinned" else {}
    with plestore.open_table(path, tier=tier, device="cuda", **opts) as t:
        a = torch.randn(2048, 2048, device="cuda")
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(s1):
            pending = t.prefetch(ids)
            for _ in range(20):
                a = a @ a / 2048
        with torch.cuda.stream(s2):
            got = pending.result()  # [n, 4 * dim] bf16
        torch.cuda.synchronize()
        assert_bit_identical(got, _want(ref, ids))


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["pinned", "mapped", "direct"])
def test_a_lookup_run_ahead_goes_beside_the_step_queued_before_it(fp8_table, tier):
    """prefetch(defer=True) + run_now() after the caller queued a step: the rows are written on
    the table's stream while that step still runs (not after it, on the caller's stream), into
    memory the caller's later allocations do not take (pinned, gather=auto: the host gathers
    them, as it does every lookup run ahead). Every row is cached first: a cold read of 20,000
    blocks outlasts the step."""
    path, ref = fp8_table
    rng = np.random.default_rng(8)
    with plestore.open_table(path, tier=tier, device="cuda") as t:
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        warm = t.prefetch(np.arange(20000).reshape(5000, 4) % ROWS, defer=True)
        warm.run_now()  # (the first also makes the device iota and the staging: a sync)
        warm.result()
        for _ in range(4):
            ids = rng.integers(0, ROWS, (5000, 4))
            for _ in range(300):  # the step (~60 ms on an H200: longer than any read here)
                a @ a
            step_done = torch.cuda.Event()
            step_done.record()
            pending = t.prefetch(ids, defer=True)
            pending.run_now()
            pending._ready.synchronize()  # the rows are written ...
            beside = not step_done.query()  # ... while the step still runs
            junk = torch.full((1 << 20,), -1, dtype=torch.int64, device="cuda")  # reuse bait
            got = pending.result()
            del junk
            assert_bit_identical(got, _want(ref, ids))
            assert beside and t.stats()["last_call"]["path"] == "host"


@requires_cuda
@pytest.mark.gpu
def test_prefetch_overlaps_gpu_work_issued_meanwhile(tmp_path):
    """A prefetch's host work (here the pinned tier's host path on the worker thread) runs while
    the GPU executes work the caller queued after it: prefetch, queue matmuls, result() takes
    about the longer of the two, not their sum. Generous bound (0.8 of the sum; perfect overlap
    of equal halves is 0.5): it checks that overlap happens, not how fast anything is."""
    path, _ = _make_table(tmp_path, "fp8_e4m3", 160, rows=200_000)
    ids = np.random.default_rng(6).integers(0, 200_000, (4096, 16))
    opts = dict(tier="pinned", device="cuda", gather="cpu", inline_ids=0)
    with plestore.open_table(path, **opts) as t:
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

        def timed(fn) -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        def gpu_work(reps: int) -> None:
            for _ in range(reps):
                a @ a

        def alone() -> None:  # the same path as below (lookup() would run it inline)
            t.prefetch(ids).result()

        for _ in range(3):  # warm: kernels, staging, pools
            timed(alone)
            timed(lambda: gpu_work(4))
        lookup_s = min(timed(alone) for _ in range(5))
        one_s = min(timed(lambda: gpu_work(1)) for _ in range(5))
        reps = max(1, round(lookup_s / one_s))  # about as much GPU time as the lookup takes
        gpu_s = min(timed(lambda: gpu_work(reps)) for _ in range(3))

        def both() -> None:
            pending = t.prefetch(ids)  # host work starts on the worker thread
            gpu_work(reps)  # queued after it, on the caller's stream
            pending.result()

        both_s = min(timed(both) for _ in range(5))
        assert both_s < 0.8 * (lookup_s + gpu_s), (both_s, lookup_s, gpu_s, reps)


def test_disk_read_bytes_follows_the_process(tmp_path):
    """The kept-open /proc/self/io descriptor reads this process's counter — also in a forked
    child, which must not read its parent's."""
    from plestore.io.memory import disk_read_bytes, evict, process_io

    f = tmp_path / "f"
    f.write_bytes(os.urandom(1 << 20))
    os.sync()
    evict(f)
    before = disk_read_bytes()
    f.read_bytes()  # from the disk: the parent's counter moves (the child's starts at 0)
    assert disk_read_bytes() == process_io().get("read_bytes", 0) >= before
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report whether it reads its own counter
        ok = disk_read_bytes() == process_io().get("read_bytes", 0)
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.close(r)
    os.waitpid(pid, 0)


@pytest.mark.parametrize("willneed", [False, True])
def test_mapped_large_reads_with_and_without_willneed(fp8_table, willneed):
    """Reads big enough to go to the fault threads (and, with willneed, the page hints)."""
    path, ref = fp8_table
    opts = dict(tier="mapped", device="cpu", willneed=willneed, threads=2)  # ~1,450 rows a part
    with plestore.open_table(path, **opts) as t:
        ids = np.random.default_rng(3).integers(0, ROWS, (512, 16))
        assert_bit_identical(t.lookup(ids), _want(ref, ids))
        assert t.stats()["tier_detail"]["willneed"] is willneed
