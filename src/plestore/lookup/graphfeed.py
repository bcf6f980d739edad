"""Host tiers inside a captured decode graph: a lookup whose ids the graph posts to the host and
whose rows the graph waits for on the GPU — no graph break, no stream sync.

    feed = table.staged((T, k), out=rows, ids=ids, feed=True)   # before capture
    with torch.cuda.graph(g):
        ...hash writes ids...
        feed.post()          # ids + seq into mapped pinned memory (kernels/feed.py)
        ...layer 0...        # meanwhile the host side reads the rows into fixed staging
        feed.decode()        # wait for "seq ready" (bounded), decode the staging into `out`

The host side (`GraphFeeder`, one per table, started with its first feed) is a thread whose wait
is native `feed_serve` with the GIL released: it spins on the header's POSTED word while steps
keep coming (SPIN_S after the last post: the GPU's post reaches it in a PCIe write's time), then
polls with sleeps growing from SLEEP_S to SLEEP_MAX_S (an idle engine costs ~1/100 core). A step
after a quiet spell does not wait out a sleep: the engine's Python calls `wake_feeds()` as a step
begins (before its graph replays; an eager post wakes its own feed), which ends the sleep at once
(a futex) and the thread spins again as after a post. Where the tier's read has host parts
(`Tier.host_parts`: a plain gather from a mapping or pinned DRAM, its blocks checked with
verify_reads, the direct tier's core, a cascade's pinned part and file part), the whole step
runs there, in C (`host_path` "native"; "reference" on the numpy core): the ids checked as
Table.lookup checks them, this rank's ids, the GPU row cache's probe under its directory's lock
(the slots this feed holds written where admissions see them), the misses read into the feed's
pinned staging, the index, READY = seq — the engine's Python holding the GIL delays no step. A
step the core refused fails with the error its state names (hostplan.step_error: a failed read,
a corrupt block, a bad id); one whose mapping's file changed is staged again by the thread with
the GIL, through `StagedLookup.stage` (the tier names a removed, replaced or truncated file, or
takes a touched one as its own and the step runs on a new plan); then READY = seq. A failed step
is FAILED = seq with the error kept, and logged (as is a step the GPU gave up on: TIMED_OUT),
once until `check()`. The GPU's wait polls READY for its own seq, so a late or stale step's rows
are never taken for this step's; after `timeout_s` it gives up, writes TIMED_OUT and the decode
fills `out` with NaN. `check()` raises the host-visible error naming the table and the cause.
Nothing runs during a replay, so the engine calls `check_feeds()` (every live feed's check)
after its own sync for a step's sampled tokens and before it returns them: by then the step's
FAILED (host) or TIMED_OUT (GPU) word is written, so a failed step fails at that step and its
NaN rows reach no token unannounced; each eager start and finish checks too. The native path's
steps reach the table's metrics (phase "graph") and the tier's counts from C counters when stats
are read.

Order is the stream's: step s+1's post follows step s's decode, so the host never rewrites a
staging the GPU still reads. On CPU the same host thread serves the kernels' torch references.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from plestore import native
from plestore.io.memory import HostBuffer
from plestore.kernels.feed import (
    FAILED,
    HEADER_WORDS,
    KEY,
    POSTED,
    READY,
    TIMED_OUT,
    feed_post,
    feed_wait,
)
from plestore.lookup.hostplan import (
    HostPlan,
    core_name,
    counted_reads,
    counted_record,
    step_counters,
    step_error,
)
from plestore.native.constants import C

if TYPE_CHECKING:
    from plestore.lookup.context import TableContext
    from plestore.lookup.staged import StagedLookup

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "SLEEP_MAX_S",
    "SLEEP_S",
    "SPIN_S",
    "FeedError",
    "GraphFeeder",
    "HostFedLookup",
    "check_feeds",
    "live_feeds",
    "relaxed",
    "thread_cpu_s",
    "uncaptured",
    "wake_feeds",
]

log = logging.getLogger("plestore")

#: the GPU's wait for a step's rows when the table sets no timeout_s (a cold step reads in ms)
DEFAULT_TIMEOUT_S = 10.0
#: the host thread spins this long after a post (an engine's decode steps come closer), on CUDA
SPIN_S = 0.05
#: then polls with sleeps from SLEEP_S doubling up to SLEEP_MAX_S, each ended early by a wake
#: (an engine's step beginning: `wake_feeds`); a post no wake announced waits up to SLEEP_MAX_S
#: more; the idle host thread's cost: RESULTS.md "vLLM: a decode step's lookup"
SLEEP_S, SLEEP_MAX_S = 50e-6, 500e-6
_RETURN_S = 0.25  # a quiet host thread looks in Python this often (its tier's read counts)
_live: weakref.WeakSet[GraphFeeder] = weakref.WeakSet()  # this process's running feeds
_live_lock = threading.Lock()  # (a feed may start on another thread while a step runs)


def live_feeds() -> list[GraphFeeder]:
    """This process's running graph feeds."""
    with _live_lock:
        return list(_live)


