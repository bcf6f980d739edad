"""`ShardedTable.staged`: a fixed-shape lookup over the group whose GPU half a CUDA graph can
capture (see `plestore.lookup.staged`), rows mode:

    stage(ids)  every rank checks every id (as its lookups do); this rank stages its own rows
    decode()    this rank's rows into `out`, -0.0 for the others' (an empty rank: all -0.0),
                then one float all-reduce of out on the caller's stream (exact: -0.0 is the
                sum's identity, lookup/ranksum.py)

A decode step's collective then lives inside the step (NCCL collectives can be captured; gloo
steps run eagerly). Collectives pair up by order: before its own, a staged lookup issues those of
the group lookups started earlier (stage(), or decode() outside a capture), so every rank issues
them in the same order whatever path each rank's rows take.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from plestore.lookup.ranksum import negative_absent

if TYPE_CHECKING:
    from plestore.distributed.sharded import ShardedTable

__all__ = ["ShardedStaged"]


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
        #: which rows are another rank's (-0.0): the device ids given, else stage()'s, copied
        #: from a pinned buffer by decode() (so a captured decode reads each step's)
        self._ids, self._ids_host = ids, None
        if ids is None and self._local is not None:
            cuda = owner.device.type == "cuda"
            self._ids_host = torch.zeros(self.shape, dtype=torch.int64, pin_memory=cuda)
            self._ids = torch.zeros(self.shape, dtype=torch.int64, device=owner.device)

    def stage(self, row_ids: Any, label: str = "decode") -> None:
        """Host half: ids [..., k] of this lookup's shape, checked on every rank alike."""
        owner = self.owner
        ids, shape = owner._validate(row_ids)
        if tuple(shape) != self.shape:
            raise ValueError(f"row ids of shape {self.shape} expected, got {tuple(shape)}")
        self._flush()
        if self._local is not None:
            self._local.stage(ids, label=label)
            if self._ids_host is not None:
                self._ids_host.copy_(torch.as_tensor(ids).reshape(self.shape))

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
        plan = self.owner.plan
        if self._local is None:
            self.out.fill_(-0.0)  # every row another rank's
        else:
            self._local.decode()
            if self._ids_host is not None:
                self._ids.copy_(self._ids_host, non_blocking=True)
            negative_absent(self.out, self._ids, plan.rows.start, plan.rows.end)
        if plan.world > 1:
            comm = self.owner._comm
            data = self.out if self.out.device == comm else self.out.to(comm)  # gloo
            dist.all_reduce(data, group=self.owner.group)
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
