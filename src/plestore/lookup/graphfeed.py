"""Host tiers inside a captured decode graph: a lookup whose ids the graph posts to the host and
whose rows the graph waits for on the GPU — no graph break, no stream sync.

    feed = table.staged((T, k), out=rows, ids=ids, feed=True)   # before capture
    with torch.cuda.graph(g):
        ...hash writes ids...
        feed.post()          # ids + seq into mapped pinned memory (kernels/feed.py)
        ...layer 0...        # meanwhile the host side reads the rows into fixed staging
        feed.decode()        # wait for "seq ready" (bounded), decode the staging into `out`

The host side (`GraphFeeder`, one per table, started with its first feed) is a thread that
spins in C with the GIL released (native `wait_word`) on the header's POSTED word (a core per
table while it lives: the GPU's post reaches it in a PCIe write's time; on CPU it sleeps until
`post()` wakes it); for a new
sequence number it stages that feed's ids as `StagedLookup.stage` does (the tier's read into the
feed's pinned staging, under the host lock), then writes READY = seq (or FAILED = seq with the
error kept). The GPU's wait polls READY for its own seq, so a late or stale step's rows are
never taken for this step's; after `timeout_s` it gives up, writes TIMED_OUT and the decode
fills `out` with NaN. `check()` raises the host-visible error naming the table (the engine
calls it where its Python runs: each eager start; nothing runs during a replay).

Order is the stream's: step s+1's post follows step s's decode, so the host never rewrites a
staging the GPU still reads. On CPU the same host thread serves the kernels' torch references.
"""

from __future__ import annotations

import contextlib
import logging
import threading
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

if TYPE_CHECKING:
    from plestore.lookup.staged import StagedLookup
    from plestore.lookup.table import Table

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "FeedError",
    "GraphFeeder",
    "HostFedLookup",
    "relaxed",
    "uncaptured",
]

log = logging.getLogger("plestore")

#: the GPU's wait for a step's rows when the table sets no timeout_s (a cold step reads in ms)
DEFAULT_TIMEOUT_S = 10.0
_POLL_S = 0.05  # the host thread looks at its stop flag this often


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
        side = torch.cuda.Stream(device)
        with torch.cuda.stream(side):
            yield
        side.synchronize()


class FeedError(RuntimeError):
    """A captured step's rows did not come: the host side failed, died or was too late."""


class GraphFeeder:
    """One table's host side: the header in mapped pinned memory, the device sequence counter,
    the feeds by key, and the thread serving them."""

    def __init__(self, table: Table, timeout_s: float | None = None) -> None:
        self.table = table
        self.timeout_s = float(timeout_s or table.options.timeout_s or DEFAULT_TIMEOUT_S)
        cuda = table.device.type == "cuda"
        self._header = HostBuffer(HEADER_WORDS * 8, pin=cuda, hugepages=False)
        self.header = self._header.tensor.view(torch.int64)  # [HEADER_WORDS]
        self._words = self._header.array.view(np.int64)
        self.counter = torch.zeros(1, dtype=torch.int64, device=table.device)  # the step's seq
        self.bad = torch.zeros(1, dtype=torch.uint8, device=table.device)  # 1: rows missing
        self.feeds: list[HostFedLookup] = []
        self.error: Exception | None = None
        self._core = native.load(table.options.tuning.native)
        self._stop = threading.Event()
        self._cuda = cuda
        self._posted = threading.Event()  # CPU: post() sets it (no GPU writes the word there)
        self._thread = threading.Thread(
            target=self._serve, name=f"plestore-feed-{table.spec.name}", daemon=True
        )
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def add(self, staged: StagedLookup, ids: torch.Tensor) -> HostFedLookup:
        feed = HostFedLookup(self, staged, ids, key=len(self.feeds))
        self.feeds.append(feed)
        return feed

    def check(self) -> None:
        """Raise FeedError, naming the table, if a step's rows did not come (then the error is
        cleared: the next steps run again)."""
        timed_out, failed = int(self._words[TIMED_OUT]), int(self._words[FAILED])
        error, name = self.error, self.table.spec.name
        if not (timed_out or failed):
            return
        self._words[TIMED_OUT] = self._words[FAILED] = 0
        self.error = None
        if failed:
            raise FeedError(f"table {name}: step {failed}'s host read failed: {error}") from error
        state = "running" if self.alive else "dead"
        raise FeedError(
            f"table {name}: step {timed_out}'s rows did not reach the GPU within "
            f"{self.timeout_s:g} s (the host side is {state}); that step's rows are NaN"
        )

    def posted(self) -> None:
        """A CPU post was written (wakes the host thread)."""
        self._posted.set()

    def stop(self) -> None:
        """End the host thread (a captured step replayed after this waits out its timeout)."""
        self._stop.set()
        self._posted.set()
        self._thread.join()

    def close(self) -> None:
        self.stop()
        for feed in self.feeds:
            feed.close()
        self._header.close()

    def _serve(self) -> None:
        last = int(self._words[POSTED])
        while not self._stop.is_set():
            if self._cuda:  # the GPU writes the word: spin on it, without the GIL
                seq = self._core.wait_word(self._words, POSTED, last, _POLL_S)
            else:  # a thread of this process posts: sleep until it says so (no core spent)
                self._posted.wait(_POLL_S)
                self._posted.clear()
                seq = int(self._words[POSTED])
            if seq == last:
                continue
            last = seq
            feed = self.feeds[int(self._words[KEY])]
            try:
                feed.staged.stage(feed.posted_ids, label="graph")
            except Exception as e:  # noqa: BLE001  (kept for check(); the GPU is told)
                self.error = e
                self._words[FAILED] = seq
                log.error(
                    "plestore: table %s: step %d's host read failed: %s",
                    self.table.spec.name,
                    seq,
                    e,
                )
            else:
                # after the rows: x86 keeps plain stores in order and the native gather's
                # non-temporal ones end with a fence (a weakly ordered host would need one here)
                self._words[READY] = seq


class HostFedLookup:
    """A host tier's staged lookup fed inside a graph: `post()` where the ids exist, `decode()`
    where the rows are consumed (both capturable)."""

    def __init__(self, feeder: GraphFeeder, staged: StagedLookup, ids: torch.Tensor, key: int):
        self.feeder, self.staged, self.key = feeder, staged, key
        self.table, self.out, self.shape = staged.table, staged.out, staged.shape
        self.ids = ids
        cuda = ids.device.type == "cuda"
        self._box = HostBuffer(staged.n * 8, pin=cuda, hugepages=False)
        self.box = self._box.tensor.view(torch.int64)  # [n]: the posted ids
        self.posted_ids = self._box.array.view(np.int64).reshape(self.shape)
        self._timeout_ns = int(feeder.timeout_s * 1e9)
        self._bad = feeder.bad.view(torch.bool)

    def post(self) -> None:
        """GPU: this step's ids to the host side (after the hash wrote them)."""
        f = self.feeder
        with relaxed(self.ids.device):
            feed_post(self.ids, f.header, self.box, f.counter, self.key)
        if self.ids.device.type == "cpu":
            f.posted()

    def decode(self) -> torch.Tensor:
        """GPU: wait for this step's rows, decode them into `out` (NaN if they did not come)."""
        f = self.feeder
        with relaxed(self.ids.device):
            feed_wait(f.header, f.counter, f.bad, self._timeout_ns)
            self.staged.decode()
            self.out.masked_fill_(self._bad, float("nan"))
        return self.out

    def close(self) -> None:
        self._box.close()
