"""A lookup's host path: the tier reads rows into pinned staging, then one gather+decode kernel
puts them in place on the device (or decodes them on the CPU).

`HostPath` belongs to a `Table` and holds what host lookups share: two stagings used in turn
(each reused only after the GPU finished with it), the device iota, and the lock host jobs take
turns under (the worker's, the caller's inline ones, a `StagedLookup`'s stage()).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from plestore.io.memory import HostBuffer, disk_read_bytes
from plestore.kernels import triton_available
from plestore.kernels.gather_decode import gather_decode
from plestore.lookup.metrics import CallRecord

if TYPE_CHECKING:
    from plestore.lookup import Table

__all__ = ["UVA_MAX_BYTES", "HostPath", "fill_index"]

#: inline host lookups staging at most this many bytes let the kernel read them from pinned
#: memory (one launch); larger ones are copied first (see HostPath.steps)
UVA_MAX_BYTES = 256 << 10
#: views of the staging and the iota kept per shape (lookup sizes of an engine's steps repeat)
_VIEWS = 64


class Staging:
    """Pinned host buffers for one lookup in flight (row bytes + index), grown on demand.
    Reused only after the GPU finished with them (the event of their last use)."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.rows: HostBuffer | None = None
        self.index: HostBuffer | None = None
        self.last_use: Any = None
        self._done: Any = None  # the event a lookup through it records (see done)
        self._views: dict = {}  # a shape -> its view of the buffers (see rows_tensor)

    def ensure(self, row_bytes: int, index_items: int) -> None:
        if self.last_use is not None:
            self.last_use.synchronize()
        if self.rows is None or self.rows.nbytes < row_bytes:
            self._views.clear()
            if self.rows is not None:
                self.rows.close()
            self.rows = HostBuffer(max(row_bytes, 1 << 20), pin=self.pin, hugepages=False)
        if self.index is None or self.index.nbytes < index_items * 8:
            self._views.clear()
            if self.index is not None:
                self.index.close()
            self.index = HostBuffer(max(index_items * 8, 1 << 16), pin=self.pin, hugepages=False)

    def done(self) -> Any:
        """An event to mark the GPU done with these buffers: one, recorded again by each lookup
        through them (ensure() waited for its last record; a new event each lookup costs its
        creation)."""
        if self._done is None:
            self._done = torch.cuda.Event()
        return self._done

    def rows_tensor(self, u: int, rb: int) -> torch.Tensor:
        """The first u staged rows of rb bytes, uint8 [u, rb], made once per shape."""
        return _view(self._views, (u, rb), lambda: self.rows.tensor[: u * rb].view(u, rb))

    def rows_array(self, u: int, rb: int) -> np.ndarray:
        """The first u staged rows of rb bytes, numpy uint8 [u, rb], made once per shape."""
        return _view(self._views, ("np", u, rb), lambda: self.rows.array[: u * rb].reshape(u, rb))

    def index_tensor(self, n: int) -> torch.Tensor:
        """The first n staged index entries, int64 [n], made once per size."""
        return _view(self._views, n, lambda: self.index.tensor[: n * 8].view(torch.int64))

    def close(self) -> None:
        self._views.clear()
        for b in (self.rows, self.index):
            if b is not None:
                b.close()


def _view(views: dict, key: Any, make: Any) -> torch.Tensor:
    """views[key], made by make() the first time (a decode step's sizes repeat; a torch slice
    and view cost ~2 us a lookup, dev VM); at most _VIEWS kept."""
    view = views.get(key)
    if view is None:
        if len(views) >= _VIEWS:
            views.clear()
        view = views[key] = make()
    return view


def fill_index(index: np.ndarray, inr: np.ndarray | None, present: int) -> None:
    """index[j] = the staged row that output row j decodes (-1: another rank's id, zeros),
    from `HostPath.rows_to_read`'s mask and count."""
    positions = np.arange(present, dtype=np.int64)
    if present == index.size:
        index[:] = positions
    else:
        index.fill(-1)
        index[inr] = positions


