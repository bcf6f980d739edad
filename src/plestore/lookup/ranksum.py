"""A rank's part of a row-sharded (vocab-parallel) lookup, made for a float sum over the ranks.

Each row id lives in exactly one rank's row range. Every other rank's part holds -0.0 for it,
never +0.0: -0.0 is the identity of IEEE addition (x + -0.0 is x for every x, -0.0 and +0.0
included), so any float all-reduce or reduce-scatter of the parts — gloo, NCCL, an engine's own
custom all-reduce, any rank count, order or accumulator width — gives each value its owner's
bits. A +0.0 part would turn a stored -0.0 into +0.0. Only a NaN's payload is the
communicator's: it stays a NaN (gloo and CUDA canonicalise it, as they do in an engine's stock
embedding). tests/test_ranksum.py checks every bf16 and fp16 pattern through gloo groups.

This is the one sum plestore's sharded rows take: `distributed/` (open_sharded's rows mode) and
the engine plugins (whose parts the engine's own collective sums) alike.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["negative_absent"]


def negative_absent(rows: torch.Tensor, ids: Any, start: int, end: int) -> torch.Tensor:
    """rows [..., k * dim] of ids [..., k]: the rows of ids outside [start, end) set to -0.0, in
    place. Device ops of fixed shapes: a captured step does it on every replay."""
    if isinstance(ids, np.ndarray):
        ids = torch.from_numpy(ids)
    ids = ids.to(rows.device, non_blocking=True)
    absent = (ids < start) | (ids >= end)  # [..., k]
    rows.view(*absent.shape, -1).masked_fill_(absent.unsqueeze(-1), -0.0)
    return rows
