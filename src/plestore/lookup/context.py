"""`TableContext`: what the lookup's modules take from an opened table, in one frozen object.

`Table` (lookup/table.py) makes it once, when it has opened its tier and GPU row cache, and
hands it, instead of itself, to what carries its lookups out: `plan.py`, `executor.py` (and
through it `routes.py`, `pending.py`, `staged.py`), `graphfeed.py`, `hostplan.py`. They read
their needs here, by these names. Nothing it holds is replaced while the table is open: the
tier, the metrics and the GPU row cache are live objects (their state changes, the references
do not).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from plestore.formats import RowFormat
    from plestore.lookup.gpucache import GpuRowCache
    from plestore.lookup.metrics import Metrics
    from plestore.options import Tuning
    from plestore.tiers import RowRange, Tier

__all__ = ["TableContext"]


@dataclass(frozen=True, eq=False)
class TableContext:
    """One opened table as its lookups see it (the module docstring)."""

    name: str  # the table's name (errors, logs, thread names)
    rows: int  # the table's rows: ids are checked against [0, rows)
    dim: int  # values per row
    format: RowFormat  # how a row's packed bytes decode
    scale: float  # the table's scale (the format's decode takes it)
    dtype: torch.dtype  # what lookups deliver: bf16, or fp16 / fp32 rows
    device: torch.device  # where rows are delivered
    row_range: RowRange  # this rank's rows; others' ids come out zeros, never read
    tuning: Tuning  # gather, inline_ids, check_ids, ...
    timeout_s: float | None  # the table's bound on a storage read's wait, or None
    core: ModuleType  # the host core: the compiled one, or its numpy reference
    tier: Tier  # live: reads the rows
    metrics: Metrics  # live: the table's counters
    gpu_cache: GpuRowCache | None  # live: the GPU row cache in front of the tier, or None
    cuda: bool = field(init=False)  # rows are delivered on a CUDA device
    whole: bool = field(init=False)  # this rank holds every row: no id is another rank's
    #: the GPU reads the rows where the tier keeps them (HBM, or pinned memory through UVA),
    #: not behind a GPU row cache (`Table.device_readable`)
    device_readable: bool = field(init=False)

    def __post_init__(self) -> None:
        derived: dict[str, Any] = {
            "cuda": self.device.type == "cuda",
            "whole": self.row_range.rows == self.rows,
            "device_readable": self.tier.can_read_device and self.gpu_cache is None,
        }
        for name, value in derived.items():  # (frozen: set once, here)
            object.__setattr__(self, name, value)
