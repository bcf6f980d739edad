"""The user-facing `Table`: row ids in, bf16 rows out on the device — from any tier, exactly
(fp16 / fp32 tables deliver float16 / float32: `Table.dtype`).

    ids [..., k] -> plan (lookup/plan.py's choose_plan: the route — device read | tier read
    into staging | GPU row cache + tier misses — and where it runs) -> executor
    (lookup/executor.py, the route's body in lookup/routes.py; others' ids zeros, no I/O) ->
    gather_decode -> out [..., k * dim]

`lookup(ids)` waits at once and takes the fastest path. `prefetch(ids)` starts the lookup as
soon as the ids exist and returns a `Pending`: large host work runs on the table's worker
thread, GPU work on its stream, and `result()` orders the caller's stream after it by an event
(no GPU sync). Decode-sized host lookups (≤ `inline_ids`) run in the caller's thread at
`result()` instead: a worker would wait for the GIL from a thread busy launching kernels;
their cold reads still start at `prefetch`. `prefetch(defer=True)` + `Pending.run_now()` runs a
lookup a step ahead, beside the step the caller queued (on the table's stream).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from plestore import native
from plestore.formats import get_format
from plestore.lookup.context import TableContext
from plestore.lookup.executor import Executor
from plestore.lookup.gpucache import open_gpu_cache
from plestore.lookup.graphfeed import GraphFeeder, HostFedLookup, uncaptured
from plestore.lookup.metrics import Metrics
from plestore.lookup.pending import Pending
from plestore.lookup.plan import plan_lookup
from plestore.lookup.staged import StagedLookup
from plestore.options import TableOptions
from plestore.tablefile import TableFile
from plestore.tiers import RowRange, choose_tier, make_tier

__all__ = ["Pending", "Table", "open_table", "resolve_device"]

log = logging.getLogger("plestore")


def open_table(
    path: str,
    tier: str | None = None,
    device: str | None = None,
    table: str | None = None,
    **options: Any,
) -> Table:
    """Open a packed table (its .json, its .rows, or the directory holding it) on a tier.

    tier: auto | device | pinned | mapped | direct (AUTO: the fastest that fits, logged).
    device: where rows are delivered (default: cuda if available, else cpu).
    options: any `TableOptions` field (row_start/row_end for this rank's rows, cache_bytes,
    rss_budget_bytes, timeout_s, ...) or `Tuning` knob (threads, queue_depth, ...); PLESTORE_*
    env vars too.
    """
    opts = TableOptions.from_env(tier=tier, device=device, **options)
    return Table(TableFile.open(path, table), opts)


class Table:
    """A table opened on a tier. Thread-safe; use as a context manager or call close()."""

    #: a staged lookup's decode() can be captured in a CUDA graph (a group's over gloo cannot)
    graph_capturable = True

    def __init__(self, file: TableFile, options: TableOptions) -> None:
        self.file = file
        self.spec = file.spec
        self.options = options
        self.format = get_format(self.spec.format)
        self.dim = self.spec.dim
        self.dtype = self.format.torch_dtype  # what lookups deliver: bf16, or fp16 / fp32 rows
        self.device = resolve_device(options.device)
        end = self.spec.rows if options.row_end is None else options.row_end
        self.row_range = RowRange(options.row_start or 0, end)
        if self.row_range.end > self.spec.rows:
            raise ValueError(
                f"row range ends at {end}, table {self.spec.name} has {self.spec.rows} rows"
            )
        self.tier_choice = choose_tier(file, self.row_range, self.device, options)
        log.info(
            "plestore: table %s on tier %s (%s)",
            self.spec.name,
            self.tier_choice.name,
            self.tier_choice.reason,
        )
        self._opened: list = []  # what close() releases, in reverse: the tier, the GPU cache
        self._staged: list[StagedLookup] = []
        self._feeder: GraphFeeder | None = None  # host-fed captured lookups' host side
        core = native.load(options.tuning.native)  # the host core (compiled, or numpy)
        try:
            self.tier = make_tier(self.tier_choice.name, file, self.row_range, self.device, options)
            self._opened.append(self.tier.close)
            self.metrics = Metrics(self.spec.name, self.tier.name)
            self.gpu_cache = open_gpu_cache(self.tier, options, core)  # None unless asked for
            if self.gpu_cache is not None:
                self._opened.append(self.gpu_cache.close)
            #: what the lookup's modules take from this table (lookup/context.py)
            self.context = TableContext(
                name=self.spec.name, rows=self.spec.rows, dim=self.dim, format=self.format,
                scale=self.spec.scale, dtype=self.dtype, device=self.device,
                row_range=self.row_range, tuning=options.tuning, timeout_s=options.timeout_s,
                core=core, tier=self.tier, metrics=self.metrics, gpu_cache=self.gpu_cache,
            )  # fmt: skip
            #: runs every lookup's plan (executor.py): its worker thread and the table's stream
            self.executor = Executor(self.context)
        except BaseException:  # opened completely, or nothing of it is left
            self._release()
            raise

    # -- public API --------------------------------------------------------------------------
    def lookup(
        self, row_ids: Any, label: str = "lookup", timeout: float | None = None
    ) -> torch.Tensor:
        """bf16 [..., k * dim] on the table's device for row ids [..., k]: the last axis is
        one token's k rows (its hash heads) end to end, so 1-D ids [k] give [k * dim]; for a
        row per id as nn.Embedding gives ([..., dim]), look up ids[..., None]. timeout (or the
        table's timeout_s): seconds the wait for a storage tier's reads of more than
        `inline_ids` ids may take before TimeoutError (such a lookup then runs on the table's
        worker); smaller lookups, and a memory tier's, run in this thread unbounded."""
        return self.start_lookup(row_ids, label, None, sync=True, timeout=timeout).result(timeout)

    def lookup_into(
        self, row_ids: Any, out: torch.Tensor, label: str = "lookup", timeout: float | None = None
    ) -> torch.Tensor:
        """Like lookup, writing into a caller-owned bf16 [..., k * dim] buffer (fixed addresses
        for CUDA graphs)."""
        return self.start_lookup(row_ids, label, out, sync=True, timeout=timeout).result(timeout)

    def prefetch(
        self,
        row_ids: Any,
        label: str = "lookup",
        out: torch.Tensor | None = None,
        defer: bool = False,
    ) -> Pending:
        """Start a lookup now; wait for it with `.result()` where the rows are consumed.

        defer: leave the host work, whatever its size, to this thread — `Pending.run_now()`
        once the caller has queued GPU work it would otherwise sit idle behind (an engine
        between launching step k and syncing on it, with step k+1's ids known), or result().
        No worker thread then contends for the GIL. Its storage reads still start now."""
        return self.start_lookup(row_ids, label, out, sync=False, defer=defer)

    def start_lookup(
        self,
        row_ids: Any,
        label: str,
        out: torch.Tensor | None,
        sync: bool,
        defer: bool = False,
        timeout: float | None = None,
    ) -> Pending:
        """Plan the lookup (lookup/plan.py's choose_plan: every decision, the route among them,
        from its size, sync, defer and timeout) and start it (lookup/executor.py): what lookup()
        (sync) and prefetch() run; a sharded table's rank calls it for its part."""
        if self.closed:
            raise RuntimeError(f"table {self.spec.name} is closed")
        ex = self.executor
        call = plan_lookup(
            self.context, ex.plans, ex.stream, row_ids, out, label, sync, defer, timeout
        )
        return ex.start(call)

    @property
    def closed(self) -> bool:
        return self.executor.closed

    @property
    def device_readable(self) -> bool:
        """Whether the GPU reads this table's rows itself, where the tier keeps them (HBM, or
        pinned memory through UVA; not behind a GPU row cache), so a staged lookup of device
        ids needs no host work: `staged(..., device_read=True)` is refused otherwise, and only
        such a table's lookups can run inside a CUDA graph."""
        return self.context.device_readable

    def staged(
        self,
        shape: tuple[int, ...],
        out: torch.Tensor | None = None,
        ids: torch.Tensor | None = None,
        device_read: bool = False,
        feed: bool = False,
    ) -> StagedLookup | HostFedLookup:
        """A lookup of ids shaped `shape` ([..., k]) split into a host `stage(ids)` and a GPU
        `decode()` at fixed addresses, so the decode can be captured in a CUDA graph (see
        `plestore.lookup.staged`). `ids`: an int64 device tensor of that shape whose values decode()
        reads where the tier allows (ids computed on the device; unchecked). `device_read`: the
        kernel reads the rows where the tier keeps them even where staging them would be the
        choice (the pinned tier: through UVA), so a step with `ids` needs no host at all (an
        engine whose ids exist only inside its graph); ValueError for a tier the GPU cannot
        read. `feed` (with `ids`): a host tier's lookup fed inside the graph, its `post()` where
        the ids exist, its `decode()` waiting for the rows on the GPU (`plestore.lookup.graphfeed`;
        `check_feed()` raises a step's missing rows). Closed with the table."""
        if self.closed:
            raise RuntimeError(f"table {self.spec.name} is closed")
        if feed:
            if ids is None:
                raise ValueError("a fed lookup reads the ids where the graph writes them: give ids")
            with uncaptured(self.device):  # (made now, also when asked inside a capture)
                if self._feeder is None:
                    self._feeder = GraphFeeder(self.context)
                    self._opened.append(self._feeder.close)
                lookup = StagedLookup(self.executor, shape, out)
                self._staged.append(lookup)
                return self._feeder.add(lookup, ids)
        lookup = StagedLookup(self.executor, shape, out, ids, device_read)
        self._staged.append(lookup)
        return lookup

    def check_feed(self) -> None:
        """Raise FeedError if a captured host-fed step's rows did not come (the host side
        failed, died or was late); a no-op without fed lookups."""
        if self._feeder is not None:
            self._feeder.check()

    def drop_caches(self) -> None:
        """Forget the rows the tier keeps cached (direct's row cache, mapped's pages and their
        page cache) so the next lookups read storage — a cold start without reopening."""
        with self.executor.lock:
            self.tier.drop_cache()
            if self.gpu_cache is not None:
                self.gpu_cache.clear()

    def stats(self) -> dict:
        """Metrics per phase, what the tier holds, and how it was chosen."""
        self.metrics.host_bytes = self.tier.host_bytes()
        self.metrics.host_budget = self.tier.host_budget()
        feed = self._feeder.stats() if self._feeder is not None else None  # (its steps folded)
        snap = self.metrics.snapshot()
        if feed is not None:
            snap["feed"] = feed
        snap["tier_detail"] = self.tier.describe()
        snap["tier_reason"] = self.tier_choice.reason
        if self.gpu_cache is not None:
            snap["gpu_cache"] = self.gpu_cache.describe()
        snap["device"] = str(self.device)
        return snap

    def close(self) -> None:
        """Release what the table holds, in the reverse of its opening: its lookups (one in
        flight ends first: a host job already running finishes, its rows exact; one not yet
        started, queued on the worker or deferred to result(), raises a RuntimeError saying
        the table was closed), its staged lookups, the graph feed's host side, the GPU row
        cache, the tier. Again: nothing."""
        if self._feeder is not None:
            self._feeder.stop()  # (again: nothing) no host step runs while the rest closes
        if not self.executor.close():
            return
        if self._staged and self.context.cuda:  # a captured graph may still read staging
            torch.cuda.synchronize(self.device)
        for lookup in reversed(self._staged):
            lookup.close()
        self._release()

    def _release(self) -> None:
        """What opening built, last first, each once (a failed open's part too)."""
        while self._opened:
            self._opened.pop()()

    def __enter__(self) -> Table:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Table({self.spec.name!r}, {self.spec.rows} x {self.dim} {self.spec.format}, "
            f"tier={self.tier.name}, device={self.device})"
        )


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {device!r} requested but CUDA is not available; use device='cpu'"
            )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"unsupported device {device!r}: use 'cuda[:N]' or 'cpu'")
    return dev
