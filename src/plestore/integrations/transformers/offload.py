"""`offload_per_layer_embeddings(model, table_dir)`: move a loaded model's per-layer embedding
tables — Gemma 3n / Gemma 4's `embed_tokens_per_layer`, Qwen4Exp's PLE n-gram tables (one per
PLE layer) — into plestore tables and serve them from there.

    validate (architecture, format, device, options, table dir)   nothing modified yet
    tables: reuse the one in table_dir if its fingerprint matches, else pack it (from the
           checkpoint the model was loaded from when its rows equal the weight's, else from
           the weight itself, 64 MiB at a time)
    open the tables on their tier                                  still nothing modified
    swap the modules, drop the weights, empty the CUDA cache       the only mutation
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import plestore
from plestore.formats import get_format
from plestore.hashing import Qwen4ExpHash
from plestore.integrations.transformers.arch import (
    PleSite,
    UnsupportedModelError,
    family_of_config,
    find_site,
)
from plestore.integrations.transformers.module import PerLayerEmbedding
from plestore.integrations.transformers.ngram import NGramEmbedding, install_prefetch
from plestore.integrations.transformers.qwen import find_qwen_sites, weight_of
from plestore.integrations.transformers.source import (
    CheckpointSource,
    RowSource,
    WeightSource,
    find_checkpoint_tensor,
    local_checkpoint_dir,
)
from plestore.integrations.transformers.table import (
    PLAIN,
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


def _resolve(device: Any) -> torch.device:
    try:
        return _resolve_device(None if device is None else str(torch.device(device)))
    except RuntimeError as e:  # torch.device("nonsense")
        raise ValueError(str(e)) from None


def default_format(dtype: torch.dtype) -> str:
    """The lossless table format of a weight dtype: bf16, fp16, else fp32."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def _options(tier: str, device: torch.device, site: Any, table_options: dict) -> dict:
    """Table options, validated now (before anything is packed or modified)."""
    opts = dict(table_options)
    # Gemma 3n remaps ids into range itself and Qwen4Exp's hash yields only table rows: skip the
    # range check (a GPU sync per lookup)
    opts.setdefault("check_ids", getattr(site, "out_of_range", "hash") == "error")
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


def offload_per_layer_embeddings(
    model: nn.Module,
    table_dir: str | Path,
    tier: str = "auto",
    format: str | None = None,
    device: str | torch.device | None = None,
    **table_options: Any,
) -> OffloadReport:
    """Serve `model`'s per-layer embedding tables (Gemma 3n / Gemma 4 / Qwen4Exp, text-only or
    multimodal) from plestore tables in `table_dir` and free the weights. Returns what moved
    (`OffloadReport`).

    tier: auto | device | pinned | mapped | direct (auto: pinned DRAM if it fits, else direct).
    format: None (the weight's own dtype: bf16, fp16 or fp32 — exact), an exact plain format
    the values fit (e.g. bf16 for a float32 model loaded from a bf16 checkpoint), or a lossy
    fp8_e4m3 / nvfp4 (opt-in; see measure_divergence).
    device: where rows are delivered (default: Gemma, the weight's device; Qwen4Exp, the device
    of the PLE layer's projections).
    table_options: any plestore TableOptions field (threads, cache_bytes, ...).

    Everything is validated and every table packed (or reused) and opened before the model is
    touched: on any error the model is left as it was.
    """
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no transformers config; pass a Gemma 3n / Gemma 4 / "
            "Qwen4Exp model from transformers"
        )
    if family_of_config(config) == "qwen4_exp":
        return _offload_qwen(model, table_dir, tier, format, device, table_options)
    return _offload_gemma(model, table_dir, tier, format, device, table_options)


def _offload_gemma(model, table_dir, tier, format, device, table_options) -> OffloadReport:
    t0 = time.perf_counter()
    site = find_site(model)
    weight = site.module.weight
    fmt = get_format(format or default_format(weight.dtype)).name
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


def _offload_qwen(model, table_dir, tier, format, device, table_options) -> OffloadReport:
    """Every PLE layer's table packed (or reused) and opened, then every module swapped."""
    t0 = time.perf_counter()
    sites = find_qwen_sites(model, fmt=None if format is None else get_format(format).name)
    weights = [weight_of(s) for s in sites]
    dtypes = {w.dtype for w in weights}
    if len(dtypes) != 1:
        raise UnsupportedModelError(
            f"the PLE tables have different dtypes: {sorted(map(str, dtypes))}"
        )
    (dtype,) = dtypes
    if format is None:
        sites = find_qwen_sites(model, fmt=default_format(dtype))
    compute = sites[0].parent.key_proj.weight.device  # where the PLE layer uses the rows
    dev = _resolve(compute if device is None else device)
    opts = _options(tier, dev, sites[0], table_options)
    for s in sites:
        check_table_dir(table_dir, s.spec)
    prepared, tables = [], []
    try:
        for s, w in zip(sites, weights, strict=True):
            p = prepare_table(table_dir, s.spec, s, WeightSource(w, s.weight_path), live=w)
            prepared.append(p)
            tables.append(open_for(p, tier, dev, opts)[0])
    except BaseException:
        for t in tables:
            t.close()
        raise

    # -- from here on the model changes; nothing below can fail on bad input ------------------
    on_cuda = {w.device for w in weights if w.device.type == "cuda"}
    before = sum(torch.cuda.memory_allocated(d) for d in on_cuda) if on_cuda else None
    modules, parts = [], []
    for s, w, p, t in zip(sites, weights, prepared, tables, strict=True):
        new = NGramEmbedding(
            t, Qwen4ExpHash.from_spec(s.hash), layer_idx=s.layer_idx, dtype=dtype, device=dev
        )
        setattr(s.parent, s.attr, new)
        modules.append((s, new))
        part = report_for(
            s,
            p,
            t,
            dtype,
            freed_bytes=w.numel() * w.element_size(),
            freed_from=str(w.device),
        )
        parts.append(part)
        s.module.ngram_embedding.weight = None  # the Parameter's last reference (or the caller's)
    del weights, w
    for text_model in {id(s.text_model): s.text_model for s, _ in modules}.values():
        mine = [m for s, m in modules if s.text_model is text_model]
        hook = install_prefetch(text_model, mine)
        for m in mine:
            m.prefetch_hook = hook
    if on_cuda:
        torch.cuda.empty_cache()
    after = sum(torch.cuda.memory_allocated(d) for d in on_cuda) if on_cuda else None
    report = merge_reports(parts, before, after, time.perf_counter() - t0)
    log.info("plestore: %s", report)
    return report


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
