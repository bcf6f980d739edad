"""One driver for every model family: a checkpoint loaded by transformers with its tables
served by plestore from the start, the table weights never materialised. A family is data
(`Family`): where its tables hang, which checkpoint tables they are, the module that serves one
(it makes its own ids), and what runs once the model is loaded (a prefetch hook, buffers).

    family.source(path, config) -> the checkpoint's tables (validated), their format
    checkpoint_tables          -> each packed or reused through the one packing path, opened
    from_pretrained of a one-off subclass whose __init__ (still on meta) swaps every table
                                  module for the family's served one: transformers then has no
                                  such parameter and skips the checkpoint keys unread
    family.loaded, .prefetch(model, served) -> what the family does once the weights are in

`offload_family` is the same for a model already loaded: every site's weight packed into its
table (or reused), every table opened, then (nothing left to fail) every module swapped and
the weights freed. Adding a family is a new `Family`, for both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plestore.formats import get_format
from plestore.integrations.transformers.common.family import UnsupportedModelError
from plestore.integrations.transformers.common.loading import (
    load_dtype,
    resolve_device,
    subclass_installing,
    target_device,
    text_model_key,
)
from plestore.integrations.transformers.common.packed import checkpoint_tables, load_format
from plestore.integrations.transformers.common.report import (
    OffloadReport,
    merge_reports,
    report_for,
)
from plestore.integrations.transformers.common.served import attach_stats
from plestore.integrations.transformers.common.source import RowSource
from plestore.integrations.transformers.common.table import (
    check_table_dir,
    checked_table_options,
    default_format,
    open_for,
    prepare_weight_table,
)
from plestore.lookup import Table
from plestore.spec import TableSpec

__all__ = ["CheckpointSource", "Family", "load_family", "offload_family"]

log = logging.getLogger("plestore")


#: (model, [(site, its served module)]) -> None
PrefetchHook = Callable[[nn.Module, list[tuple[Any, nn.Module]]], None]


@dataclass(frozen=True)
class CheckpointSource:
    """A checkpoint's tables as a family reads them from its headers (validated)."""

    names: list[str]  # the tables' names (`detect_tables`), one per site
    format: str  # the format the checkpoint stores them in
    dtype: torch.dtype  # the dtype from_pretrained falls back to (no dtype in config.json)
    site: Any = None  # a site whose out_of_range sets the tables' id check (None: ids hashed)


@dataclass(frozen=True)
class Family:
    """What the driver (load and offload) needs to know of a model family (Gemma 3n / 4,
    Qwen4Exp, ...)."""

    name: str
    source: Callable[[Path, Any], CheckpointSource]  # (path, config): validated, nothing read
    table_key: Callable[[Any], str]  # config -> a table weight's path in the text model
    ignore_keys: str  # checkpoint keys from_pretrained leaves unread (the table tensors)
    #: (model, table format or None, on meta) -> its sites, checked against its config
    sites: Callable[[nn.Module, str | None, bool], list]
    weight: Callable[[Any], torch.Tensor]  # site -> its table weight (on meta while loading)
    table_of: Callable[[Any], str]  # site -> the name of the table serving it
    module: Callable[[Any, Table, torch.dtype, torch.device], nn.Module]  # the served module
    # -- offload: the tables of a loaded model ----------------------------------------------
    spec: Callable[[nn.Module, Any, str], TableSpec]  # (model, site, format) -> its table's
    rows: Callable[[nn.Module, Any, torch.Tensor], RowSource]  # (model, site, weight): its rows
    compute_device: Callable[[Any, torch.Tensor], torch.device]  # where the site uses its rows
    release: Callable[[Any], None]  # drops the site's weight Parameter (its last reference)
    prefetch: PrefetchHook | None = None  # installs the prefetch hook (load and offload)
    loaded: PrefetchHook | None = None  # after from_pretrained (buffers it recreated)
    one_report: bool = False  # a single table: its report alone (else merged, per layer)


