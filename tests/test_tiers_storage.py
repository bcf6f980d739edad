"""The storage tiers' own I/O: the direct tier's row cache, block reads and reads started at
prefetch; the mapped tier's resident-set budget, cold mode and page faults; disk byte counts."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import plestore
from conftest import assert_bit_identical, requires_native
from tier_tables import ROWS, make_table, resident_rows


@pytest.fixture(scope="module")
def fp8_table(tmp_path_factory):
    return make_table(tmp_path_factory.mktemp("fp8"), "fp8_e4m3", 160, block=512)


@pytest.mark.parametrize("core", ["auto", "off"])  # the compiled host core, its reference
def test_direct_admits_rows_read_from_the_disk_within_the_read(fp8_table, core):
    """Rows read from the disk enter the cache inside the read that read them (one call of the
    host core), so the next read hits them."""
    path, ref = fp8_table
    with plestore.open_table(path, tier="direct", device="cpu", native=core) as t:
        ids = np.random.default_rng(11).integers(0, ROWS, (8, 4))
        assert_bit_identical(t.lookup(ids, label="a"), resident_rows(ref, ids))
        assert (t.tier.cache.tags >= 0).sum() == np.unique(ids).size
        assert_bit_identical(t.lookup(ids, label="b"), resident_rows(ref, ids))
        ph = t.stats()["phases"]
        assert ph["a"]["cache_hits"] == 0 and ph["b"]["blocks_read"] == 0
        assert ph["b"]["cache_hits"] == ids.size


def test_direct_counts_its_own_disk_bytes(fp8_table):
    """O_DIRECT reads are all the direct tier takes from the disk: a lookup's disk bytes are
    its block reads (no /proc/self/io read per lookup), inline and on the worker alike."""
    path, ref = fp8_table
    with plestore.open_table(path, tier="direct", device="cpu", cache_bytes=0) as t:
        for n in (4, 2000):  # inline, worker
            ids = np.random.default_rng(n).integers(0, ROWS, (n, 4))
            assert_bit_identical(t.lookup(ids, label=f"n{n}"), resident_rows(ref, ids))
            ph = t.stats()["phases"][f"n{n}"]
            assert ph["disk_read_bytes"] == ph["bytes_read"] == ph["blocks_read"] * t.tier.unit > 0


@requires_native
def test_mapped_counts_its_readers_disk_bytes_as_the_process_does(fp8_table):
    """On the native core the mapped tier's reading threads count their own disk bytes (no
    /proc/self/io read per lookup): cold, inline (WILLNEED at prefetch) and on the worker (the
    pool's faults), each lookup's count is exactly the process's read_bytes over it."""
    from plestore.io.memory import disk_read_bytes

    path, ref = fp8_table
    with plestore.open_table(path, tier="mapped", device="cpu", native="on") as t:
        assert t.tier.exact_disk_bytes
        t.lookup(np.zeros((1, 4), np.int64))  # (the trimmer is idle until the next read)
        for n in (4, 2000):  # inline, worker
            t.drop_caches()
            ids = np.random.default_rng(n).integers(0, ROWS, (n, 4))
            before = disk_read_bytes()
            assert_bit_identical(t.lookup(ids, label=f"n{n}"), resident_rows(ref, ids))
            process = disk_read_bytes() - before
            ph = t.stats()["phases"][f"n{n}"]
            assert ph["disk_read_bytes"] == ph["bytes_read"] == process
            assert process > 0 or ph["major_faults"] == 0  # (a file system without a disk)
            t.metrics.reset()


def test_direct_engines_agree_and_count_blocks(tmp_path):
    path, ref = make_table(tmp_path, "nvfp4", 160, block=512)
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
            assert_bit_identical(t.lookup(ids, label="decode"), resident_rows(ref, ids))
            ph = t.stats()["phases"]["decode"]
            units = np.unique(t.file.row_offsets(np.unique(ids)) // t.tier.unit)
            assert ph["blocks_read"] == len(units)  # exactly the blocks holding the rows
            assert ph["bytes_read"] == len(units) * t.tier.unit


def test_direct_cache_serves_repeats_without_io(fp8_table):
    path, ref = fp8_table
    ids = np.arange(400).reshape(100, 4)
    with plestore.open_table(path, tier="direct", device="cpu", cache_bytes=1 << 20) as t:
        t.lookup(ids, label="cold")
        assert_bit_identical(t.lookup(ids, label="warm"), resident_rows(ref, ids))
        warm = t.stats()["phases"]["warm"]
        assert warm["cache_hits"] == 400 and warm["blocks_read"] == 0
        assert t.tier.host_bytes() <= t.tier.host_budget()


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
        assert t.tier.reads_in_flight  # submitted, not yet waited for
        second = t.prefetch(b, label="b")  # drops a's reads in flight
        assert_bit_identical(second.result(), resident_rows(ref, b))
        assert_bit_identical(first.result(), resident_rows(ref, a))
        phases = t.stats()["phases"]
        assert phases["a"]["blocks_read"] > 0 and phases["b"]["blocks_read"] > 0
        assert phases["a"]["cache_hits"] == phases["b"]["cache_hits"] == 0
        assert_bit_identical(t.lookup(a, label="again"), resident_rows(ref, a))
        assert t.stats()["phases"]["again"]["blocks_read"] == 0  # cached by a's lookup


def test_mapped_resident_set_is_held_to_budget(tmp_path):
    path, _ = make_table(tmp_path, "bf16", 1024, rows=4000)  # 8 MiB of rows
    with plestore.open_table(path, tier="mapped", device="cpu", rss_budget_bytes=1 << 20) as t:
        t.lookup(np.arange(4000).reshape(-1, 4))  # touch every page
        assert t.tier.trim() <= 1 << 20
        assert t.tier.trims >= 1
        assert t.stats()["host_budget"] == 1 << 20


@requires_native
def test_mapped_trimmer_checks_after_reads_that_fault_only(tmp_path, monkeypatch):
    """Warm reads (no page fault: nothing newly mapped) leave Rss as it was, so the trimmer
    does not read smaps after them (within _RECHECK_S); a read that faults is trimmed to the
    budget by the trimmer thread itself."""
    import plestore.tiers.mapped as mapped

    path, _ = make_table(tmp_path, "bf16", 1024, rows=4000)  # 8 MiB of rows
    with plestore.open_table(
        path, tier="mapped", device="cpu", rss_budget_bytes=1 << 20, native="on"
    ) as t:
        ids = np.arange(0, 8).reshape(-1, 4)
        for _ in range(2):  # (both stagings' pages touched too: their faults count as growth)
            t.lookup(ids, label="cold")
        time.sleep(0.6)  # the check after the faulting reads
        checks = []
        monkeypatch.setattr(mapped, "mapping_rss", lambda p: checks.append(p) or t.tier._rss)
        for _ in range(8):  # ~0.8 s of warm reads of the same rows
            t.lookup(ids, label="warm")
            time.sleep(0.1)
        warm = t.stats()["phases"]["warm"]
        assert warm["minor_faults"] == warm["major_faults"] == 0
        assert checks == []
        monkeypatch.undo()
        t.lookup(np.arange(4000).reshape(-1, 4))  # faults 8 MiB in: the trimmer trims it
        deadline = time.monotonic() + 5
        while t.tier.trims == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert t.tier.trims >= 1


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
            assert_bit_identical(t.lookup(ids, label="again"), resident_rows(ref, ids))
            again = t.stats()["phases"]["again"]
            assert again["cache_hits"] == 0 and again["blocks_read"] > 0


@pytest.mark.parametrize("n", [64, 2500])  # read in the caller's thread, and by the pool
def test_mapped_counts_the_page_faults_of_its_reads(tmp_path, n):
    path, ref = make_table(tmp_path, "bf16", 1024, rows=4000)  # 2 KiB rows: 2 per page
    ids = np.arange(0, 4000, 4000 // n)[:n].reshape(-1, 1)  # >= n / 2 distinct pages
    with plestore.open_table(path, tier="mapped", device="cpu") as t:
        t.drop_caches()
        assert_bit_identical(t.lookup(ids, label="cold"), resident_rows(ref, ids))
        cold = t.stats()["phases"]["cold"]
        assert cold["major_faults"] + cold["minor_faults"] >= n // 2


def test_mapped_cold_mode_prefetches_pages_and_faults_in_parallel(fp8_table):
    """After a read that took major faults, the mapped tier advises WILLNEED at prefetch and
    gathers >= 64 rows on its pool; rows stay exact, and a warm read switches it back."""
    path, ref = fp8_table
    ids = np.random.default_rng(9).integers(0, ROWS, (40, 4))  # 160 ids
    with plestore.open_table(path, tier="mapped", device="cpu") as t:
        t.drop_caches()
        t.tier._cold = True  # as after a cold read (eviction is not certain in CI)
        for _ in range(3):  # warm now: inline again, and two warm reads end the cold phase
            assert_bit_identical(t.lookup(ids), resident_rows(ref, ids))
        assert not t.tier._cold


@pytest.mark.parametrize("core", ["auto", "off"])  # the compiled host core, its reference
def test_mapped_stays_cold_while_its_prefetches_read_the_disk(fp8_table, monkeypatch, core):
    """A cold decode step's prefetch brings its pages in, so its read takes no major fault;
    the table is still cold, and the next step's prefetch must advise its rows too (it had
    stopped: every other cold step faulted its rows in one by one)."""
    path, ref = fp8_table
    steps = np.random.default_rng(11).integers(0, ROWS, (3, 16, 1))  # 3 decode steps, b16
    with plestore.open_table(path, tier="mapped", device="cpu", native=core) as t:
        for ids in steps:  # resident: the reads below take no major fault, deterministically
            t.lookup(ids)
        t.tier._cold = True  # as after a cold read
        advised = []  # as if evicted: each step's advice reads a page
        monkeypatch.setattr(t.tier, "_advise", lambda rows, probe: advised.append(1) or 4096)
        for k, ids in enumerate(steps, 1):
            assert_bit_identical(t.prefetch(ids).result(), resident_rows(ref, ids))
            assert len(advised) == k, f"step {k}'s prefetch advised nothing"
        assert t.tier._cold
        # another lookup's read between a prefetch and its own read takes the prefetch's
        # bytes: the table must stay cold for the next step all the same
        a, b, c = (ids.reshape(-1) for ids in steps)
        out = np.empty((16, t.tier.staging_stride), np.uint8)
        t.tier.prefetch(b)
        t.tier.read(a, out)
        t.tier.read(b, out)
        t.tier.prefetch(c)
        assert len(advised) == len(steps) + 2 and t.tier._cold


@pytest.mark.parametrize("core", ["auto", "off"])
def test_mapped_leaves_its_cold_mode_when_the_rows_are_resident(fp8_table, monkeypatch, core):
    """After a cold phase (major faults) a lookup whose rows' pages are resident takes the
    warm path at once: no WILLNEED, no pool tasks."""
    path, ref = fp8_table
    ids = np.random.default_rng(10).integers(0, ROWS, (40, 4))  # 160 ids
    with plestore.open_table(path, tier="mapped", device="cpu", native=core) as t:
        assert_bit_identical(t.lookup(ids), resident_rows(ref, ids))  # its pages are resident now
        t.tier._cold, t.tier._clean = True, 0  # as after cold reads of other rows
        pooled, advised = [], []  # gathers in the cold pool's 16-row pieces; WILLNEED's results
        host_core = t.tier._core

        class Spy:  # the host core, its gathers' piece sizes recorded
            def __getattr__(self, name):
                return getattr(host_core, name)

            def gather(self, *args, **kw):
                pooled.extend([1] if args[10] == 16 else [])
                return host_core.gather(*args, **kw)

        monkeypatch.setattr(t.tier, "_core", Spy())
        real = t.tier._advise
        monkeypatch.setattr(
            t.tier, "_advise", lambda rows, probe: advised.append(real(rows, probe)) or advised[-1]
        )
        assert_bit_identical(t.prefetch(ids).result(), resident_rows(ref, ids))
        assert not pooled and advised == [-1]  # sampled, nothing advised
        assert_bit_identical(t.prefetch(ids).result(), resident_rows(ref, ids))
        assert not pooled and not t.tier._cold  # two reads without the disk: warm again


@pytest.mark.parametrize("willneed", [False, True])
def test_mapped_large_reads_with_and_without_willneed(fp8_table, willneed):
    """Reads big enough to go to the fault threads (and, with willneed, the page hints)."""
    path, ref = fp8_table
    opts = dict(tier="mapped", device="cpu", willneed=willneed, threads=2)  # ~1,450 rows a part
    with plestore.open_table(path, **opts) as t:
        ids = np.random.default_rng(3).integers(0, ROWS, (512, 16))
        assert_bit_identical(t.lookup(ids), resident_rows(ref, ids))
        assert t.stats()["tier_detail"]["willneed"] is willneed


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
