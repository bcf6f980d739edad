"""A graph feed around an engine's steps (#50): the wake that ends the host side's sleep as a
step begins (feed_wake, both cores), and the check after a step (check_feeds) that fails the
step whose host side failed or died — on CPU through the feed's host thread, on CUDA with
captured replays."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

import plestore
from conftest import assert_bit_identical, requires_cuda, requires_native
from plestore import native
from plestore.integrations.layerlookup import PleLayerLookup
from plestore.kernels.feed import FAILED, HEADER_WORDS, KEY, POSTED, READY
from plestore.lookup.graphfeed import FeedError, check_feeds, live_feeds, wake_feeds
from plestore.native.constants import W_ASLEEP, W_WAKE, W_WOKEN, C
from tier_tables import FORMATS, ROWS, make_table, resident_rows

CORES = [
    pytest.param(native.load("off"), id="reference"),
    pytest.param(native.load("on") if native.available() else None, id="compiled",
                 marks=requires_native),
]  # fmt: skip
NAP_S = 5.0  # every sleep between polls this long: only a wake ends one sooner


@pytest.fixture(scope="module")
def table_file(tmp_path_factory):
    return make_table(tmp_path_factory.mktemp("bf16"), "bf16", FORMATS["bf16"], block=512)


@pytest.mark.parametrize("host", CORES)
def test_a_wake_ends_the_host_sides_sleep(host):
    """feed_serve asleep (5 s naps, no post pending): feed_wake ends the nap at once — a post
    made before it is served (spending the wake), a wake alone is acted on (WOKEN catches up
    with WAKE), a stop is seen — never after a nap."""
    words, counters = (
        np.zeros(HEADER_WORDS, np.int64),
        np.zeros(len(native.FEED_COUNTERS), np.int64),
    )
    serving = threading.Thread(
        target=host.feed_serve,
        args=(words, counters, (), None, 0, 0, 0, 0.0, NAP_S, NAP_S, 60.0),
    )
    serving.start()
    deadline = time.monotonic() + 2
    while not words[W_ASLEEP] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert words[W_ASLEEP] == 1  # asleep on WAKE
    t0 = time.monotonic()
    words[KEY], words[POSTED] = 0, 1  # (plan None: feed_serve returns the post to Python)
    host.feed_wake(words)
    serving.join(NAP_S / 2)
    assert not serving.is_alive() and time.monotonic() - t0 < NAP_S / 2
    assert words[W_WAKE] == words[W_WOKEN] == 1 and words[W_ASLEEP] == 0  # the post spent it
    # the next call: no post, a wake then a stop — both end its nap
    serving = threading.Thread(
        target=host.feed_serve,
        args=(words, counters, (), None, 1, 0, 0, 0.0, NAP_S, NAP_S, 60.0),
    )
    serving.start()
    while not words[W_ASLEEP] and time.monotonic() < deadline + 2:
        time.sleep(0.01)
    host.feed_wake(words)
    while words[W_WOKEN] != 2 and time.monotonic() < deadline + 4:
        time.sleep(0.01)
    assert words[W_WOKEN] == words[W_WAKE] == 2  # acted on: it spins, then sleeps again
    counters[C.STOP] = 1
    host.feed_wake(words)
    serving.join(NAP_S / 2)
    assert not serving.is_alive()


def test_an_eager_post_wakes_its_feed_and_wake_feeds_reaches_every_feed(table_file):
    path, ref = table_file
    with plestore.open_table(path, tier="direct", device="cpu") as t:
        ids = torch.zeros(2, 4, dtype=torch.int64)
        feed = t.staged((2, 4), ids=ids, feed=True)
        words = feed.feeder.header
        for k in range(3):
            want = np.arange(8).reshape(2, 4) + k
            ids.copy_(torch.from_numpy(want))
            feed.post()
            assert_bit_identical(feed.decode(), resident_rows(ref, want))
        assert int(words[W_WAKE]) == 3  # one wake a post
        wake_feeds()
        assert int(words[W_WAKE]) == 4
        check_feeds()  # nothing failed
    wake_feeds()  # (a closed table's feed is no longer live)
    assert int(words[W_WAKE]) == 4


def _failed_step(t):
    """Step 1 of a fed lookup on table t, its ids outside the table: its host read fails."""
    ids = torch.zeros(1, 4, dtype=torch.int64)
    feed = t.staged((1, 4), ids=ids, feed=True)
    ids.fill_(ROWS + 3)
    feed.post()
    assert torch.isnan(feed.decode().float()).all()
    return feed


def test_check_feeds_fails_the_step_whose_host_read_failed(table_file):
    """The step after which the engine checks: FeedError naming the table and the cause, once
    (the next steps run again)."""
    path, _ = table_file
    with plestore.open_table(path, tier="mapped", device="cpu", timeout_s=5) as t:
        _failed_step(t)
        with pytest.raises(FeedError, match=rf"table {t.spec.name}: step 1's host read failed"):
            check_feeds()
        check_feeds()


@pytest.mark.parametrize("host", CORES)
def test_clear_if_clears_only_the_value_read(host):
    words = np.zeros(HEADER_WORDS, np.int64)
    words[FAILED] = 6  # a later step's failure, written after the check read 5
    assert host.clear_if(words, FAILED, 5) is False and words[FAILED] == 6
    assert host.clear_if(words, FAILED, 6) is True and words[FAILED] == 0
    with pytest.raises(IndexError, match="outside words"):
        host.clear_if(words, HEADER_WORDS, 0)


class _RacingCore:
    """The feed's core, but a step fails (FAILED = 2, its error kept) just before the check
    clears step 1's word: the race an engine's check beside the next step runs."""

    def __init__(self, feeder, core):
        self.feeder, self.core = feeder, core

    def __getattr__(self, name):
        return getattr(self.core, name)

    def clear_if(self, words, i, expected):
        if i == FAILED and expected == 1:
            self.feeder.error = RuntimeError("step 2's read")
            self.core.publish(words, FAILED, 2)
        return self.core.clear_if(words, i, expected)


def test_a_failure_during_the_check_is_kept_for_the_next(table_file):
    path, _ = table_file
    with plestore.open_table(path, tier="mapped", device="cpu", timeout_s=5) as t:
        feeder = _failed_step(t).feeder
        feeder.core = _RacingCore(feeder, feeder.core)
        with pytest.raises(FeedError, match=r"step 1's host read failed"):
            check_feeds()
        feeder.core = feeder.core.core
        with pytest.raises(FeedError, match=r"step 2's host read failed: step 2's read"):
            check_feeds()
        check_feeds()


def test_a_layer_lookup_fails_at_the_step_its_host_side_died(table_file):
    """PleLayerLookup on CPU (the engine's eager path through the graph feed): steps exact,
    then the host thread killed mid-run — the very next step's finish raises, naming the table
    and that the host side is dead; no NaN row is returned."""
    path, ref = table_file
    with plestore.open_table(path, tier="direct", device="cpu", timeout_s=0.3) as t:
        lookup = PleLayerLookup(t, heads=4, max_tokens=8)
        for k in range(3):
            want = np.arange(12).reshape(3, 4) + k
            lookup.start(torch.from_numpy(want))
            assert_bit_identical(lookup.finish(3), resident_rows(ref, want))
        (feeder,) = [f for f in live_feeds() if f.context is t.context]
        feeder.stop()
        lookup.start(torch.from_numpy(np.arange(12).reshape(3, 4)))
        with pytest.raises(FeedError, match=rf"table {t.spec.name}: step 4's .*host side is dead"):
            lookup.finish(3)


@pytest.mark.gpu
@requires_cuda
def test_a_killed_host_side_fails_the_replayed_step_at_that_step(table_file):
    """Captured replays of a host tier, each followed by the engine's sync and check_feeds: the
    host thread killed mid-run — the first replay after it is the step that raises (naming the
    table), not a later eager call; replays before it were exact."""
    path, ref = table_file
    with plestore.open_table(path, tier="direct", device="cuda", timeout_s=0.5) as t:
        ids = torch.zeros(4, 4, dtype=torch.int64, device="cuda")
        feed = t.staged((4, 4), ids=ids, feed=True)
        feed.post()
        feed.decode()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            feed.post()
            out = feed.decode()
            token = out.float().sum(dim=1).argmax()  # a stand-in for sampling: one value
        rng = np.random.default_rng(4)
        for _ in range(4):
            want = rng.integers(0, ROWS, (4, 4))
            ids.copy_(torch.from_numpy(want))
            wake_feeds()
            g.replay()
            token.cpu()  # the engine's sync for the sampled token
            check_feeds()
            assert_bit_identical(feed.out, resident_rows(ref, want))
        feed.feeder.stop()
        wake_feeds()
        g.replay()
        token.cpu()
        with pytest.raises(FeedError, match=rf"table {t.spec.name}: step \d+'s rows did not"):
            check_feeds()
        assert int(feed.feeder.header[READY]) < int(feed.feeder.counter[0])
