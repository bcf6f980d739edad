"""Earlier behaviours of the library, restored by monkeypatching, so that one device call times
a kept decision side by side with what it replaced (the H200's run-to-run noise exceeds the
effects). One process per variant, each with its own resident baseline:

    python benchmarks/probes/variants.py VARIANT[.VARIANT] bench e2e TABLE ...   # the plestore CLI

Variants (each backs a decision in docs/architecture.md; numbers in RESULTS.md "Tried, not kept"):
  base            the library as it is
  caller-stream   lookups run a step ahead put their GPU work on the caller's stream, and the
                  pinned tier reads them on the GPU up to GPU_GATHER_MAX_IDS ids
  numpy-get       the row cache probes batches of any size with numpy (not torch ops)
  chunked         the direct tier reads a large lookup in 16,384-row chunks, as the others do
  wait-one        io_uring waits for a batch's reads one completion at a time
  ahead-host      the pinned tier gathers every lookup run a step ahead on the host (not only
                  past AHEAD_GPU_MAX_IDS ids)
  threaded-get    (a candidate, not a restore) the row cache probes batches past PARALLEL_ROWS
                  in numpy on a pool of 8 threads, a slice each, instead of in torch ops
  pinned-chunked  the pinned tier reads a large lookup in 16,384-row chunks whose H2D overlaps
                  the next read, not in one call
  even-grain      (a candidate) the pinned tier's native gathers past 2,048 rows split into a
                  piece per pool thread (a 16,384-row read's 2,048-row pieces wake 8 of 16)
  advise-ahead    (a candidate) a cold mapped table's prefetch of more than 64 rows advises
                  WILLNEED on its pool, not in the caller; the next read waits for it
  ids-main-stream the reference decoder copies a host tier's row ids to the host on the
                  decode's stream, so front(s+1) queues behind the copy
"""

from __future__ import annotations

import sys


def _patch(owner, name: str, value) -> None:
    """Set owner.name, which must exist: a variant whose target was renamed fails loudly."""
    if not hasattr(owner, name):
        raise SystemExit(f"{owner.__name__}.{name} is gone: update {__file__}")
    setattr(owner, name, value)


def apply(names: list[str]) -> None:
    import plestore.lookup.table as lookup_table
    import plestore.tiers.rowcache as rowcache
    from plestore.lookup import Table
    from plestore.tiers.base import Tier
    from plestore.tiers.direct import DirectTier

    for name in names:
        if name == "caller-stream":
            _caller_stream(Table)
        elif name == "numpy-get":
            _patch(rowcache, "PARALLEL_ROWS", 1 << 62)
        elif name == "chunked":
            _patch(DirectTier, "read_chunk_rows", Tier.read_chunk_rows)
        elif name == "wait-one":
            _wait_one()
        elif name == "ahead-host":
            _patch(lookup_table, "AHEAD_GPU_MAX_IDS", 0)
        elif name == "threaded-get":
            threaded_get()
        elif name == "pinned-chunked":
            from plestore.tiers.pinned import PinnedTier

            _patch(PinnedTier, "read_chunk_rows", Tier.read_chunk_rows)
        elif name == "even-grain":
            _even_grain()
        elif name == "advise-ahead":
            _advise_ahead()
        elif name == "ids-main-stream":
            _ids_main_stream()
        elif name != "base":
            raise SystemExit(f"unknown variant {name!r} (see {__file__})")


def _caller_stream(table_cls) -> None:
    deferred, path = table_cls._deferred, table_cls._path
    table_cls._deferred = lambda self, *a: deferred(self, *a[:-1], False)  # (a[-1]: ahead)
    table_cls._path = lambda self, ids, staged=False, ahead=False: path(self, ids, staged)


def _wait_one() -> None:
    """IoUring.finish as it was: every wait is for at least one completion."""
    from plestore.io.uring import IoUring

    enter = IoUring._enter

    def one_at_a_time(self, min_complete: int) -> None:
        enter(self, min(min_complete, 1))

    _patch(IoUring, "_enter", one_at_a_time)


def threaded_get(threads: int = 8, min_rows: int = 2048) -> None:
    """RowCache._get_parallel as numpy _get on slices of the batch, one per pool thread (numpy
    releases the GIL inside its array loops; the caller holds the cache's lock throughout)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from plestore.tiers.rowcache import RowCache

    pool = ThreadPoolExecutor(threads, thread_name_prefix="plestore-probe")

    def get_parallel(self, rows, out):
        step = -(-len(rows) // max(1, min(threads, len(rows) // min_rows)))
        parts = [
            pool.submit(self._get, rows[a : a + step], out[a : a + step])
            for a in range(0, len(rows), step)
        ]
        return np.concatenate([p.result() for p in parts])

    _patch(RowCache, "_get_parallel", get_parallel)


def _even_grain(min_rows: int = 2048) -> None:
    """PinnedTier.read with the native gather's grain = rows / threads past min_rows."""
    from plestore.tiers.pinned import PinnedTier

    read = PinnedTier.read

    class _Grain:
        def __init__(self, native, grain: int) -> None:
            self._native, self._grain = native, grain

        def gather(self, *args, **kw):
            return self._native.gather(*args, grain=self._grain, **kw)

    def even(self, rows, out):
        native = self._native
        if native is None or len(rows) <= min_rows:
            return read(self, rows, out)
        self._native = _Grain(native, max(256, -(-len(rows) // max(1, self._threads))))
        try:
            return read(self, rows, out)
        finally:
            self._native = native

    _patch(PinnedTier, "read", even)


def _advise_ahead(min_rows: int = 64) -> None:
    """MappedTier.prefetch hands a large advice to the tier's pool; _take_ahead (every read's)
    waits for what is pending first, so a read counts its prefetch's bytes as before."""
    import threading

    import numpy as np

    from plestore.tiers.mapped import MappedTier

    prefetch, take, close = MappedTier.prefetch, MappedTier._take_ahead, MappedTier.close
    pending: dict[int, list] = {}
    lock = threading.Lock()

    def ahead(self, rows):
        if len(rows) <= min_rows or not self._cold or self._closed:
            return prefetch(self, rows)
        rows = np.ascontiguousarray(rows, np.int64)
        with lock:
            pending.setdefault(id(self), []).append(self._pool.submit(prefetch, self, rows))

    def take_ahead(self):
        with lock:
            waits = pending.pop(id(self), [])
        for f in waits:
            f.result()
        return take(self)

    def closing(self):
        close(self)  # (its pool's shutdown waits for the advice queued)
        with lock:
            pending.pop(id(self), None)

    _patch(MappedTier, "prefetch", ahead)
    _patch(MappedTier, "_take_ahead", take_ahead)
    _patch(MappedTier, "close", closing)


def _ids_main_stream() -> None:
    """StepRunner._send as it was: every copy and the event on the decode's stream."""
    from plestore.models.graphs import StepRunner

    def send(self, k: int) -> None:
        if k:
            self._tokens_host[k % 2].copy_(self.pred, non_blocking=True)
        if self._ids_host is not self.ids:
            self._ids_host.copy_(self.ids, non_blocking=True)
        if self._sent is not None:
            self._sent[k % 2].record()

    _patch(StepRunner, "_send", send)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0)
    apply(sys.argv[1].split("."))
    from plestore.cli import main as cli

    sys.exit(cli(sys.argv[2:]))


if __name__ == "__main__":
    main()