def wake_feeds() -> None:
    """A step is about to run: every live feed's host side woken from its sleep between polls
    (the engine's Python, before the step's graph replays; a syscall only where the thread
    sleeps)."""
    for feeder in live_feeds():
        feeder.wake()


def check_feeds() -> None:
    """FeedError, naming the table and the cause, if any live feed's step lost its rows (the
    engine's Python, after its sync for a step's sampled tokens, before it returns them)."""
    for feeder in live_feeds():
        feeder.check()


@contextlib.contextmanager
def relaxed(device: torch.device) -> Iterator[None]:
    """Inside a capture: this thread's capture mode relaxed, so a first launch may load its
    kernel's module and a buffer may be pinned (a global capture forbids both)."""
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        yield
        return
    before = native.cuda_capture_mode(native.CAPTURE_RELAXED)
    try:
        yield
    finally:
        if before >= 0:
            native.cuda_capture_mode(before)


@contextlib.contextmanager
def uncaptured(device: torch.device) -> Iterator[None]:
    """Buffers made now even inside a capture: relaxed, on a side stream (their zeros written
    at once, not on each replay; their memory not the graph's pool), finished on leaving."""
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        yield
        return
    with relaxed(device):
        side = _idle_stream(device)
        with torch.cuda.stream(side):
            yield
        side.synchronize()


#: torch's streams of a priority and device (c10's kStreamsPerPool), handed out in turn
_POOL_STREAMS = 32


def _idle_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream of torch's pool that no capture runs on: the pool hands out its streams in
    turn, so a new one may be the very stream being captured (an engine's capture stream is
    one of them), whose zeros would join the graph and whose sync would end the capture."""
    for _ in range(_POOL_STREAMS + 1):
        side = torch.cuda.Stream(device)
        with torch.cuda.stream(side):
            if not torch.cuda.is_current_stream_capturing():
                return side
    raise RuntimeError(f"every CUDA stream of torch's pool on {device} is being captured")


class FeedError(RuntimeError):
    """A captured step's rows did not come: the host side failed, died or was too late."""


