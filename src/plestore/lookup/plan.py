"""A lookup, planned once: its rows, where they come from, where the host work runs and on
which stream the GPU work goes. `Executor` (lookup/executor.py) runs every plan.

    source  device   the kernel reads the tier where it lives (HBM, or pinned memory by UVA)
            staging  the tier reads the rows into pinned staging, one kernel decodes them
            cache    the GPU row cache serves its hits; the tier reads the misses into staging
    where   now      the caller's thread, at once (lookup: waited for)
            caller   the caller's thread at result(), or a step early at run_now()
            worker   the table's worker thread
    stream  the caller's current one, or the table's (`side`: a prefetch's device read, a
            worker's job, a lookup run ahead), ordered by events

Staged rows reach the GPU copied first, or read in place by the kernel (`copies`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from plestore import native

if TYPE_CHECKING:
    from plestore.lookup.table import Table

__all__ = [
    "AHEAD_GPU_MAX_IDS",
    "GPU_GATHER_MAX_IDS",
    "UVA_MAX_BYTES",
    "Plan",
    "choose_source",
    "copies",
    "output_buffer",
    "plan_lookup",
    "this_ranks",
    "validate_ids",
]

#: pinned, gather=auto: the GPU reads lookups of at most this many ids from pinned memory; the
#: host gathers larger ones. measured: RESULTS.md "lookup: GPU vs host gather"
GPU_GATHER_MAX_IDS = 16384
#: pinned, gather=auto: a lookup run a step ahead is host-gathered past this many ids (beside
#: the step). measured: RESULTS.md "e2e: pinned gather, host or GPU"
AHEAD_GPU_MAX_IDS = 4096
#: caller-thread lookups staging at most this many bytes let the kernel read them from pinned
#: memory (one launch); larger ones, and every lookup on the table's stream, are copied first
UVA_MAX_BYTES = 256 << 10


@dataclass(slots=True, eq=False)
class Plan:
    """One lookup (see the module docstring)."""

    ids: Any  # int64 [n]: numpy for the host sources; numpy or a tensor for a device read
    out: torch.Tensor  # [n, dim] of the table's dtype
    shape: tuple  # what the caller gets: [..., k * dim]
    label: str
    source: str  # device | staging | cache
    where: str  # now | caller | worker
    side: bool = False  # the GPU work goes on the table's stream
    own: bool = False  # out was made here, on the table's stream (the consumer's use recorded)
    consumer: Any = None  # an event at prefetch on the caller's stream: out is free from there
    stream: Any = None  # where: caller, the caller's stream at prefetch (result() follows it)
    io0: int | None = None  # the disk mark from where this lookup's reads may have started


def choose_source(table: Table, n: int, staged: bool = False, ahead: bool = False) -> str:
    """device (the GPU reads the tier), cache (through the GPU row cache) or staging, per
    options: gather=auto reads on the device up to GPU_GATHER_MAX_IDS ids, except a staged
    lookup (the captured kernel then reads contiguous staging, not scattered rows over PCIe)
    and a lookup run a step ahead past AHEAD_GPU_MAX_IDS ids (the copy engine leaves the SMs to
    the step it runs beside). measured: RESULTS.md "e2e: pinned gather, host or GPU"."""
    tier = table.tier
    if not tier.can_read_host:
        return "device"
    if table.gpu_cache is not None:
        return "cache"
    if not tier.can_read_device:
        return "staging"
    gather = table.options.tuning.gather
    near = not (staged or (ahead and n > AHEAD_GPU_MAX_IDS))
    if gather == "gpu" or (gather == "auto" and near and n <= GPU_GATHER_MAX_IDS):
        return "device"
    return "staging"


def copies(cuda: bool, side: bool, nbytes: int) -> bool:
    """Whether staged rows are copied to the device before the kernel reads them: on the
    table's stream always, in the caller's thread past UVA_MAX_BYTES (a kernel reading much
    pinned memory is slower than a copy and a decode: RESULTS.md "host time, part by part")."""
    return cuda and (side or nbytes > UVA_MAX_BYTES)


def plan_lookup(
    table: Table,
    stream: Any,
    row_ids: Any,
    out: torch.Tensor | None,
    label: str,
    sync: bool,
    defer: bool = False,
    timeout: float | None = None,
) -> Plan:
    """sync: the caller waits right away (lookup), so nothing overlaps the host work: it runs
    in the caller's thread at any size — on the worker only where a timeout bounds a storage
    tier's lookup of more than `inline_ids` ids (a memory copy cannot hang; a hung read then
    holds the worker, not the caller); the handoff, the worker's stream and event cost a large
    warm lookup (RESULTS.md "host time, part by part"). defer: see Table.prefetch. Worker and
    deferred lookups may put their GPU work on the table's stream: a buffer of ours is made
    there, so that work need not wait for what the caller queued meanwhile (a step run ahead
    would wait for the whole step); a caller's buffer is waited for by an event. stream: the
    table's."""
    ids, shape = validate_ids(table, row_ids)
    n = ids.numel() if isinstance(ids, torch.Tensor) else ids.size
    source = choose_source(table, n, ahead=defer)
    cuda = table.device.type == "cuda"
    if source == "device":
        side = cuda and not sync
        out = output_buffer(table, shape, out)
        return Plan(ids, out, shape, label, source, "now", side=side)
    ids = ids.cpu().numpy() if isinstance(ids, torch.Tensor) else ids
    bounded = table.tier.reads_storage and (
        timeout is not None or table.options.timeout_s is not None
    )
    inline = defer or n <= table.options.tuning.inline_ids or (sync and not bounded)
    side = cuda and (defer or not inline)
    own = side and out is None
    out = output_buffer(table, shape, out, stream if own else None)
    plan = Plan(ids, out, shape, label, source, "worker", side=side, own=own)
    if side and not own:
        plan.consumer = torch.cuda.Event()
        plan.consumer.record(torch.cuda.current_stream(table.device))
    if inline:
        plan.where = "now" if sync else "caller"
    if plan.where == "caller" and cuda:
        plan.stream = torch.cuda.current_stream(table.device)
    return plan


