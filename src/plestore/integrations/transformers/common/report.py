"""`OffloadReport`: what moved where when a model's per-layer tables went to plestore."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from plestore.integrations.transformers.common.table import PLAIN, PreparedTable
from plestore.lookup import Table

__all__ = ["OffloadReport", "merge_reports", "report_for"]


@dataclass
class OffloadReport:
    """What moved where. Byte counts are exact sizes, not estimates."""

    module: str  # dotted path of the replaced module (Qwen4Exp: of each, comma-separated)
    model: str  # "Gemma 3n" | "Gemma 4" | "Qwen4Exp", and whether multimodal
    rows: int  # vocab_size_per_layer_input (Qwen4Exp: rows of all tables)
    dim: int  # num_hidden_layers * hidden_size_per_layer_input (Qwen4Exp: head_dim)
    source_dtype: str  # dtype of the weight (or checkpoint tensor) the rows came from
    format: str  # row format of the table
    exact: bool  # outputs bit-identical to the original module (bf16 table, exact values)
    table_path: str  # the table's metadata file
    table_bytes: int  # the table's data region on disk
    reused: bool  # an existing table with this fingerprint was reused (nothing packed)
    packed_from: dict  # where the rows were read when packed
    fingerprint: str
    tier: str  # device | pinned | mapped | direct
    tier_reason: str  # why (AUTO says what fit), or "requested"
    device: str  # where lookups deliver rows (the model's device)
    weight_bytes: int  # bytes of the original weight
    freed_bytes: int  # bytes released from `freed_from` (0: never materialised)
    freed_from: str  # device the weight was released from ("" if it never existed)
    table_device_bytes: int  # bytes the table itself keeps on `device` (tier=device on a GPU)
    device_allocated_before: int | None = None  # torch.cuda.memory_allocated around the swap
    device_allocated_after: int | None = None
    pack_seconds: float = 0.0
    seconds: float = 0.0
    layers: list = field(default_factory=list)  # Qwen4Exp: one report dict per PLE table

    @property
    def bytes_off_device(self) -> int:
        """Bytes that left the model's device for good (freed minus what the table keeps)."""
        return self.freed_bytes - self.table_device_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "bytes_off_device": self.bytes_off_device}

    def __str__(self) -> str:
        how = "reused" if self.reused else f"packed from {self.packed_from.get('kind', '?')}"
        freed = (
            f"freed {self.freed_bytes / 2**20:.1f} MiB on {self.freed_from}"
            if self.freed_from
            else "never materialised"
        )
        return (
            f"{self.model} {self.module} [{self.rows}, {self.dim}] {self.source_dtype} -> "
            f"{self.format} table {self.table_path} ({how}); tier {self.tier} on {self.device} "
            f"({self.tier_reason}); {freed}; exact={self.exact}"
        )


def report_for(
    site: Any,  # a Gemma PleSite or a Qwen QwenSite
    prepared: PreparedTable,
    table: Table,
    source_dtype: torch.dtype,
    **extra: Any,
) -> OffloadReport:
    spec = table.spec
    return OffloadReport(
        module=site.path,
        model=site.family_name + (" (multimodal)" if site.multimodal else " (text)"),
        rows=spec.rows,
        dim=spec.dim,
        source_dtype=str(source_dtype).removeprefix("torch."),
        format=spec.format,
        # plain formats: packing refuses to round; fp8 at scale 1.0: the values were e4m3
        exact=spec.format in PLAIN or bool(prepared.file.source.get("exact")),
        table_path=str(prepared.file.meta_path),
        table_bytes=prepared.file.data_bytes,
        reused=prepared.reused,
        packed_from=prepared.origin,
        fingerprint=prepared.fingerprint,
        tier=table.tier.name,
        tier_reason=table.tier_choice.reason,
        device=str(table.device),
        weight_bytes=spec.rows * spec.dim * torch.empty((), dtype=source_dtype).element_size(),
        table_device_bytes=table.tier.device_bytes() if hasattr(table.tier, "device_bytes") else 0,
        pack_seconds=0.0 if prepared.reused else prepared.seconds,
        **extra,
    )


def merge_reports(
    parts: list[OffloadReport], before: int | None, after: int | None, seconds: float
) -> OffloadReport:
    """One report for several tables (Qwen4Exp's PLE layers): sums, joined names, all parts."""
    first = parts[0]
    return OffloadReport(
        module=", ".join(p.module for p in parts),
        model=first.model,
        rows=sum(p.rows for p in parts),
        dim=first.dim,
        source_dtype=first.source_dtype,
        format=first.format,
        exact=all(p.exact for p in parts),
        table_path=", ".join(p.table_path for p in parts),
        table_bytes=sum(p.table_bytes for p in parts),
        reused=all(p.reused for p in parts),
        packed_from=first.packed_from,
        fingerprint=", ".join(p.fingerprint for p in parts),
        tier=first.tier,
        tier_reason=first.tier_reason,
        device=first.device,
        weight_bytes=sum(p.weight_bytes for p in parts),
        freed_bytes=sum(p.freed_bytes for p in parts),
        freed_from=first.freed_from,
        table_device_bytes=sum(p.table_device_bytes for p in parts),
        device_allocated_before=before,
        device_allocated_after=after,
        pack_seconds=sum(p.pack_seconds for p in parts),
        seconds=seconds,
        layers=[p.to_dict() for p in parts],
    )