class GraphFeeder:
    """One table's host side: the header in mapped pinned memory, the device sequence counter,
    the feeds by key, and the thread serving them."""

    def __init__(self, context: TableContext, timeout_s: float | None = None) -> None:
        self.context = context  # what it takes from its table (lookup/context.py)
        self.timeout_s = float(timeout_s or context.timeout_s or DEFAULT_TIMEOUT_S)
        cuda = context.cuda
        self._header = HostBuffer(HEADER_WORDS * 8, pin=cuda, hugepages=False)
        self.header = self._header.tensor.view(torch.int64)  # [HEADER_WORDS]
        self._words = self._header.array.view(np.int64)
        self.counter = torch.zeros(1, dtype=torch.int64, device=context.device)  # the step's seq
        self.bad = torch.zeros(1, dtype=torch.uint8, device=context.device)  # 1: rows missing
        self.feeds: list[HostFedLookup] = []
        self.error: Exception | None = None
        #: the host core its thread's calls run on (the table's)
        self.core = context.core
        #: where a step's host side runs: "native" (all of it in C, no GIL), "reference" (the
        #: same on the numpy core)
        self.host_path = core_name(self.core)
        self.counters = step_counters()  # the native path's [STOP, STEPS, ...] (C writes)
        self._folded = np.zeros_like(self.counters)  # the counters already in the metrics
        self._fold_lock = threading.Lock()
        context.metrics.add_source(self.fold)  # (every snapshot counts the native steps)
        #: each feed's (box, staging rows, index, held), by key: feed_serve's feeds
        self.buffers: tuple = ()
        self._plan: HostPlan | None = None  # the host step's, kept while it holds (plan())
        self._spin_s = SPIN_S if cuda else 0.0  # (on CPU the poster shares the cores)
        self._logged = False  # a failure logged since the last check()
        self._thread = threading.Thread(
            target=self._serve, name=f"plestore-feed-{context.name}", daemon=True
        )
        self._thread.start()
        with _live_lock:
            _live.add(self)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def add(self, staged: StagedLookup, ids: torch.Tensor) -> HostFedLookup:
        feed = HostFedLookup(self, staged, ids, key=len(self.feeds))
        self.feeds.append(feed)
        fixed = staged.fixed
        bufs = (feed.box_array, fixed.rows_array, fixed.index_array, feed.held)
        self.buffers = (*self.buffers, bufs)
        return feed

    def wake(self) -> None:
        """A step is coming: the host thread's sleep between polls ended now."""
        self.core.feed_wake(self._words)

    def check(self) -> None:
        """Raise FeedError, naming the table, if a step's rows did not come (then the error is
        cleared: the next steps run again)."""
        timed_out, failed = int(self._words[TIMED_OUT]), int(self._words[FAILED])
        error, name = self.error, self.context.name
        if not (timed_out or failed):
            return
        # cleared only where they still hold what was read: a later step failing meanwhile
        # (an engine checks while the next step runs) keeps its word for the next check
        self.core.clear_if(self._words, TIMED_OUT, timed_out)
        if failed and self.core.clear_if(self._words, FAILED, failed) and self.error is error:
            self.error = None
        self._logged = False
        if failed:
            raise FeedError(f"table {name}: step {failed}'s host read failed: {error}") from error
        state = "running" if self.alive else "dead"
        raise FeedError(
            f"table {name}: step {timed_out}'s rows did not reach the GPU within "
            f"{self.timeout_s:g} s (the host side is {state}); that step's rows are NaN"
        )

    def stats(self) -> dict:
        """The feed's side of the table's stats (`thread_cpu_s`: the host thread's CPU time so
        far, where Linux says)."""
        steps = int(self.counters[C.STEPS])
        return {
            "host_path": self.host_path,
            "feeds": len(self.feeds),
            "native_steps": steps,
            "thread_cpu_s": thread_cpu_s(self._thread.native_id),
        }

    def fold(self) -> None:
        """The native path's steps since the last fold into the table's metrics (phase graph)."""
        with self._fold_lock:
            now = self.counters.copy()
            d, self._folded = (now - self._folded).tolist(), now
        t = self.context
        t.metrics.record_many(counted_record(d, "graph", t.tier.row_bytes), d[C.STEPS])
        if d[C.STEPS]:
            t.tier.fed_reads(counted_reads(d, int(now[C.CLEAN])))

    def stop(self) -> None:
        """End the host thread (a captured step replayed after this waits out its timeout)."""
        self.counters[C.STOP] = 1
        self._thread.join()
        self._plan = None  # (the tier's parts go with the tier)

    def close(self) -> None:
        with _live_lock:
            _live.discard(self)
        self.stop()
        self.fold()
        for feed in self.feeds:
            feed.close()
        self._header.close()

    def plan(self) -> HostPlan | None:
        """feed_serve's host step plan (lookup/hostplan.py), the last one while it still holds,
        or None (the tier closed: a post is handed to stage(), which says so)."""
        self._plan = HostPlan.current(self.context, self._plan)  # (None: the tier closed)
        return self._plan

    def _serve(self) -> None:
        last, timed_out, posted_ns = int(self._words[POSTED]), 0, 0
        while True:
            self.fold()  # (the tier hears of the fed reads before the next plan reads it)
            plan = self.plan()
            feeds, args = (self.buffers, plan.args) if plan is not None else ((), None)
            state, seq, detail, posted_ns = self.core.feed_serve(
                self._words, self.counters, feeds, args, last, timed_out, posted_ns,
                self._spin_s, SLEEP_S, SLEEP_MAX_S, _RETURN_S,
            )  # fmt: skip
            what = native.FEED_STATES[state]
            last = seq  # the last step the call served or returned for (no_feed: before it)
            if what == "stop":
                return
            if what == "timed_out":
                timed_out = int(self._words[TIMED_OUT])
                if timed_out:
                    self._log(f"step {timed_out}'s rows did not reach the GPU in time")
                continue
            if what == "quiet" or (what == "no_feed" and detail < len(self.buffers)):
                continue  # (no_feed: a feed added meanwhile: served on the next call)
            if what == "no_feed":
                last = int(self._words[POSTED])
            if what in ("posted", "file_changed"):  # the tier looks at its file (stage())
                self._stage(last)
            else:
                self._fail(last, self._refused(what, detail))

    def _refused(self, what: str, at: int) -> Exception:
        """The error of a step the native path refused (`at`: its detail, a bad id's position)."""
        feed = self.feeds[int(self._words[KEY])] if what != "no_feed" else None
        if feed is None:
            return RuntimeError(f"no feed of key {at} was posted to")
        return step_error(self.context, what, at, feed.posted_ids)

    def _stage(self, seq: int) -> None:
        feed = self.feeds[int(self._words[KEY])]
        try:
            feed.staged.stage(feed.posted_ids, label="graph")
        except Exception as e:  # noqa: BLE001  (kept for check(); the GPU is told)
            self._fail(seq, e)
        else:
            self.core.publish(self._words, READY, seq)  # (a release: after the rows, on any host)

    def _fail(self, seq: int, error: Exception) -> None:
        self.error = error
        self._log(f"step {seq}'s host read failed: {error}")  # (before the GPU is told)
        self.core.publish(self._words, FAILED, seq)  # (after the error: check() reads it then)

    def _log(self, what: str) -> None:
        """An ERROR, once until check() (the engine hears of it there)."""
        if not self._logged:
            self._logged = True
            log.error("plestore: table %s: %s", self.context.name, what)