def validate_ids(table: Table, row_ids: Any) -> tuple[Any, tuple]:
    """Flat int64 ids (numpy, or a tensor on the table's device) and the output shape; ids
    outside the table raise IndexError naming the first (device ids: one sync, unless
    check_ids is off)."""
    if isinstance(row_ids, torch.Tensor):
        if row_ids.is_floating_point() or row_ids.is_complex() or row_ids.dtype == torch.bool:
            raise ValueError(f"row ids must be integers, got {row_ids.dtype}")
        if row_ids.device.type not in ("cpu", table.device.type):
            raise ValueError(f"row ids must be on the cpu or {table.device}, got {row_ids.device}")
        ids = row_ids.reshape(-1).to(torch.int64).contiguous()  # (a strided 1-D view stays one)
        shape = tuple(row_ids.shape)
    else:
        arr = np.asarray(row_ids)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"row ids must be integers, got dtype {arr.dtype}")
        ids = np.ascontiguousarray(arr.reshape(-1), dtype=np.int64)  # the host core's layout
        shape = arr.shape
    if len(shape) == 0:
        raise ValueError("row ids must have at least one dimension ([..., k])")
    out_shape = (*shape[:-1], shape[-1] * table.dim)
    rows = table.spec.rows
    if not (ids.numel() if isinstance(ids, torch.Tensor) else ids.size):
        return ids, out_shape
    if isinstance(ids, torch.Tensor):
        if ids.device.type != "cpu" and not table.options.tuning.check_ids:
            return ids, out_shape
        lo, hi = torch.stack(torch.aminmax(ids)).tolist()  # one sync for device ids
        bad = lo < 0 or hi >= rows
    else:
        bad = native.load(table.options.tuning.native).check_ids(ids, rows) >= 0  # one pass
    if bad:
        flat = ids.cpu().numpy() if isinstance(ids, torch.Tensor) else ids
        at = int(np.flatnonzero((flat < 0) | (flat >= rows))[0])
        where = tuple(int(i) for i in np.unravel_index(at, shape))
        raise IndexError(
            f"row id {int(flat[at])} at position {where} is outside table {table.spec.name} "
            f"[0, {rows})"
        )
    return ids, out_shape


def output_buffer(
    table: Table, shape: tuple, out: torch.Tensor | None, stream: Any = None
) -> torch.Tensor:
    """A lookup's [n, dim] rows (the table's dtype): the caller's `out` checked, or a new
    tensor (made on `stream` when given: the stream that writes it)."""
    n = math.prod(shape) // table.dim if shape else 0  # (np.prod: more a call)
    if out is None:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            return torch.empty((n, table.dim), dtype=table.dtype, device=table.device)
    if out.dtype != table.dtype or out.device != table.device:
        raise ValueError(
            f"out must be {_short(table.dtype)} on {table.device}, got {_short(out.dtype)} on "
            f"{out.device}"
        )
    if tuple(out.shape) != shape or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous tensor of shape {shape}, got {tuple(out.shape)}"
        )
    return out.view(n, table.dim)


def _short(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )


def this_ranks(table: Table, ids: np.ndarray) -> np.ndarray:
    """The ids of this rank's rows (all of them when it holds the table whole)."""
    if table.row_range.rows == table.spec.rows:
        return ids
    return ids[table.row_range.holds(ids)]
