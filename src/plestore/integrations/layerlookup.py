"""One PLE layer's rows for an engine step, engine-agnostic (no vLLM import): `start(ids)` as
soon as the step's ids exist (a storage tier's reads begin there), `finish(n)` where the layer
consumes them.

    start(ids [T, heads] int64)  eager: Table.prefetch into a persistent buffer [max_T, heads*dim]
                                 inside a CUDA-graph capture: a staged lookup reading the ids
                                 where the graph's hash writes them — the GPU reads the rows
                                 itself (device; pinned, through UVA) or the table's host thread
                                 is fed them (host tiers: `Table.staged(feed=True)` posts the ids,
                                 finish waits for the rows on the GPU)
    finish(n) -> [n, heads*dim]  the rows, ordered on the caller's stream; `combine` (the ranks'
                                 parts of a vocab-parallel table summed: the engine's all-reduce)
                                 applied

A rank's part of a vocab-parallel table (`summed`) gives other ranks' ids -0.0 rows, so the
engine's own float all-reduce or reduce-scatter of the parts is exact (lookup/ranksum.py).

`captures` says whether this table's step is captured: every tier on CUDA with Triton; without
Triton a host tier's wait cannot be captured, so an engine runs its start/finish eagerly
between graph segments (announced; docs/vllm.md). `capture=False` runs every tier that way.
Each eager start raises a captured step's missing rows first (`Table.check_feed`), and an eager
finish its own step's. On CPU (no
graphs) a host tier's steps of up to FEED_MAX_TOKENS run through the same graph feed — the
table's host thread stages them — so vLLM's CPU build runs the host side a GPU step uses.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from plestore.kernels import triton_available
from plestore.lookup.ranksum import negative_absent

if TYPE_CHECKING:
    from plestore.lookup import Pending, Table
    from plestore.lookup.graphfeed import HostFedLookup
    from plestore.lookup.staged import StagedLookup

__all__ = ["PleLayerLookup"]

log = logging.getLogger("plestore")

#: the largest CPU step (tokens) run through the graph feed (one fixed-shape feed per size)
FEED_MAX_TOKENS = 256


class PleLayerLookup:
    """Lookups of one layer's table, at most `max_tokens` tokens of `heads` ids a step."""

    def __init__(
        self,
        table: Table,
        heads: int,
        max_tokens: int,
        combine: Callable[[torch.Tensor], torch.Tensor] | None = None,
        capture: bool = True,
        summed: bool = False,
        grow: bool = False,
        beside: bool = False,
    ) -> None:
        """combine: the ranks' parts summed (the engine's all-reduce); summed: the parts are
        summed, here or by the engine (its reduce-scatter): other ranks' rows are -0.0; grow:
        an eager step of more than max_tokens enlarges the buffer (for engines that bound a
        step's tokens nowhere the plugin can read; a captured step never grows it); beside: a
        captured step's GPU half (the device read, or the host-fed post, wait and decode) runs
        on a side stream forked at start and joined at finish, beside the layers between them
        (default False: in the caller's stream, where start and finish are; docs/vllm.md)."""
        self.table, self.heads, self.combine = table, heads, combine
        self.summed = summed or combine is not None
        self._ids: torch.Tensor | None = None  # the started step's ids (summed: which are absent)
        self.width = heads * table.dim
        # [max_T, heads * dim]: fixed addresses, made before any capture
        self.buffer = torch.empty(max_tokens, self.width, dtype=table.dtype, device=table.device)
        self._pending: Pending | None = None
        self._rows: torch.Tensor | None = None
        self._staged: dict[tuple, StagedLookup | HostFedLookup] = {}
        self._feed: HostFedLookup | None = None  # the captured step's, between start and finish
        self._capture = capture
        self._grow = grow
        self._device_read: bool | None = None
        cuda = table.device.type == "cuda" and beside
        self._side = torch.cuda.Stream(table.device) if cuda else None
        self._side_done = torch.cuda.Event() if cuda else None
        self._joined = True  # the side stream's work of the started step is joined

    @property
    def device_read(self) -> bool:
        """The GPU reads this table's rows itself (device; pinned through UVA): a captured step
        has no host work at all."""
        if self._device_read is None:
            self._device_read = self.table.device.type == "cuda" and self.table.device_readable
        return self._device_read

    @property
    def captures(self) -> bool:
        """A step's lookup runs inside a CUDA graph: device-read tiers, and host tiers fed by
        the table's host thread where Triton builds the wait (else eager breaks, announced)."""
        if not self._capture or self.table.device.type != "cuda":
            return False
        if self.device_read:
            return True
        if not triton_available():
            self._capture = False
            log.warning(
                "plestore: table %s: no Triton for the captured wait of a host tier: its "
                "lookups run between graph segments (eager breaks)",
                self.table.spec.name,
            )
        return self._capture

    def capturing(self) -> bool:
        """Whether this call runs inside a CUDA graph capture on the table's device."""
        return self.table.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def start(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> None:
        """Start the lookup of a step's ids [T, heads]; its rows go to `out` ([T, heads * dim]
        of the table's dtype and device: an engine's own buffer) or to this lookup's buffer."""
        n = self._check(ids)
        out = self.buffer[:n] if out is None else self._checked_out(out, n)
        self._ids, self._feed, self._joined = ids, None, True  # (a capture that failed between)
        if self.capturing():
            if not self.captures:
                raise RuntimeError(
                    f"table {self.table.spec.name} ({self.table.tier.name} tier): its lookups are "
                    "not captured here (capture=False, or no Triton for a host tier's wait): "
                    "run them outside the graph"
                )
            self._pending = None
            lookup = self._staged_for(ids, out)
            if self._side is None:
                if self.device_read:
                    self._rows = lookup.decode()
                else:  # the graph posts the ids here; finish waits for the rows
                    self._rows, self._feed = None, lookup
                    lookup.post()
                return
            with self._beside():  # the rows come while the caller's layers run
                if not self.device_read:
                    lookup.post()
                self._rows = lookup.decode()
            return
        self.table.check_feed()  # (a replayed step's rows that did not come)
        self._rows = self._feed = None
        if self._feeds_on_cpu(n):  # the host side a captured GPU step uses, run at once
            feed = self._cpu_feed(n, out)
            feed.ids.copy_(ids)
            feed.post()
            self._feed = feed
            return
        self._pending = self.table.prefetch(ids, label="step", out=out)  # (prefill and decode mix)

    def finish(self, n: int) -> torch.Tensor:
        """The rows of the started lookup's first n tokens, [n, heads * dim]."""
        if not self._joined:
            torch.cuda.current_stream(self.table.device).wait_event(self._side_done)
            self._joined = True
        if self._feed is not None:
            self._rows, self._feed = self._feed.decode(), None
            if not self.capturing():  # run at once (CPU): this step's own missing rows, now
                self.table.check_feed()
        if self._pending is not None:
            self._rows, self._pending = self._pending.result(), None
        if self._rows is None:
            raise RuntimeError(f"table {self.table.spec.name}: finish() without a start()")
        rows = self._rows[:n]
        if self.summed:
            rr = self.table.row_range
            negative_absent(rows, self._ids[:n], rr.start, rr.end)
        return rows if self.combine is None else self.combine(rows)

    def close(self) -> None:
        self._pending = self._rows = self._feed = self._ids = None
        self.table.close()

    def _check(self, ids: torch.Tensor) -> int:
        if ids.dim() != 2 or ids.shape[1] != self.heads:
            raise ValueError(
                f"table {self.table.spec.name}: ids must be [tokens, {self.heads}], got "
                f"{tuple(ids.shape)}"
            )
        if ids.shape[0] > self.buffer.shape[0] and self._grow and not self.capturing():
            # (doubling: few buffers; an old one stays alive in the staged lookups writing to it)
            rows = max(ids.shape[0], 2 * self.buffer.shape[0])
            self.buffer = self.buffer.new_empty((rows, self.width))
        if ids.shape[0] > self.buffer.shape[0]:
            raise ValueError(
                f"table {self.table.spec.name}: {ids.shape[0]} tokens in one step, more than "
                f"the {self.buffer.shape[0]} the engine allows (max_num_batched_tokens)"
            )
        return ids.shape[0]

    def _checked_out(self, out: torch.Tensor, n: int) -> torch.Tensor:
        shape = (n, self.width)
        ok = out.dtype == self.table.dtype and out.device == self.table.device
        if not ok or out.numel() != n * self.width or not out.is_contiguous():
            raise ValueError(
                f"table {self.table.spec.name}: the rows' buffer must be a contiguous "
                f"{self.table.dtype} tensor of {shape} elements on {self.table.device}, got "
                f"{out.dtype} {tuple(out.shape)} on {out.device}"
            )
        return out.view(shape)

    @contextlib.contextmanager
    def _beside(self) -> Iterator[None]:
        """Work on the side stream, after the caller's (its ids); finish joins it."""
        self._side.wait_stream(torch.cuda.current_stream(self.table.device))
        with torch.cuda.stream(self._side):
            yield
        self._side_done.record(self._side)
        self._joined = False

    def _staged_for(self, ids: torch.Tensor, out: torch.Tensor):
        """The staged (or host-fed) lookup of this step size: its ids are the graph's own id
        buffer."""
        key = (ids.shape[0], ids.data_ptr(), out.data_ptr())
        if key not in self._staged:
            shape, read = tuple(ids.shape), self.device_read
            self._staged[key] = self.table.staged(
                shape, out=out, ids=ids, device_read=read, feed=not read
            )
        return self._staged[key]

    def _feeds_on_cpu(self, n: int) -> bool:
        """On CPU a host tier's steps of at most FEED_MAX_TOKENS run through the table's graph
        feed (its host thread), as a captured GPU step's do; larger ones through prefetch."""
        t = self.table
        host_tier = not t.tier.can_read_device or t.gpu_cache is not None
        return t.device.type == "cpu" and self._capture and host_tier and n <= FEED_MAX_TOKENS

    def _cpu_feed(self, n: int, out: torch.Tensor) -> HostFedLookup:
        key = ("cpu", n, out.data_ptr())
        if key not in self._staged:
            ids = torch.zeros(n, self.heads, dtype=torch.int64)  # the feed's own id buffer
            self._staged[key] = self.table.staged((n, self.heads), out=out, ids=ids, feed=True)
        return self._staged[key]
