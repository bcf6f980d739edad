"""`offload_per_layer_embeddings(model, table_dir)`: move a loaded Gemma 3n / Gemma 4 model's
per-layer embedding into a plestore table and serve it from there.

    validate (architecture, format, device, options, table dir)   nothing modified yet
    table: reuse the one in table_dir if its fingerprint matches, else pack it (from the
           checkpoint the model was loaded from when its rows equal the weight's, else from
           the weight itself, 64 MiB at a time)
    open the table on its tier                                     still nothing modified
    swap the module, drop the weight, empty the CUDA cache         the only mutation
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import plestore
from plestore.formats import get_format
from plestore.integrations.transformers.arch import PleSite, find_site
from plestore.integrations.transformers.module import PerLayerEmbedding
from plestore.integrations.transformers.source import (
    CheckpointSource,
    RowSource,
    WeightSource,
    find_checkpoint_tensor,
    local_checkpoint_dir,
)
from plestore.integrations.transformers.table import (
    PreparedTable,
    check_table_dir,
    prepare_table,
    table_spec,
)
from plestore.lookup.table import Table, _resolve_device
from plestore.options import TableOptions

__all__ = ["OffloadReport", "offload_per_layer_embeddings"]

log = logging.getLogger("plestore")


@dataclass
class OffloadReport:
    """What moved where. Byte counts are exact sizes, not estimates."""

    module: str  # dotted path of the replaced module
    model: str  # "Gemma 3n" | "Gemma 4", and whether multimodal
    rows: int  # vocab_size_per_layer_input
    dim: int  # num_hidden_layers * hidden_size_per_layer_input
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


def _resolve(device: Any) -> torch.device:
    try:
        return _resolve_device(None if device is None else str(torch.device(device)))
    except RuntimeError as e:  # torch.device("nonsense")
        raise ValueError(str(e)) from None


def _options(tier: str, device: torch.device, site: PleSite, table_options: dict) -> dict:
    """Table options, validated now (before anything is packed or modified)."""
    opts = dict(table_options)
    # Gemma 3n remaps ids into range itself: skip the range check (a GPU sync per lookup)
    opts.setdefault("check_ids", site.out_of_range != "zero")
    TableOptions.from_env(tier=tier, device=str(device), **opts)
    return opts


def open_for(
    prepared: PreparedTable, tier: str, device: torch.device, opts: dict
) -> tuple[Table, float]:
    t0 = time.perf_counter()
    table = plestore.open_table(str(prepared.file.meta_path), tier=tier, device=str(device), **opts)
    return table, time.perf_counter() - t0


def make_module(table: Table, site: PleSite, embed_scale: torch.Tensor, dtype, device):
    m = site.module
    return PerLayerEmbedding(
        table,
        embed_scale=embed_scale,
        scalar_embed_scale=getattr(m, "scalar_embed_scale", float(embed_scale)),
        dtype=dtype,
        padding_idx=m.padding_idx,
        out_of_range=site.out_of_range,
        device=device,
    )


def report_for(
    site: PleSite,
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
        exact=spec.format == "bf16",
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


def offload_per_layer_embeddings(
    model: nn.Module,
    table_dir: str | Path,
    tier: str = "auto",
    format: str = "bf16",
    device: str | torch.device | None = None,
    **table_options: Any,
) -> OffloadReport:
    """Serve `model`'s per-layer embedding (Gemma 3n / Gemma 4, text-only or multimodal) from a
    plestore table in `table_dir` and free the weight. Returns what moved (`OffloadReport`).

    tier: auto | device | pinned | mapped | direct (auto: pinned DRAM if it fits, else direct).
    format: bf16 (exact, the default) or a lossy fp8_e4m3 / nvfp4 (opt-in).
    device: where rows are delivered (default: the weight's device).
    table_options: any plestore TableOptions field (threads, cache_bytes, ...).

    Everything is validated and the table packed (or reused) and opened before the model is
    touched: on any error the model is left as it was.
    """
    t0 = time.perf_counter()
    site = find_site(model)
    fmt = get_format(format).name
    weight = site.module.weight
    dev = _resolve(weight.device if device is None else device)
    opts = _options(tier, dev, site, table_options)
    spec = table_spec(site, model.config, fmt)
    check_table_dir(table_dir, spec)

    ck_dir = local_checkpoint_dir(model)
    ck = find_checkpoint_tensor(ck_dir) if ck_dir else None
    if ck is not None and ck.shape == (site.rows, site.dim):
        source: RowSource = CheckpointSource(ck, dtype=weight.dtype)  # checked against weight
    else:
        source = WeightSource(weight, site.path)
    prepared = prepare_table(table_dir, spec, site, source, live=weight)
    del source
    table, _ = open_for(prepared, tier, dev, opts)

    # -- from here on the model changes; nothing below can fail on bad input ------------------
    old = site.module
    new = make_module(table, site, old.embed_scale, weight.dtype, old.embed_scale.device)
    on_cuda = weight.device.type == "cuda"
    before = torch.cuda.memory_allocated(weight.device) if on_cuda else None
    freed_from, freed = str(weight.device), weight.numel() * weight.element_size()
    source_dtype = weight.dtype
    setattr(site.parent, site.attr, new)
    old.weight = None  # the Parameter's last reference (unless the caller holds one)
    del weight
    if on_cuda:
        torch.cuda.empty_cache()
    after = torch.cuda.memory_allocated(torch.device(freed_from)) if on_cuda else None
    report = report_for(
        site,
        prepared,
        table,
        source_dtype,
        freed_bytes=freed,
        freed_from=freed_from,
        device_allocated_before=before,
        device_allocated_after=after,
        seconds=time.perf_counter() - t0,
    )
    log.info("plestore: %s", report)
    return report
