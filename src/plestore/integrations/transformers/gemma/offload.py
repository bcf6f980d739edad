"""A loaded Gemma 3n / Gemma 4 model's `embed_tokens_per_layer` moved into a plestore table."""

from __future__ import annotations

import logging
import time

import torch

from plestore.formats import get_format
from plestore.integrations.transformers.common.loading import resolve_device
from plestore.integrations.transformers.common.report import OffloadReport, report_for
from plestore.integrations.transformers.common.source import (
    CheckpointSource,
    RowSource,
    WeightSource,
    find_checkpoint_tensor,
    local_checkpoint_dir,
)
from plestore.integrations.transformers.common.table import (
    check_table_dir,
    checked_table_options,
    default_format,
    open_for,
    prepare_weight_table,
)
from plestore.integrations.transformers.gemma.module import PerLayerEmbedding
from plestore.integrations.transformers.gemma.site import PleSite, find_site, table_spec
from plestore.lookup import Table

__all__ = ["make_module", "offload_gemma"]

log = logging.getLogger("plestore")


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


def offload_gemma(model, table_dir, tier, format, device, table_options) -> OffloadReport:
    t0 = time.perf_counter()
    site = find_site(model)
    weight = site.module.weight
    fmt = get_format(format or default_format(weight.dtype)).name
    dev = resolve_device(weight.device if device is None else device)
    opts = checked_table_options(tier, dev, site, table_options)
    spec = table_spec(site, model.config, fmt)
    check_table_dir(table_dir, spec)

    ck_dir = local_checkpoint_dir(model)
    ck = find_checkpoint_tensor(ck_dir) if ck_dir else None
    if ck is not None and ck.shape == (site.rows, site.dim):
        source: RowSource = CheckpointSource(ck, dtype=weight.dtype)  # checked against weight
    else:
        source = WeightSource(weight, site.path)
    prepared = prepare_weight_table(table_dir, spec, site, source, live=weight)
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
