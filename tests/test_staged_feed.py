"""Host-fed staged lookups (lookup/graphfeed.py): the step's ids posted to the table's host
thread, its rows waited for where they are consumed — on CPU with the kernels' torch references
and a real thread, on the GPU captured in one CUDA graph with the Triton kernels."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import plestore
from conftest import assert_bit_identical, requires_cuda
from plestore.kernels.feed import FAILED, POSTED, READY, TIMED_OUT
from plestore.lookup.graphfeed import FeedError
from plestore.native.constants import WARM_READS
from plestore.tiers.base import FedReads
from tier_tables import FORMATS, ROWS, make_table, resident_rows

HOST_TIERS = ["mapped", "direct", "pinned", "cascade", "direct+gpu-cache"]
#: each fed tier's table options: a cascade of a device part (the GPU row cache's resident
#: rows), a pinned part and the file; a GPU row cache in front of direct
OPTIONS = {
    "cascade": dict(device_budget_bytes=500 * 90, pinned_budget_bytes=1000 * 96),
    "direct+gpu-cache": dict(gpu_cache_bytes=32 << 10),
}


def _open(path, tier, **kw):
    """open_table of a fed tier by its name here (HOST_TIERS)."""
    return plestore.open_table(path, tier=tier.partition("+")[0], **OPTIONS.get(tier, {}), **kw)


@pytest.fixture(scope="module", params=["nvfp4", "bf16"])
def table_file(request, tmp_path_factory):
    name = request.param
    return make_table(tmp_path_factory.mktemp(name), name, FORMATS[name], block=512)


def _step(feed, ids, want):
    """One step as a graph runs it: the hash writes ids, post, (layer 0), decode."""
    ids.copy_(torch.from_numpy(want))
    feed.post()
    return feed.decode()


@pytest.mark.parametrize("tier", HOST_TIERS)
def test_fed_rows_equal_the_resident_table_step_after_step(table_file, tier):
    """Two feeds of one table (two step sizes, one host thread, one sequence), ids changing every
    step, repeats included: every step's rows exact; the thread's steps in the metrics."""
    path, ref = table_file
    rng = np.random.default_rng(3)
    with _open(path, tier, device="cpu") as t:
        feeds = {}
        for n in (1, 8):
            ids = torch.zeros(n, 4, dtype=torch.int64)
            feeds[n] = (t.staged((n, 4), ids=ids, feed=True), ids)
        for step in range(6):
            n = (1, 8)[step % 2]
            feed, ids = feeds[n]
            want = rng.integers(0, ROWS, (n, 4))
            want[-1] = want[0]
            got = _step(feed, ids, want)
            assert got.data_ptr() == feed.out.data_ptr()
            assert_bit_identical(got, resident_rows(ref, want))
            t.check_feed()
        words = feeds[1][0].feeder.header
        assert int(words[POSTED]) == int(words[READY]) == 6
        assert t.stats()["phases"]["graph"]["calls"] == 6


@pytest.mark.parametrize("tier", HOST_TIERS)
def test_the_host_path_is_native_for_every_host_tier(table_file, tier):
    """Every host tier runs the whole step in C (the reference core: the same step in numpy):
    gathers, the direct core, a cascade's parts, the GPU row cache's probe; stats() say so and
    count the native path's steps, their rows, and the tier's own counts (direct's cache)."""
    path, ref = table_file
    with _open(path, tier, device="cpu") as t:
        ids = torch.zeros(2, 4, dtype=torch.int64)
        feed = t.staged((2, 4), ids=ids, feed=True)
        core = "native" if t.options.tuning.native == "on" else "reference"
        if t.options.tuning.native == "auto":
            core = "native" if plestore.native.available() else "reference"
        assert feed.feeder.host_path == core
        want = np.arange(8).reshape(2, 4) * 300 + 7  # every part of a cascade
        for _ in range(3):
            assert_bit_identical(_step(feed, ids, want), resident_rows(ref, want))
        stats = t.stats()
        assert stats["feed"]["host_path"] == feed.feeder.host_path
        assert stats["feed"]["thread_cpu_s"] > 0  # (Linux: the thread's schedstat)
        graph = stats["phases"]["graph"]
        assert graph["calls"] == 3 and graph["rows"] == 24
        assert t.stats()["phases"]["graph"]["calls"] == 3  # (folded once)
        if tier == "direct":  # the core's row cache: 8 misses, then 16 hits of the rows again
            detail = stats["tier_detail"]
            assert (detail["cache_misses"], detail["cache_hits"]) == (8, 16)
            assert graph["cache_hits"] == 16 and graph["blocks_read"] == 8
        if tier == "cascade":  # rows [0, 500): the GPU row cache's resident part
            assert graph["gpu_cache_hits"] == 3 * 2


@pytest.mark.parametrize("tier", ["direct"])
def test_a_quiet_host_side_serves_each_step_once(table_file, tier):
    """The host thread's wait returns to Python every quarter second while no step comes; it
    goes back to waiting for the next post, never serving the last step again (which would
    count it twice, and on a GPU spin a core SPIN_S after each)."""
    path, ref = table_file
    with _open(path, tier, device="cpu") as t:
        ids = torch.zeros(2, 4, dtype=torch.int64)
        feed = t.staged((2, 4), ids=ids, feed=True)
        want = np.arange(8).reshape(2, 4)
        assert_bit_identical(_step(feed, ids, want), resident_rows(ref, want))
        time.sleep(0.8)  # (three quiet returns)
        assert t.stats()["feed"]["native_steps"] == 1
        assert t.stats()["phases"]["graph"]["calls"] == 1


def test_mapped_with_block_checks_is_the_host_step(table_file):
    """A mapping's reads checked against the table's CRC-32s (verify_reads): the feed's steps
    run in the host core too (the blocks checked there), rows exact."""
    path, ref = table_file
    with plestore.open_table(path, tier="mapped", device="cpu", verify_reads=True) as t:
        ids = torch.zeros(2, 4, dtype=torch.int64)
        feed = t.staged((2, 4), ids=ids, feed=True)
        assert feed.feeder.host_path == ("native" if plestore.native.available() else "reference")
        want = np.arange(8).reshape(2, 4) * 7
        assert_bit_identical(_step(feed, ids, want), resident_rows(ref, want))
        assert t.stats()["phases"]["graph"]["calls"] == 1


def test_a_fed_steps_cache_slots_stay_until_its_next_step(table_file):
    """A fed step's GPU-cache hits are read by its decode after the host step: eager lookups
    admitting meanwhile (every way of those sets wanted) never evict them; the step's rows stay
    exact, and its next step releases them."""
    path, ref = table_file
    rng = np.random.default_rng(4)
    with plestore.open_table(path, tier="direct", device="cpu", gpu_cache_bytes=32 << 10) as t:
        cache, d = t.gpu_cache, t.gpu_cache.directory
        hot = rng.integers(0, ROWS, (150, 4))
        for _ in range(3):
            t.lookup(hot)  # seen thrice: admitted
        ids = torch.zeros(8, 4, dtype=torch.int64)
        feed = t.staged((8, 4), ids=ids, feed=True)
        want = hot[:8]
        ids.copy_(torch.from_numpy(want))
        feed.post()
        words = feed.feeder.header
        t0 = time.monotonic()
        while int(words[READY]) != 1 and time.monotonic() - t0 < 5:
            time.sleep(0.001)
        held = feed.held[feed.held >= 0]
        assert held.size > 8 and np.isin(held, cache.held()).all()
        rows_held = d.dynamic_tags()[held].copy()
        for _ in range(4):  # other frequent rows: admissions want every way
            t.lookup(rng.integers(0, ROWS, (400, 4)))
        assert (d.dynamic_tags()[held] == rows_held).all()
        assert_bit_identical(feed.decode(), resident_rows(ref, want))
        assert t.stats()["phases"]["graph"]["gpu_cache_hits"] == held.size
        _step(feed, ids, np.full((8, 4), 7))
        assert not np.isin(held, cache.held()).all()


@pytest.mark.parametrize("tier", HOST_TIERS)
def test_a_ranks_fed_rows_are_its_own_and_zeros(table_file, tier):
    """A rank's part of the table: its ids' rows exact, another rank's zeros, as Table.lookup;
    an id outside the whole table fails the step."""
    path, ref = table_file
    with _open(path, tier, device="cpu", row_start=100, row_end=2300) as t:
        ids = torch.zeros(3, 4, dtype=torch.int64)
        feed = t.staged((3, 4), ids=ids, feed=True)
        want = np.array([[0, 100, 2299, 2300], [150, 150, 5, ROWS - 1], [620, 1121, 1722, 2123]])
        got = _step(feed, ids, want)
        assert_bit_identical(got, t.lookup(torch.from_numpy(want)))
        assert t.stats()["phases"]["graph"]["absent"] == 4
        t.check_feed()
        got = _step(feed, ids, np.full((3, 4), -2))
        assert torch.isnan(got.float()).all()
        with pytest.raises(FeedError, match=r"row id -2 at position \(0, 0\) is outside"):
            t.check_feed()


def test_a_failed_step_is_logged_once_until_check(table_file, caplog):
    path, _ = table_file
    with plestore.open_table(path, tier="mapped", device="cpu", timeout_s=5) as t:
        ids = torch.zeros(1, 4, dtype=torch.int64)
        feed = t.staged((1, 4), ids=ids, feed=True)
        with caplog.at_level("ERROR", logger="plestore"):
            for _ in range(3):
                _step(feed, ids, np.full((1, 4), ROWS))
            errors = [r for r in caplog.records if r.levelname == "ERROR"]
            assert len(errors) == 1 and "step 1's host read failed" in errors[0].getMessage()
            with pytest.raises(FeedError):
                t.check_feed()
            _step(feed, ids, np.full((1, 4), ROWS))
            assert len([r for r in caplog.records if r.levelname == "ERROR"]) == 2


def test_a_failed_host_read_is_nan_rows_and_an_error_naming_the_table(table_file):
    path, ref = table_file
    with plestore.open_table(path, tier="mapped", device="cpu", timeout_s=5) as t:
        ids = torch.zeros(2, 4, dtype=torch.int64)
        feed = t.staged((2, 4), ids=ids, feed=True)
        bad = np.full((2, 4), ROWS + 7)
        t0 = time.monotonic()
        got = _step(feed, ids, bad)
        assert time.monotonic() - t0 < 2  # the host said FAILED: no wait for the timeout
        assert torch.isnan(got.float()).all()
        with pytest.raises(FeedError, match=rf"table {t.spec.name}: step 1's host read failed"):
            t.check_feed()
        t.check_feed()  # cleared: later steps run again
        want = np.arange(8).reshape(2, 4)
        assert_bit_identical(_step(feed, ids, want), resident_rows(ref, want))


def test_a_dead_host_side_is_a_bounded_wait_then_an_error(table_file):
    """The host thread killed mid-run: the next step's wait ends after timeout_s with NaN rows,
    TIMED_OUT holds its seq, and check_feed() names the table; the stale READY of the step
    before is never taken for this one."""
    path, ref = table_file
    with plestore.open_table(path, tier="direct", device="cpu", timeout_s=0.3) as t:
        ids = torch.zeros(3, 4, dtype=torch.int64)
        feed = t.staged((3, 4), ids=ids, feed=True)
        want = np.arange(12).reshape(3, 4)
        assert_bit_identical(_step(feed, ids, want), resident_rows(ref, want))
        feed.feeder.stop()
        t0 = time.monotonic()
        got = _step(feed, ids, want + 1)
        assert 0.3 <= time.monotonic() - t0 < 3
        assert torch.isnan(got.float()).all()
        words = feed.feeder.header
        assert int(words[TIMED_OUT]) == 2 and int(words[READY]) == 1 and int(words[FAILED]) == 0
        with pytest.raises(FeedError, match=rf"table {t.spec.name}: step 2's rows did not reach"):
            t.check_feed()


def test_a_fed_lookup_needs_device_ids(table_file):
    path, _ = table_file
    with (
        plestore.open_table(path, tier="mapped", device="cpu") as t,
        pytest.raises(ValueError, match="give ids"),
    ):
        t.staged((2, 4), feed=True)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("tier", HOST_TIERS)
def test_fed_lookup_replays_in_one_cuda_graph(table_file, tier):
    """hash -> post -> work -> decode captured as ONE graph per step size; replays across
    changing ids and two sizes: rows exact on every replay, no host work by the caller."""
    path, ref = table_file
    rng = np.random.default_rng(9)
    with _open(path, tier, device="cuda", timeout_s=3) as t:
        graphs = {}
        for n in (1, 64):
            src = torch.zeros(n, 4, dtype=torch.int64, device="cuda")  # what the "hash" reads
            ids = torch.zeros_like(src)
            feed = t.staged((n, 4), ids=ids, feed=True)
            x = torch.randn(256, 256, device="cuda")

            def step(src=src, ids=ids, feed=feed, x=x):
                ids.copy_(src)
                feed.post()
                _ = x @ x  # layer 0
                return feed.decode()

            step()  # warm-up (compiles; the host side serves it)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
            graphs[n] = (g, src, feed)
        for k in range(8):
            n = (1, 64)[k % 2]
            g, src, feed = graphs[n]
            want = rng.integers(0, ROWS, (n, 4))
            src.copy_(torch.from_numpy(want))
            g.replay()
            torch.cuda.synchronize()
            assert_bit_identical(feed.out, resident_rows(ref, want))
            t.check_feed()


@pytest.mark.gpu
@requires_cuda
def test_a_killed_host_side_ends_the_replay_in_bounded_time(table_file):
    path, ref = table_file
    with plestore.open_table(path, tier="mapped", device="cuda", timeout_s=0.5) as t:
        ids = torch.zeros(4, 4, dtype=torch.int64, device="cuda")
        feed = t.staged((4, 4), ids=ids, feed=True)
        feed.post()
        feed.decode()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            feed.post()
            feed.decode()
        want = np.arange(16).reshape(4, 4)
        ids.copy_(torch.from_numpy(want))
        g.replay()
        torch.cuda.synchronize()
        assert_bit_identical(feed.out, resident_rows(ref, want))
        feed.feeder.stop()
        t0 = time.monotonic()
        g.replay()
        torch.cuda.synchronize()
        assert 0.4 < time.monotonic() - t0 < 5
        assert torch.isnan(feed.out.float()).all()
        with pytest.raises(FeedError, match=rf"table {t.spec.name}: step \d+'s rows did not"):
            t.check_feed()


@pytest.mark.parametrize("tier", ["mapped"])
def test_fed_steps_end_a_mapped_tables_cold_phase(table_file, tier):
    """The fed steps' reads count for the mapped tier's cold phase as its own do: after steps
    that need no disk the tier (and so the next plan the host thread builds) is warm again."""
    path, ref = table_file
    with _open(path, tier, device="cpu") as t:
        t.tier.drop_cache()
        assert t.tier.gather_source().clean == 0  # cold: every row on the disk
        ids = torch.zeros(2, 4, dtype=torch.int64)
        feed = t.staged((2, 4), ids=ids, feed=True)
        want = np.arange(8).reshape(2, 4)
        for _ in range(1 + WARM_READS):  # the first needs the disk, the next ones do not
            assert_bit_identical(_step(feed, ids, want), resident_rows(ref, want))
        t.stats()  # (the host thread's steps folded in)
        assert t.tier.gather_source().clean == WARM_READS
        assert feed.feeder.plan().parts[0].source.clean == WARM_READS  # (the plan follows)


@pytest.mark.parametrize("tier", HOST_TIERS)
def test_a_feeds_plan_is_built_once_and_again_when_its_tier_changes(table_file, tier):
    """The host step's plan is one object while the tier's parts and the GPU row cache stay as
    they were (a serve loop rebuilds nothing); a part's changed state (a mapping's clean reads)
    makes a new one; the closed tier has none."""
    path, _ = table_file
    with _open(path, tier, device="cpu") as t:
        feed = t.staged((2, 4), ids=torch.zeros(2, 4, dtype=torch.int64), feed=True)
        plan = feed.feeder.plan()
        assert plan is not None and feed.feeder.plan() is plan
        rows, start, end, parts, cache = plan.args
        assert (rows, start, end) == (t.spec.rows, t.row_range.start, t.row_range.end)
        assert len(parts) == len(t.tier.host_parts())
        assert (cache is None) == (t.gpu_cache is None)
        if tier == "mapped":
            t.tier.fed_reads(FedReads(1, True, clean=0))  # (a fed step that needed the disk)
            cold = feed.feeder.plan()
            assert cold is not plan and cold.parts[0].source.clean == 0
            assert feed.feeder.plan() is cold
    assert feed.feeder.plan() is None