def load_family(
    family: Family,
    path: Path,
    config: Any,
    cls: type,
    where: tuple[str, Path, str | None],
    device: Any,
    table_options: dict,
    from_pretrained_kwargs: dict,
) -> tuple[nn.Module, OffloadReport]:
    """`load(path)` of a checkpoint of `family`; where = (tier, table_dir, format)."""
    t0 = time.perf_counter()
    tier, table_dir, format = where
    src = family.source(path, config)
    dtype = load_dtype(from_pretrained_kwargs, config, src.dtype)
    fmt = load_format(format, src.format, dtype)
    key = text_model_key(cls, family.table_key(config))
    dev = target_device(device, from_pretrained_kwargs.get("device_map"), key)
    opts = checked_table_options(tier, dev, src.site, table_options)
    opened = checkpoint_tables(path, table_dir, src.names, fmt, (tier, dev, opts))
    tables = dict(zip(src.names, opened, strict=True))
    served: list[tuple[Any, nn.Module, Any, torch.dtype]] = []

    def install(model: nn.Module) -> None:
        for site in family.sites(model, fmt, True):
            table, prepared = tables[family.table_of(site)]
            weight_dtype = family.weight(site).dtype  # what from_pretrained would load
            module = family.module(site, table, weight_dtype, dev)
            setattr(site.parent, site.attr, module)
            served.append((site, module, prepared, weight_dtype))

    try:
        model = subclass_installing(cls, install, family.ignore_keys).from_pretrained(
            path, **from_pretrained_kwargs
        )
    except BaseException:
        for table, _ in tables.values():
            table.close()
        raise
    model.__class__ = cls
    modules = [(site, module) for site, module, _, _ in served]
    for hook in (family.loaded, family.prefetch):
        if hook is not None:
            hook(model, modules)
    parts = [_report(s, m.table, p, src.format, fmt, w) for s, m, p, w in served]
    seconds = time.perf_counter() - t0
    report = parts[0] if family.one_report else merge_reports(parts, None, None, seconds)
    report.seconds = seconds
    if {w for *_, w in served} != {dtype}:
        log.warning(
            "plestore: the tables hold the checkpoint's values for %s, the model was loaded in %s",
            dtype,
            sorted(str(w) for *_, w in served),
        )
    log.info("plestore: %s", report)
    attach_stats(model)
    return model, report


def _report(site, table: Table, prepared, source: str, fmt: str, weight_dtype) -> OffloadReport:
    """One table's part of the report. Exact: the table holds the checkpoint's values as they
    are, or cast to the dtype the model holds them in (as from_pretrained casts)."""
    report = report_for(site, prepared, table, weight_dtype, freed_bytes=0, freed_from="")
    report.exact = fmt in (source, default_format(weight_dtype))
    return report


def offload_family(
    family: Family, model: nn.Module, table_dir: Any, where: tuple, table_options: dict
) -> OffloadReport:
    """`offload_per_layer_embeddings(model)` of a model of `family`; where = (tier, format,
    device). Everything is checked, packed (or reused) and opened before the model changes."""
    t0 = time.perf_counter()
    tier, format, device = where
    sites = family.sites(model, None if format is None else get_format(format).name, False)
    weights = [family.weight(s) for s in sites]
    dtypes = {w.dtype for w in weights}
    if len(dtypes) != 1:
        raise UnsupportedModelError(
            f"the {family.name} tables have different dtypes: {sorted(map(str, dtypes))}"
        )
    (dtype,) = dtypes
    fmt = get_format(format or default_format(dtype)).name
    if format is None:  # (the sites' specs in the weight's own format)
        sites = family.sites(model, fmt, False)
    compute = family.compute_device(sites[0], weights[0])
    dev = resolve_device(compute if device is None else device)
    opts = checked_table_options(tier, dev, sites[0], table_options)
    specs = [family.spec(model, s, fmt) for s in sites]
    for spec in specs:
        check_table_dir(table_dir, spec)
    prepared, tables = [], []
    try:
        for s, spec, w in zip(sites, specs, weights, strict=True):
            source = family.rows(model, s, w)
            prepared.append(prepare_weight_table(table_dir, spec, s, source, live=w))
            del source
            tables.append(open_for(prepared[-1], tier, dev, opts)[0])
    except BaseException:
        for t in tables:
            t.close()
        raise
    # -- from here on the model changes; nothing below can fail on bad input ------------------
    served = [family.module(s, t, dtype, dev) for s, t in zip(sites, tables, strict=True)]
    on_cuda = {w.device for w in weights if w.device.type == "cuda"}
    # (after the served modules' own small buffers: what the swap frees is the weights)
    before = sum(torch.cuda.memory_allocated(d) for d in on_cuda) if on_cuda else None
    modules, parts = [], []
    for s, w, p, t, new in zip(sites, weights, prepared, tables, served, strict=True):
        setattr(s.parent, s.attr, new)
        modules.append((s, new))
        freed = w.numel() * w.element_size()
        parts.append(report_for(s, p, t, dtype, freed_bytes=freed, freed_from=str(w.device)))
        family.release(s)
    del weights, w
    if family.prefetch is not None:
        family.prefetch(model, modules)
    if on_cuda:
        torch.cuda.empty_cache()
    after = sum(torch.cuda.memory_allocated(d) for d in on_cuda) if on_cuda else None
    seconds = time.perf_counter() - t0
    if family.one_report:  # its one table's, with the swap's device memory and time
        report = parts[0]
        report.device_allocated_before, report.device_allocated_after = before, after
        report.seconds = seconds
    else:
        report = merge_reports(parts, before, after, seconds)
    log.info("plestore: %s", report)
    return report
