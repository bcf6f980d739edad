"""A loaded Qwen4Exp model's PLE n-gram tables moved into plestore tables, one per PLE layer."""

from __future__ import annotations

import logging
import time

import torch

from plestore.formats import get_format
from plestore.hashing import Qwen4ExpHash
from plestore.integrations.transformers.common.family import UnsupportedModelError
from plestore.integrations.transformers.common.loading import resolve_device
from plestore.integrations.transformers.common.report import (
    OffloadReport,
    merge_reports,
    report_for,
)
from plestore.integrations.transformers.common.source import WeightSource
from plestore.integrations.transformers.common.table import (
    check_table_dir,
    checked_table_options,
    default_format,
    open_for,
    prepare_weight_table,
)
from plestore.integrations.transformers.qwen.ngram import NGramEmbedding, hook_prefetch
from plestore.integrations.transformers.qwen.site import find_qwen_sites, weight_of

__all__ = ["offload_qwen"]

log = logging.getLogger("plestore")


def offload_qwen(model, table_dir, tier, format, device, table_options) -> OffloadReport:
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
    dev = resolve_device(compute if device is None else device)
    opts = checked_table_options(tier, dev, sites[0], table_options)
    for s in sites:
        check_table_dir(table_dir, s.spec)
    prepared, tables = [], []
    try:
        for s, w in zip(sites, weights, strict=True):
            p = prepare_weight_table(table_dir, s.spec, s, WeightSource(w, s.weight_path), live=w)
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
    hook_prefetch(model, modules)
    if on_cuda:
        torch.cuda.empty_cache()
    after = sum(torch.cuda.memory_allocated(d) for d in on_cuda) if on_cuda else None
    report = merge_reports(parts, before, after, time.perf_counter() - t0)
    log.info("plestore: %s", report)
    return report
