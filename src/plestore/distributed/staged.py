"""`ShardedTable.staged`: a fixed-shape lookup over the group whose GPU half a CUDA graph can
capture (see `plestore.lookup.staged`), rows mode:

    stage(ids)  every rank checks every id (as its lookups do); this rank stages its own rows
    decode()    this rank's rows into `out`, zeros for the others' (an empty rank: all zeros),
                then one all-reduce of out's bit patterns as integers on the caller's stream
                (exact for every bf16 pattern: see `plestore.distributed.sharded`)

A decode step's collective then lives inside the step (NCCL collectives can be captured; gloo
steps run eagerly). Collectives pair up by order: before its own, a staged lookup issues those of
the group lookups started earlier (stage(), or decode() outside a capture), so every rank issues
them in the same order whatever path each rank's rows take.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from plestore.distributed.sharded import ShardedTable

__all__ = ["ShardedStaged", "sum_bits"]


def sum_bits(data: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    """All-reduce `data`'s bytes summed as int32 words where they are whole (else as bytes):
    each row is one rank's and zeros elsewhere, so the sum is its bit pattern (a float sum
    would turn a stored -0.0 into +0.0)."""
    flat = data.reshape(-1).view(torch.uint8)
    whole = flat.numel() % 4 == 0 and flat.data_ptr() % 4 == 0
    words = flat.view(torch.int32) if whole else flat
    return dist.all_reduce(words, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


class ShardedStaged:
    """Lookups of row ids of one shape [..., k] into a fixed bf16 `out` [..., k * dim], summed
    over the group."""

    def __init__(
        self,
        owner: ShardedTable,
        shape: tuple[int, ...],
        out: torch.Tensor | None = None,
        ids: torch.Tensor | None = None,
    ) -> None:
        if owner.plan.mode != "rows":
            raise ValueError(
                "staged lookups over a group are rows-sharded (one all-reduce into fixed "
                "addresses); open the table with shard='rows', or use prefetch / lookup_into"
            )
        self.owner, self.shape = owner, tuple(shape)
        full = (*self.shape[:-1], self.shape[-1] * owner.dim)
        local = owner.table
        self._local = None if local is None else local.staged(self.shape, out=out, ids=ids)
        if self._local is not None:
            out = self._local.out
        elif out is None:
            out = torch.zeros(full, dtype=torch.bfloat16, device=owner.device)
        if tuple(out.shape) != full:
            raise ValueError(f"out must be a contiguous {full} tensor, got {tuple(out.shape)}")
        self.out = out
        # an empty rank reads nothing: it never needs the ids on the host
        self.needs_stage = self._local is not None and self._local.needs_stage

    def stage(self, row_ids: Any, label: str = "decode") -> None:
        """Host half: ids [..., k] of this lookup's shape, checked on every rank alike."""
        owner = self.owner
        ids, shape = owner._validate(row_ids)
        if tuple(shape) != self.shape:
            raise ValueError(f"row ids of shape {self.shape} expected, got {tuple(shape)}")
        self._flush()
        if self._local is not None:
            self._local.stage(ids, label=label)

    def replayed(self, label: str = "decode", t0: float | None = None) -> None:
        if self._local is not None:
            self._local.replayed(label, t0)

    def decode(self) -> torch.Tensor:
        """GPU half (capturable with NCCL): every rank's rows in `out`."""
        if not (self.out.is_cuda and torch.cuda.is_current_stream_capturing()):
            self._flush()
        elif not self.owner.graph_capturable:
            raise RuntimeError(
                f"a {dist.get_backend(self.owner.group)} collective cannot be captured in a "
                "CUDA graph (NCCL's can): run the steps eagerly (DecoderConfig(cuda_graphs=False))"
            )
        if self._local is not None:
            self._local.decode()
        else:
            self.out.zero_()
        if self.owner.plan.world > 1:
            comm = self.owner._comm
            data = self.out if self.out.device == comm else self.out.to(comm)  # gloo
            sum_bits(data, self.owner.group)
            if data is not self.out:
                self.out.copy_(data)
        return self.out

    def close(self) -> None:
        """Free this rank's staging (as `StagedLookup.close`)."""
        if self._local is not None:
            self._local.close()

    def _flush(self) -> None:
        """Issue the collectives of the group lookups started before this one."""
        owner = self.owner
        with owner._lock:
            if owner._queue:
                owner._issue_through(owner._queue[-1], None)
