"""Load a Qwen4Exp checkpoint with its PLE n-gram tables served by plestore from the start: the
`ngram_embedding.shard_{i}.weight` tensors are never concatenated nor materialised.

    checkpoint headers -> every PLE table validated (plestore.checkpoint.detect: missing or
                          extra shards, dtypes, shapes, hash constants against the config)
    prepare_table      -> the one packing path every engine and `plestore pack` share: the
                          tables streamed from the shard files (bounded memory, atomic), reused
                          as they are whoever packed them, another checkpoint's refused; in the
                          format that gives the values from_pretrained would: the shards' own
                          where the model's dtype holds them exactly, else the model's dtype
                          (cast as torch does, a table beside the shards' format)
    from_pretrained of a one-off subclass whose __init__ swaps every ple.ple_embedding (still
                          on meta) for an NGramEmbedding: transformers then has no n-gram
                          parameter, and skips the shard tensors as unexpected keys unread.

FP8 checkpoints: transformers 5.17 to 5.25 load the e4m3 shards cast to the model's dtype and
drop `ngram_embedding.weight_scale` (an unexpected key), so the stock model computes with
e4m3 values unscaled. The shared table keeps the e4m3 bytes (1 B per value) and the checkpoint's
scale; transformers opens it at table scale 1.0, which gives exactly those values.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import plestore
from plestore.checkpoint import Checkpoint, declare_qwen_shard_format, detect_tables
from plestore.hashing import Qwen4ExpHash
from plestore.integrations.transformers.common.loading import subclass_installing
from plestore.integrations.transformers.common.packed import (
    checkpoint_tables,
    load_format,
    widens,
)
from plestore.integrations.transformers.common.report import OffloadReport, merge_reports
from plestore.integrations.transformers.common.table import checked_table_options, default_format
from plestore.integrations.transformers.qwen.ngram import NGramEmbedding, install_prefetch
from plestore.integrations.transformers.qwen.site import QwenSite, find_qwen_sites

__all__ = ["load_qwen"]

log = logging.getLogger("plestore")
IGNORE = r"ple\.ple_embedding\.(ngram_embedding\..*|layer_multipliers|ngram_heads_\w+)$"


def load_qwen(
    path: Path,
    config: Any,
    cls: type,
    dev: torch.device,
    dtype: torch.dtype,
    tier: str,
    table_dir: Path,
    format: str | None,
    table_options: dict,
    from_pretrained_kwargs: dict,
) -> tuple[nn.Module, OffloadReport]:
    """`load(path)` for a Qwen4Exp checkpoint (the module docstring says how); `cls` its model
    class, `dev` and `dtype` where and how from_pretrained puts the PLE rows."""
    t0 = time.perf_counter()
    with Checkpoint.open(path) as ck:
        source = declare_qwen_shard_format(ck)  # (a float32 save_pretrained declares none)
        names = [s.name for s in detect_tables(ck)]  # validates every shard and hash constant
    fmt = load_format(format, source, dtype)
    opts = checked_table_options(tier, dev, None, table_options)
    opened = checkpoint_tables(path, table_dir, names, fmt, (tier, dev, opts))
    tables = {int(n.rpartition(".")[2]): t for n, t in zip(names, opened, strict=True)}
    installed: dict[int, tuple] = {}

    def install(model: nn.Module) -> None:
        for site in find_qwen_sites(model, fmt=fmt, allow_meta=True):
            table, packed = tables[site.layer_idx]
            weight_dtype = site.module.ngram_embedding.weight.dtype  # as from_pretrained loads
            new = _installed(site, table, packed, weight_dtype, dev)
            installed[site.layer_idx] = (site, new, packed, weight_dtype)

    try:
        loader = subclass_installing(cls, install, IGNORE)
        model = loader.from_pretrained(path, **from_pretrained_kwargs)
    except BaseException:
        for t, _ in tables.values():
            t.close()
        raise
    model.__class__ = cls
    _hook_prefetch(model, [(site, new) for site, new, _, _ in installed.values()])
    parts = [
        _report(site, new.table, packed, source, fmt, (weight_dtype, dtype))
        for site, new, packed, weight_dtype in installed.values()
    ]
    out = merge_reports(parts, None, None, time.perf_counter() - t0)
    if source == "fp8_e4m3":
        log.warning(
            "plestore: transformers drops ngram_embedding.weight_scale and computes with the "
            "e4m3 rows unscaled; plestore serves the shared table's e4m3 bytes at scale 1.0"
        )
    log.info("plestore: %s", out)
    return model, out


def _installed(site: QwenSite, table: plestore.Table, packed: Any, dtype, dev: torch.device):
    """The NGramEmbedding serving `site` from `table`, swapped in (the model still on meta)."""
    if (table.spec.rows, table.spec.dim) != (site.rows, site.dim):
        raise ValueError(
            f"{site.path}: the model expects [{site.rows}, {site.dim}], the packed table "
            f"{packed.file.meta_path} is [{table.spec.rows}, {table.spec.dim}]"
        )
    new = NGramEmbedding(
        table,
        Qwen4ExpHash.from_spec(site.hash),
        layer_idx=site.layer_idx,
        dtype=dtype,
        device=dev,
    )
    setattr(site.parent, site.attr, new)
    return new


def _hook_prefetch(model: nn.Module, served: list[tuple[QwenSite, NGramEmbedding]]) -> None:
    """One prefetch hook per text model, starting all its PLE layers' lookups."""
    by_text: dict[int, list] = {}
    for site, new in served:
        text_model = model.get_submodule(site.path.rpartition(".layers.")[0])
        by_text.setdefault(id(text_model), [text_model, []])[1].append(new)
    for text_model, modules in by_text.values():
        hook = install_prefetch(text_model, modules)
        for m in modules:
            m.prefetch_hook = hook


def _report(site, t, packed, source: str, fmt: str, dtypes: tuple) -> OffloadReport:
    """One PLE table's part of the report; dtypes: (the weight's as loaded, the model's)."""
    weight_dtype, dtype = dtypes
    return OffloadReport(
        module=site.path,
        model="Qwen4Exp" + (" (multimodal)" if site.multimodal else " (text)"),
        rows=t.spec.rows,
        dim=t.spec.dim,
        source_dtype=source,
        format=t.spec.format,
        exact=fmt in (source, default_format(weight_dtype)) or widens(source, dtype),
        table_path=str(packed.file.meta_path),
        table_bytes=t.file.data_bytes,
        reused=packed.reused,
        packed_from=packed.origin,
        fingerprint=packed.fingerprint,
        tier=t.tier.name,
        tier_reason=t.tier_choice.reason,
        device=str(t.device),
        weight_bytes=t.spec.rows * t.spec.dim * torch.empty((), dtype=weight_dtype).element_size(),
        freed_bytes=0,
        freed_from="",
        table_device_bytes=getattr(t.tier, "device_bytes", lambda: 0)(),
        pack_seconds=0.0 if packed.reused else packed.seconds,
    )