def thread_cpu_s(native_id: int | None) -> float | None:
    """A thread's CPU time, from Linux's /proc/self/task/<id>/schedstat (ns on the CPU), or
    None where there is none."""
    try:
        with open(f"/proc/self/task/{native_id}/schedstat") as f:
            return int(f.read().split()[0]) * 1e-9
    except (OSError, ValueError, IndexError):
        return None


class HostFedLookup:
    """A host tier's staged lookup fed inside a graph: `post()` where the ids exist, `decode()`
    where the rows are consumed (both capturable)."""

    def __init__(self, feeder: GraphFeeder, staged: StagedLookup, ids: torch.Tensor, key: int):
        self.feeder, self.staged, self.key = feeder, staged, key
        self.out, self.shape = staged.out, staged.shape
        self.ids = ids
        cuda = ids.device.type == "cuda"
        self._box = HostBuffer(staged.n * 8, pin=cuda, hugepages=False)
        self.box = self._box.tensor.view(torch.int64)  # [n]: the posted ids
        self.box_array = self._box.array.view(np.int64)  # [n]: the same, for the host side
        self.posted_ids = self.box_array.reshape(self.shape)
        self._timeout_ns = int(feeder.timeout_s * 1e9)
        self._bad = feeder.bad.view(torch.bool)
        #: [n]: the GPU row cache's dynamic slot of each id this step holds (-1: none): the
        #: staged lookup's own array (one per step's rows, whichever path stages them)
        self.held = staged.held

    def post(self) -> None:
        """GPU: this step's ids to the host side (after the hash wrote them)."""
        f = self.feeder
        with relaxed(self.ids.device):
            feed_post(self.ids, f.header, self.box, f.counter, self.key)
        if self.ids.device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            f.wake()  # (run now: CPU, or an eager step)

    def decode(self) -> torch.Tensor:
        """GPU: wait for this step's rows, decode them into `out` (NaN if they did not come)."""
        f = self.feeder
        with relaxed(self.ids.device):
            feed_wait(f.header, f.counter, f.bad, self._timeout_ns)
            self.staged.decode()
            self.out.masked_fill_(self._bad, float("nan"))
        return self.out

    def close(self) -> None:
        self._box.close()  # (the held array is the staged lookup's: it lets go of it)
