"""Unified-memory GPUs (DGX Spark's GB10, GH200): the GPU and the host draw on one pool of memory,
so the pinned and device tiers (and a cascade's budgets) take their table out of the memory the
model runs in, and a page-cache-backed mapping grows into it unless trimmed. The device is probed
once (integrated, pageable memory read through the host's page tables); AUTO then picks a tier
that leaves the pool alone, and an explicit pinned or device tier is warned about.

    memory_of(device)                           -> MemoryKind, or None (not a CUDA device)
    unified_choice(kind, tier, need, direct_ok, share) -> (tier, reason), or None: as elsewhere
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from plestore.io.probe import capabilities

__all__ = ["POOL_TIERS", "MemoryKind", "memory_of", "unified_choice"]

log = logging.getLogger("plestore")

#: the tiers whose rows sit in memory the GPU's pool gives (pinned host memory, HBM)
POOL_TIERS = ("pinned", "device", "cascade")


@dataclass(frozen=True)
class MemoryKind:
    """What the probe found about a GPU's memory."""

    name: str  # the device's name, for messages
    integrated: bool  # no memory of its own (DGX Spark's GB10)
    pageable_memory_access: bool  # reads pageable host memory (mmap'd files too)
    host_page_tables: bool  # ... through the host's page tables: one coherent pool (GH200)

    @property
    def unified(self) -> bool:
        return self.integrated or self.host_page_tables

    def describe(self) -> str:
        what = "an integrated GPU" if self.integrated else "a GPU coherent with host memory"
        return f"{self.name} is {what}: it and the host share one memory pool"


def memory_of(device: torch.device) -> MemoryKind | None:
    """The probe's answer for a CUDA `device` (cached per device), None for any other."""
    if device.type != "cuda":
        return None
    caps = capabilities(torch.cuda.current_device() if device.index is None else device.index)
    return MemoryKind(
        caps.device_name,
        caps.integrated,
        caps.pageable_memory_access,
        caps.pageable_uses_host_page_tables,
    )


def unified_choice(
    kind: MemoryKind | None, tier: str, need: int, direct_ok: Callable[[], bool], share: str
) -> tuple[str, str] | None:
    """(tier, reason) for a table of `need` bytes on a unified-memory part, or None where the
    usual choice stands (no such part, or mapped / direct asked for). AUTO: direct — a small row
    cache beside O_DIRECT reads, no page cache — where the file takes O_DIRECT and no host copy
    is shared, else mapped held to its resident budget; pinned, device or cascade asked for:
    kept, with a warning naming direct."""
    if kind is None or not kind.unified or tier in ("mapped", "direct"):
        return None
    gib = f"{need / 2**30:.2f} GiB"
    if tier != "auto":
        why = (
            f"{kind.describe()}, so tier={tier} takes the table's {gib} out of the GPU's own "
            "memory; tier='direct' leaves it alone (a row cache of cache_bytes)"
        )
        log.warning("plestore: %s", why)
        return tier, f"requested; {why}"
    # measured: RESULTS.md "footprint" (direct 8.00 KiB from disk a decode token, mapped 63.8)
    if share == "none" and direct_ok():
        return "direct", (
            f"{kind.describe()}: direct reads keep the {gib} table out of it but for the row "
            "cache (cache_bytes), where pinned or device would take all of it"
        )
    why = "share='node' shares the page cache" if share != "none" else "no O_DIRECT on its file"
    return "mapped", (
        f"{kind.describe()}: mapped ({why}), its resident set held to rss_budget_bytes, keeps "
        f"the {gib} table out of it but for that budget"
    )
