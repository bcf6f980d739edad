"""`open_sharded`: one table served by a torch.distributed group, every rank getting full rows.

    rows:  ids [..., k] -> this rank's rows (others: -0.0 rows, never read) -> all-reduce
    heads: ids [..., k] -> this rank's columns [..., first:end] -> its rows -> all-gather
                                                                   (gather=False: keep the slice)

Why the `rows` sum is exact: each output element has one owner rank (a row lives in exactly one
rank's range); every other rank contributes -0.0, the identity of the group's float sum — the
same parts and the same sum an engine's vocab-parallel plugin gives its own all-reduce
(lookup/ranksum.py).

Ordering: ranks must issue their collectives in the same order. Each lookup's collective is
issued in the order the lookups were started (prefetch order), whatever path each rank's lookup
takes: when its rows are already on their way at prefetch time (a device-path lookup, or a
worker that finished) it is issued right then, on this table's stream after the rows' event,
so it overlaps the caller's work; otherwise at the latest when it, or a later lookup, is
waited for. Callers start lookups of the same shapes in the same order on every rank (as the
engines' tensor-parallel ranks do). A rank whose lookup fails raises and issues no collective
(its peers then fail in theirs, by the group's timeout, rather than sum a partial row), and
the table refuses further lookups: it is out of step with its group.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from plestore.distributed.agree import agree, collective_device, digest
from plestore.distributed.partition import ShardPlan, plan_shard
from plestore.distributed.pending import ShardedPending
from plestore.distributed.staged import ShardedStaged
from plestore.lookup import Table
from plestore.lookup.metrics import Metrics
from plestore.lookup.plan import validate_ids
from plestore.lookup.ranksum import negative_absent
from plestore.options import TableOptions
from plestore.tablefile import TableFile

__all__ = ["ShardedPending", "ShardedTable", "open_sharded"]


def open_sharded(
    path: str,
    shard: str = "rows",
    group: Any = None,
    tier: str | None = None,
    *,
    gather: bool = True,
    pad_to: int = 1,
    table: str | None = None,
    agree_timeout_s: float = 60.0,
    **options: Any,
) -> ShardedTable:
    """Open a packed table across a torch.distributed process group (default: the world).

    shard: "rows" (vocab-parallel: each rank reads only its row range, one all-reduce) or
    "heads" (each rank serves its hash columns, one all-gather; `gather=False` leaves each rank
    its own columns' rows). The split is `plestore.distributed.partition`'s (vLLM's
    vocab-parallel one where defined; `pad_to=64` for VocabParallelEmbedding's). Every rank must
    call this together; ranks that opened different tables (spec or data), or a rank that
    failed, raise GroupDisagrees on every rank, and a rank that never arrives is waited for at
    most `agree_timeout_s`. tier and options: as `open_table` (row_start/row_end come from the
    split); gloo (CPU tensors) or NCCL (the current GPU).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("open_sharded needs torch.distributed initialised (init_process_group)")
    for key in ("row_start", "row_end"):
        if key in options:
            raise ValueError(f"open_sharded sets {key} from the shard split; do not pass it")
    group = dist.group.WORLD if group is None else group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    record, plan, file = None, None, None
    try:
        file = TableFile.open(path, table)
        plan = plan_shard(file.spec, shard, rank, world, pad_to)
        s = file.spec
        record = digest(
            s.to_dict(), file.layout.to_dict(), file.checksums, shard, gather, pad_to, world
        )
        text = f"{s.name}: {s.rows} x {s.dim} {s.format}, data {file.data_id[:12]}, {shard}"
    except (OSError, ValueError) as e:
        text = f"{type(e).__name__}: {e}"
    agree(group, f"open_sharded({path!r})", record, text, record is None, agree_timeout_s)
    local, error = None, None
    try:
        if plan.rows.rows:
            opts = TableOptions.from_env(
                tier=tier, row_start=plan.rows.start, row_end=plan.rows.end, **options
            )
            local = Table(file, opts)
    except (OSError, ValueError, RuntimeError, MemoryError) as e:
        error = f"{type(e).__name__}: {e}"
    try:  # a rank whose tier failed to open must not leave the others to hang in a lookup
        agree(group, "opening each rank's tier", digest("opened"), error or "", bool(error))
    except Exception:
        if local is not None:
            local.close()
        raise
    device = local.device if local is not None else _device(options.get("device"))
    return ShardedTable(file, local, plan, group, gather, device)


class ShardedTable:
    """A table served by a group of ranks; `lookup` / `prefetch` / `lookup_into` as `Table`'s.

    Output: bf16 [..., k * dim] with every row (gather=False in heads mode: [..., local_heads *
    dim], this rank's columns). `table` is this rank's own `Table` (None for a rank the split
    leaves empty)."""

    def __init__(
        self,
        file: TableFile,
        table: Table | None,
        plan: ShardPlan,
        group: Any,
        gather: bool,
        device: torch.device,
    ) -> None:
        self.file, self.table, self.plan, self.group = file, table, plan, group
        self.spec, self.dim = file.spec, file.spec.dim
        self.gather = gather or plan.mode == "rows"
        self.device = device
        self._comm = collective_device(group)
        self.graph_capturable = self._comm.type == "cuda"  # NCCL's collectives can be
        self._metrics = Metrics(file.spec.name, "none") if table is None else table.metrics
        self._collect = plan.world > 1 and self.gather
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._queue: deque[ShardedPending] = deque()  # started, collective not yet issued
        self._lock = threading.RLock()
        self._broken: str | None = None
        self._closed = False

    @property
    def tier(self) -> Any:
        """This rank's tier (None on a rank the split leaves empty)."""
        return None if self.table is None else self.table.tier

    @property
    def metrics(self) -> Any:
        """This rank's lookups' metrics (an empty rank: a table's that never looks up)."""
        return self._metrics

    @property
    def out_heads(self) -> int:
        """Row ids per token a lookup returns rows for."""
        return self.plan.heads if self.gather else self.plan.local_heads

    # -- public API --------------------------------------------------------------------------
    def lookup(self, row_ids: Any, label: str = "lookup", timeout: float | None = None):
        return self._start(row_ids, label, None, sync=True, timeout=timeout).result(timeout)

    def lookup_into(
        self, row_ids: Any, out: torch.Tensor, label: str = "lookup", timeout: float | None = None
    ) -> torch.Tensor:
        return self._start(row_ids, label, out, sync=True, timeout=timeout).result(timeout)

    def prefetch(
        self, row_ids: Any, label: str = "lookup", out: torch.Tensor | None = None, defer=False
    ) -> ShardedPending:
        return self._start(row_ids, label, out, sync=False, defer=defer)

    def staged(self, shape: tuple[int, ...], out=None, ids=None) -> ShardedStaged:
        """As `Table.staged`, over the group (rows mode): see `plestore.distributed.staged`."""
        if self._closed:
            raise RuntimeError(f"sharded table {self.spec.name} is closed")
        return ShardedStaged(self, shape, out, ids)

    def drop_caches(self) -> None:
        if self.table is not None:
            self.table.drop_caches()

    def stats(self) -> dict:
        snap = self.table.stats() if self.table is not None else {}
        snap["shard"] = {
            "mode": self.plan.mode,
            "rank": self.plan.rank,
            "world": self.plan.world,
            "rows": [self.plan.rows.start, self.plan.rows.end],
            "columns": list(self.plan.columns) if self.plan.mode == "heads" else None,
            "gather": self.gather,
            "backend": str(dist.get_backend(self.group)),
        }
        return snap

    def close(self) -> None:
        """Issues the collectives of lookups started and never waited for (the other ranks'
        wait for them), then closes this rank's table."""
        with self._lock:
            if self._closed:
                return
            with contextlib.suppress(Exception):
                if self._queue:
                    self._issue_through(self._queue[-1], None)
            self._closed = True
        if self._stream is not None:
            self._stream.synchronize()
        if self.table is not None:
            self.table.close()

    def __enter__(self) -> ShardedTable:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        p = self.plan
        return (
            f"ShardedTable({self.spec.name!r}, {p.mode}, rank {p.rank}/{p.world}, rows "
            f"[{p.rows.start}, {p.rows.end}), tier={getattr(self.tier, 'name', None)})"
        )

    # -- internals ---------------------------------------------------------------------------
    def _start(self, row_ids, label, out, sync, defer=False, timeout=None) -> ShardedPending:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"sharded table {self.spec.name} is closed")
            if self._broken:
                raise RuntimeError(self._broken)
            ids, shape = self._validate(row_ids)
            n = int(np.prod(shape[:-1], dtype=np.int64))
            if out is not None:
                want = (*shape[:-1], self._row_ids_out(shape) * self.dim)
                if out.dtype != torch.bfloat16 or out.device != self.device:
                    raise ValueError(f"out must be bf16 on {self.device}, got {out.dtype}")
                if tuple(out.shape) != want or not out.is_contiguous():
                    raise ValueError(f"out must be a contiguous {want} tensor, got {out.shape}")
            local_out = out if self.plan.mode == "rows" else None
            local = None
            if self.table is not None:  # (sync: the path Table.lookup takes, waited for at once)
                if sync:  # its host path may run here and now: past the ids' check (on every
                    # rank alike), a failure breaks the step
                    validate_ids(self.table.context, ids)
                    with self._out_of_step_on_error():
                        local = self.table.start_lookup(
                            ids, label, local_out, True, timeout=timeout
                        )
                else:
                    local = self.table.prefetch(ids, label, out=local_out, defer=defer)
            pending = ShardedPending(self, local, n, shape, out, sync, ids)
            self._queue.append(pending)
            if not sync:
                self._pump()
            return pending

    def _validate(self, row_ids: Any) -> tuple[Any, tuple]:
        """This rank's ids (heads: its columns) and the ids' shape. Every rank checks every id
        (not only its own), so a bad id raises on all ranks alike, before any collective."""
        is_t = isinstance(row_ids, torch.Tensor)
        shape = tuple(row_ids.shape) if is_t else np.shape(row_ids)
        if len(shape) == 0:
            raise ValueError("row ids must have at least one dimension ([..., k])")
        if self.plan.mode == "rows":
            if self.table is None:  # an empty rank still checks what its peers check
                _check_range(row_ids, [(0, self.spec.rows)] * shape[-1], self.spec.name)
            return row_ids, shape
        if shape[-1] != self.plan.heads:
            raise ValueError(
                f"shard='heads' lookups take ids [..., {self.plan.heads}] (every head's column); "
                f"got shape {shape}"
            )
        if not is_t:
            row_ids = np.asarray(row_ids)
        if not is_t or row_ids.device.type == "cpu" or self._check_ids():
            _check_range(row_ids, self.plan.head_rows, self.spec.name)
        a, b = self.plan.columns
        return row_ids[..., a:b].contiguous() if is_t else np.ascontiguousarray(
            row_ids[..., a:b]
        ), shape

    def _row_ids_out(self, shape: tuple) -> int:
        """Row ids per token a lookup of ids `shape` returns rows for (rows mode: any k, as
        Table.lookup takes)."""
        return shape[-1] if self.plan.mode == "rows" else self.out_heads

    def _check_ids(self) -> bool:
        return self.table is None or self.table.options.tuning.check_ids

    def _pump(self) -> None:
        """Issue, in order, the collectives of the oldest lookups whose rows are on their way."""
        with self._lock:
            while self._queue and self._queue[0].done():
                self._issue(self._queue.popleft(), None)

    def _issue_through(self, pending: ShardedPending, timeout: float | None) -> None:
        with self._lock:
            if self._broken and not pending._issued:
                raise RuntimeError(self._broken)
            while not pending._issued:
                self._issue(self._queue.popleft(), timeout)

    def _issue(self, p: ShardedPending, timeout: float | None) -> None:
        """p's rows, then (on this table's stream, after them) its collective, not waited for."""
        p._issued = True
        with self._out_of_step_on_error():
            if self._stream is not None and p._sync:  # (a prefetch's rows have their event)
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream) if self._stream else contextlib.nullcontext():
                rows = p._local.result(timeout) if p._local is not None else None
                p._buf = self._contribution(p, rows)
                if self._collect:
                    p._work = self._collective(p._buf)

    @contextlib.contextmanager
    def _out_of_step_on_error(self):
        """A lookup failing here issues no collective where its peers issue theirs: the table
        refuses every later lookup (see the module docstring)."""
        try:
            yield
        except BaseException as e:
            self._broken = (
                f"sharded table {self.spec.name} (rank {self.plan.rank}) is out of step with its "
                f"group after a failed lookup ({type(e).__name__}: {e}); close and reopen it"
            )
            raise

    def _contribution(self, p: ShardedPending, rows: torch.Tensor | None) -> torch.Tensor:
        """What this rank puts into the collective: rows: its rows (-0.0 elsewhere), [n, k*dim];
        heads: its columns' rows padded to `part` columns, [n, part*dim]."""
        dim, plan = self.dim, self.plan
        if plan.mode == "rows":
            if rows is None:  # an empty rank: every row another's
                shape = (*p._shape[:-1], p._shape[-1] * dim)
                return torch.full(shape, -0.0, dtype=torch.bfloat16, device=self.device)
            return negative_absent(rows, p.ids, plan.rows.start, plan.rows.end)
        width = (plan.part if self._collect else plan.local_heads) * dim
        have = plan.local_heads * dim
        if rows is not None and have == width:
            return rows.reshape(p._n, width)
        buf = torch.zeros((p._n, width), dtype=torch.bfloat16, device=self.device)
        if rows is not None:
            buf[:, :have] = rows.reshape(p._n, have)
        return buf

    def _collective(self, buf: torch.Tensor) -> Any:
        data = buf.to(self._comm) if buf.device != self._comm else buf  # gloo and a GPU table
        if self.plan.mode == "rows":
            return dist.all_reduce(data, group=self.group, async_op=True), data
        flat = data.reshape(-1).view(torch.uint8)
        recv = torch.empty(self.plan.world * flat.numel(), dtype=torch.uint8, device=self._comm)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return gather(recv, flat, group=self.group, async_op=True), recv

    def _finish(self, p: ShardedPending, timeout: float | None) -> torch.Tensor:
        """Wait for p's collective on the caller's stream (the host waits only for gloo) and lay
        out the rows: [..., out_heads * dim]."""
        plan, dim = self.plan, self.dim
        shape = (*p._shape[:-1], self._row_ids_out(p._shape) * dim)
        if not self._collect:
            data = p._buf[:, : plan.local_heads * dim] if plan.mode == "heads" else p._buf
        else:
            work, data = p._work
            _wait(work, timeout, self._comm)
        if self._stream is not None:  # the caller's stream: after ours (and the collective's)
            caller = torch.cuda.current_stream(self.device)
            caller.wait_stream(self._stream)
            for t in (data, p._buf):  # made or written on our stream, read on the caller's
                if t.is_cuda:
                    t.record_stream(caller)
        if not self._collect or plan.mode == "rows":
            return _into(p._out, data.view(torch.bfloat16).reshape(shape).to(self.device))
        width = plan.part * dim
        parts = data.view(torch.bfloat16).view(plan.world, p._n, width).to(self.device)
        rows = parts.permute(1, 0, 2).reshape(p._n, plan.world * width)  # [n, world * part * dim]
        return _into(p._out, rows[:, : plan.heads * dim].reshape(shape))