class HostPath:
    """The host path of one table's lookups (see the module docstring)."""

    def __init__(self, table: Table) -> None:
        self.table = table
        self.staging = [Staging(table._cuda) for _ in range(2)]
        self._turn = 0
        self._iota_ids: torch.Tensor | None = None  # 0, 1, 2, ... on the device (see iota)
        self._iota_views: dict[int, torch.Tensor] = {}  # n -> its first n
        self.lock = threading.Lock()  # host jobs (worker or inline) take turns: staging

    def close(self) -> None:
        for s in self.staging:
            s.close()

    def rows_to_read(self, ids: np.ndarray) -> tuple:
        """(this rank's mask or None if all are, how many are, the rows to read: this rank's
        ids in order, repeats included: a repeated row costs a second copy from memory, and
        the direct tier reads each block once anyway; a dedup sort costs more (measured:
        RESULTS.md "e2e: warm host gathers")."""
        n = ids.size
        if self.table.row_range.rows == self.table.spec.rows:  # every (validated) id is this rank's
            return None, n, ids
        inr = self.table.row_range.holds(ids)
        present = int(inr.sum())
        return inr, present, ids if present == n else ids[inr]

    def iota(self, n: int) -> torch.Tensor:
        """[0, n) on the table's device, made once and read from any stream: on CUDA the device
        is synchronised when it is (re)made, so no stream reads it unfinished or freed."""
        view = self._iota_views.get(n)
        if view is not None:
            return view
        if self._iota_ids is None or self._iota_ids.numel() < n:
            iota = torch.arange(max(n, 1 << 16), device=self.table.device)
            if self.table._cuda:  # the new one is written, and no kernel reads the old one any more
                torch.cuda.synchronize(self.table.device)
            self._iota_ids = iota
            self._iota_views.clear()
        return _view(self._iota_views, n, lambda: self._iota_ids[:n])

    def job(self, *job: Any, **kw: Any) -> None:
        """Run a host lookup under the lock. Where rows are decoded by torch ops (the CPU, the
        GPU row cache's path) in inference mode: rows are data, never differentiated, and `out`
        may be an inference tensor; entered only where the caller is not in it already. The
        plain path on CUDA writes `out` through one Triton kernel, which autograd never sees:
        it needs no mode (entering one cost ~9 us a decode lookup on the H200)."""
        if self._modeless or torch.is_inference_mode_enabled():
            self._job(*job, **kw)
        else:
            with torch.inference_mode():
                self._job(*job, **kw)

    @property
    def _modeless(self) -> bool:
        t = self.table
        return t._cuda and t.gpu_cache is None and triton_available()

    def _job(self, *job: Any, **kw: Any) -> None:
        with self.lock:
            if self.table._closed:  # (close() takes this lock before it frees the tier)
                raise RuntimeError(
                    f"table {self.table.spec.name} was closed before this lookup ran; no rows "
                    "were read"
                )
            if self.table.gpu_cache is not None:
                from plestore.lookup.cachedpath import cached_steps

                cached_steps(self, *job, **kw)
            else:
                self.steps(*job, **kw)

    def steps(
        self,
        ids: np.ndarray,
        out: torch.Tensor,
        label: str,
        stream: Any = None,
        consumer: Any = None,
        ready: Any = None,
        io0: int | None = None,
    ) -> None:
        """Tier reads into pinned staging, then one gather+decode kernel scatters the rows to
        their positions. Where the GPU work goes: worker jobs (`ready` given) on the table's
        stream, after the `consumer` event of prefetch time; inline jobs (the caller's thread,
        at result()) on the caller's stream — no cross-stream events. How rows reach the GPU:
        small stagings are read by the kernel straight from pinned memory (UVA: one launch, no
        copy); larger ones are copied chunk by chunk, each chunk's H2D queued as soon as it is
        filled so reading chunk k+1 overlaps copying chunk k (a kernel reading 6 MB of pinned
        memory took 1.1 ms where a copy and a decode take 0.25, H200). On CPU the same branch
        decodes in place."""
        t0, t = time.perf_counter(), self.table
        if io0 is None:  # (inline jobs count from prefetch, where reads may start)
            io0 = self.disk_mark()
        n = ids.size
        inr, present, rows_to_read = self.rows_to_read(ids)
        u, rb = rows_to_read.size, t.tier.staging_stride
        gpu = self.gpu_stream(stream, ready, out)
        copy = gpu is not None and (ready is not None or u * rb > UVA_MAX_BYTES)
        timed = gpu is not None and t.metrics.time_gpu(label)
        # staged row i is output row i: the cached iota (on the device) serves as the index
        identity = present == n
        staging = self.staging[self._turn]
        self._turn = (self._turn + 1) % len(self.staging)
        staging.ensure(u * rb, 0 if identity else n)
        rec = CallRecord(label=label, path="host", rows=n, absent=n - present)
        if identity and not (copy or timed) and u <= t.tier.read_chunk_rows:
            return self._one_read(rows_to_read, out, staging, gpu, rec, t0, io0)
        rows = staging.rows_array(u, rb)  # [u, staging_stride]
        if not identity:
            fill_index(staging.index.array[: n * 8].view(np.int64), inr, present)
        if gpu is not None and timed:  # around the copy and the decode
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2 + copy)]
        elif gpu is not None:  # one: the GPU is done
            ev = [staging.done()]
        on = self.on(gpu, ready)  # (entered once per GPU step below)
        if copy:
            with on:
                if consumer is not None:
                    gpu.wait_event(consumer)  # out's memory is free to write
                raw = torch.empty((u, rb), dtype=torch.uint8, device=t.device)
                if timed:
                    ev[0].record()
        chunk = t.tier.read_chunk_rows
        tg = time.perf_counter()
        # past a chunk, the read is handed over a chunk at a time, each chunk's copy queued as
        # soon as it is read; a decode lookup's one chunk is one read() (a Reading costs ~2 us)
        reading = t.tier.start_read(rows_to_read, rows) if u > chunk else None
        try:
            if reading is None:
                rec.add_read(t.tier.read(rows_to_read, rows))
                rec.host_gather_s = time.perf_counter() - tg
                if copy:
                    with on:
                        raw.copy_(staging.rows_tensor(u, rb), non_blocking=True)
            else:
                if copy:
                    with on:
                        reading.copy_to(raw, staging.rows.tensor, chunk)
                rec.add_read(reading.done())
                rec.host_gather_s = time.perf_counter() - tg  # (its copies queued meanwhile)
        except BaseException:
            if reading is not None:
                reading.close()  # nothing writes the staging any more
            if copy:  # chunks already queued read the staging: its next use waits for them
                with on:
                    staging.done().record()
                staging.last_use = staging.done()
            raise
        # [n] index: the iota, or the staged index (pinned on CUDA)
        index = self.iota(n) if identity else staging.index_tensor(n)
        src = raw if copy else staging.rows_tensor(u, rb)  # [u, stride]
        if gpu is None:
            td = time.perf_counter()
            self._decode(src, index, out)
            rec.decode_s = time.perf_counter() - td
        else:
            with on:
                if copy and not identity:
                    index = index.to(t.device, non_blocking=True)
                if timed:
                    ev[-2].record()
                self._decode(src, index, out)
                ev[-1].record(gpu)
                if ready is not None:
                    ready.record(gpu)
            staging.last_use = ev[-1]  # the GPU is done with the staged rows and index
            if timed:
                rec.events = [("h2d_s", ev[0], ev[1])] if copy else []
                rec.events.append(("decode_s", ev[-2], ev[-1]))
        self.record(rec, t0, io0)

    def _one_read(
        self,
        rows_to_read: np.ndarray,
        out: torch.Tensor,
        staging: Staging,
        gpu: Any,
        rec: CallRecord,
        t0: float,
        io0: int | None,
    ) -> None:
        """steps() for a lookup in one read and one launch, as a decode step's are: every row
        staged in its output's order, no copy (on CUDA the kernel reads the pinned staging), no
        GPU timing. Its own code: the general path's bookkeeping cost ~10 us a decode lookup
        (dev VM), ~20 on the H200. measured: RESULTS.md "host time, part by part"."""
        t = self.table
        u, rb = rows_to_read.size, t.tier.staging_stride
        tg = time.perf_counter()
        rec.add_read(t.tier.read(rows_to_read, staging.rows_array(u, rb)))
        td = time.perf_counter()
        rec.host_gather_s = td - tg
        src = staging.rows_tensor(u, rb)  # [u, stride]
        if gpu is None:
            self._decode(src, self.iota(u), out)
            rec.decode_s = time.perf_counter() - td
        else:
            with self.on(gpu, None):
                self._decode(src, self.iota(u), out)
                staging.last_use = staging.done()
                staging.last_use.record(gpu)
        self.record(rec, t0, io0)

    def _decode(self, src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
        """out[j] = the table's decode of staged row src[index[j]] (src: uint8 [u, stride])."""
        t = self.table
        gather_decode(src, index, 0, src.shape[0], t.format, t.dim, t.spec.scale, out)

    def gpu_stream(self, stream: Any, ready: Any, out: torch.Tensor) -> Any:
        """The stream a host job's GPU work goes on (None on CPU): a worker job's (`ready`
        given) on the table's; an inline one on the caller's current stream, made to follow
        `stream` (where prefetch was called) when result() is asked on another."""
        t = self.table
        if not t._cuda:
            return None
        gpu = t._stream if ready is not None else torch.cuda.current_stream(t.device)
        if ready is None and stream is not None and gpu != stream:
            gpu.wait_stream(stream)
            out.record_stream(gpu)
        return gpu

    def on(self, gpu: Any, ready: Any) -> Any:
        """The context a host job's GPU work is queued in: `gpu`'s, but none where that is the
        caller's current stream already (an inline job on the table's device: a decode lookup
        then pays for no stream switch)."""
        if gpu is None:
            return contextlib.nullcontext()
        if ready is None and torch.cuda.current_device() == self.table.device.index:
            return contextlib.nullcontext()
        return torch.cuda.stream(gpu)

    def disk_mark(self) -> int | None:
        """/proc/self/io read_bytes now, where a lookup's disk bytes are worth that read (a
        storage tier that does not count its own bytes exactly); else None."""
        tier = self.table.tier
        return disk_read_bytes() if tier.reads_storage and not tier.exact_disk_bytes else None

    def record(self, rec: CallRecord, t0: float, io0: int | None) -> None:
        """A host lookup's call record, completed (its disk bytes, its time since t0), kept."""
        if io0 is not None:
            rec.disk_read_bytes = disk_read_bytes() - io0
        elif self.table.tier.exact_disk_bytes:
            rec.disk_read_bytes = rec.bytes_read
        rec.total_s = time.perf_counter() - t0
        self.table.metrics.record(rec)
