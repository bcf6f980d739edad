"""Storage tiers: one interface (`Tier`), four implementations, and AUTO selection.

| tier   | where rows live                 | host footprint              | a cold row costs   |
|--------|---------------------------------|-----------------------------|--------------------|
| device | HBM (RAM on a CPU-only machine) | none                        | nothing (resident) |
| pinned | host DRAM, CUDA-registered      | the whole range, exactly    | nothing (resident) |
| mapped | the page cache, via mmap        | mapping Rss, held to budget | one 4 KiB fault    |
| direct | NVMe, O_DIRECT reads            | row cache + staging         | one block read     |
| cascade| device budget, pinned budget, file for the rest (tiers/cascade.py)                 |
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from plestore.io import unified
from plestore.io.memory import mem_available
from plestore.options import TableOptions
from plestore.tablefile import TableFile
from plestore.tiers.base import ReadStats, RowRange, Tier
from plestore.tiers.cascade import CascadeTier
from plestore.tiers.device import DeviceTier
from plestore.tiers.direct import DirectTier
from plestore.tiers.mapped import MappedTier
from plestore.tiers.pinned import PinnedTier

__all__ = ["TIERS", "ReadStats", "RowRange", "Tier", "TierChoice", "choose_tier", "make_tier"]

log = logging.getLogger("plestore")

TIERS: dict[str, type[Tier]] = {
    t.name: t for t in (DeviceTier, PinnedTier, MappedTier, DirectTier, CascadeTier)
}
_HEADROOM = 8 << 30  # leave this much MemAvailable after pinning a table


@dataclass(frozen=True)
class TierChoice:
    name: str
    reason: str


def choose_tier(
    table: TableFile, row_range: RowRange, device: torch.device, options: TableOptions
) -> TierChoice:
    """AUTO: the fastest tier that fits. Pinned DRAM when the range fits with headroom, else
    direct reads (O_DIRECT works here), else the page cache (mapped). On a unified-memory GPU
    (DGX Spark, GH200: io/unified.py) one that leaves the GPU's memory alone."""
    need = row_range.rows * table.layout.row_bytes
    on_unified = unified.unified_choice(
        unified.memory_of(device), options.tier, need, lambda: _direct_ok(table), options.share
    )
    if on_unified is not None:
        return TierChoice(*on_unified)
    if options.tier != "auto":
        return TierChoice(options.tier, "requested")
    avail = mem_available()
    if need + _HEADROOM <= avail:
        return TierChoice(
            "pinned",
            f"{need / 2**30:.2f} GiB fits in {avail / 2**30:.1f} GiB available host memory",
        )
    if device.type == "cuda":  # HBM first, then what DRAM holds, the file for the rest
        return TierChoice(
            "cascade",
            f"{need / 2**30:.1f} GiB exceeds available host memory ({avail / 2**30:.1f} GiB) "
            f"less {_HEADROOM >> 30} GiB headroom: device -> pinned -> file budgets",
        )
    from plestore.io.probe import o_direct_alignment

    try:
        o_direct_alignment(table.data_path)
    except OSError as e:
        log.warning(
            "plestore: %s does not fit in host memory and O_DIRECT is unavailable (%s); "
            "serving it through the page cache (tier=mapped)",
            table.name,
            e,
        )
        return TierChoice("mapped", f"too large for DRAM ({need / 2**30:.1f} GiB); no O_DIRECT")
    return TierChoice(
        "direct",
        f"{need / 2**30:.1f} GiB exceeds available host memory "
        f"({avail / 2**30:.1f} GiB) less {_HEADROOM >> 30} GiB headroom",
    )


def _direct_ok(table: TableFile) -> bool:
    from plestore.io.odirect import o_direct_alignment

    try:
        o_direct_alignment(table.data_path)
    except OSError:
        return False
    return True


def make_tier(
    name: str, table: TableFile, row_range: RowRange, device: torch.device, options: TableOptions
) -> Tier:
    if name not in TIERS:
        raise ValueError(f"unknown tier {name!r}; tiers: {', '.join(TIERS)}")
    if options.share == "node" and name not in ("pinned", "mapped"):
        raise ValueError(
            f"share='node' shares a host copy: the pinned tier's (the mapped tier shares the "
            f"page cache anyway); the {name} tier holds none to share"
        )
    return TIERS[name](table, row_range, device, options)