def _into(out: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    if out is None:
        return rows.contiguous()
    if out.data_ptr() != rows.data_ptr():
        out.copy_(rows)
    return out


def _wait(work: Any, timeout: float | None, device: torch.device) -> None:
    """NCCL: the caller's stream waits (the host does not). gloo: the host waits, at most
    `timeout` seconds when given."""
    if timeout is not None and device.type == "cpu":
        deadline = time.monotonic() + timeout
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the group's collective did not finish within {timeout} s")
            time.sleep(0.0005)
    work.wait()


def _check_range(ids: Any, bounds: list[tuple[int, int]], name: str) -> None:
    """Every id of column h in [bounds[h][0], bounds[h][1]); IndexError naming the first that
    is not (one device sync for device ids)."""
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"row ids must be integers, got {ids.dtype}")  # as Table's check
        lo = torch.tensor([b[0] for b in bounds], device=ids.device)
        hi = torch.tensor([b[1] for b in bounds], device=ids.device)
        bad = (ids < lo) | (ids >= hi)
        if not bool(bad.any()):
            return
        ids, bad = ids.cpu().numpy(), bad.cpu().numpy()
    else:
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise ValueError(f"row ids must be integers, got dtype {ids.dtype}")
        lo = np.array([b[0] for b in bounds], dtype=np.int64)
        hi = np.array([b[1] for b in bounds], dtype=np.int64)
        bad = (ids < lo) | (ids >= hi)
        if not bad.any():
            return
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    lo_h, hi_h = bounds[where[-1]]
    raise IndexError(
        f"row id {int(ids[where])} at position {where} is outside column {where[-1]}'s rows "
        f"[{lo_h}, {hi_h}) of table {name}"
    )


def _device(name: str | None) -> torch.device:
    """An empty rank's device (it opens no table): as `open_table` resolves it."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev
