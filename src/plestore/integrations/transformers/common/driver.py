"""One load driver for every model family: a checkpoint loaded by transformers with its tables
served by plestore from the start, the table weights never materialised. A family is data
(`Family`): where its tables hang, which checkpoint tables they are, the module that serves one
(it makes its own ids), and what runs once the model is loaded (a prefetch hook, buffers).

    family.source(path, config) -> the checkpoint's tables (validated), their format
    checkpoint_tables          -> each packed or reused through the one packing path, opened
    from_pretrained of a one-off subclass whose __init__ (still on meta) swaps every table
                                  module for the family's served one: transformers then has no
                                  such parameter and skips the checkpoint keys unread
    family.loaded(model, served) -> what the family does once the weights are in
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

from plestore.integrations.transformers.common.loading import (
    load_dtype,
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
from plestore.integrations.transformers.common.table import checked_table_options, default_format
from plestore.lookup import Table

__all__ = ["CheckpointSource", "Family", "load_family"]

log = logging.getLogger("plestore")


@dataclass(frozen=True)
class CheckpointSource:
    """A checkpoint's tables as a family reads them from its headers (validated)."""

    names: list[str]  # the tables' names (`detect_tables`), one per site
    format: str  # the format the checkpoint stores them in
    dtype: torch.dtype  # the dtype from_pretrained falls back to (no dtype in config.json)
    site: Any = None  # a site whose out_of_range sets the tables' id check (None: ids hashed)


@dataclass(frozen=True)
class Family:
    """What the load driver needs to know of a model family (Gemma 3n / 4, Qwen4Exp, ...)."""

    name: str
    source: Callable[[Path, Any], CheckpointSource]  # (path, config): validated, nothing read
    table_key: Callable[[Any], str]  # config -> a table weight's path in the text model
    ignore_keys: str  # checkpoint keys from_pretrained leaves unread (the table tensors)
    sites: Callable[[nn.Module, str], list]  # (model on meta, table format) -> its sites
    weight: Callable[[Any], torch.Tensor]  # site -> its table weight (on meta while loading)
    table_of: Callable[[Any], str]  # site -> the name of the table serving it
    module: Callable[[Any, Table, torch.dtype, torch.device], nn.Module]  # the served module
    loaded: Callable[[nn.Module, list[tuple[Any, nn.Module]]], None]  # after from_pretrained
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
        for site in family.sites(model, fmt):
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
    family.loaded(model, [(site, module) for site, module, _, _ in served])
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
