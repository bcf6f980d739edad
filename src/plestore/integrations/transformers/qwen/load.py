"""Qwen4Exp as a family of the driver (`QWEN4EXP`, common/driver.py): a checkpoint loaded with
its PLE n-gram tables served by plestore from the start, the `ngram_embedding.shard_{i}.weight`
tensors never concatenated nor materialised; or a loaded model's tables moved into plestore
(offload: one table per PLE layer, packed from the live weights).

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
from pathlib import Path
from typing import Any

import torch

from plestore.checkpoint import Checkpoint, declare_qwen_shard_format, detect_tables
from plestore.hashing import Qwen4ExpHash
from plestore.integrations.tables import ple_table_name
from plestore.integrations.transformers.common.driver import CheckpointSource, Family
from plestore.integrations.transformers.common.source import WeightSource
from plestore.integrations.transformers.qwen.ngram import NGramEmbedding, hook_prefetch
from plestore.integrations.transformers.qwen.site import (
    QwenSite,
    find_qwen_sites,
    text_config_dict,
    weight_of,
)
from plestore.lookup import Table

__all__ = ["QWEN4EXP"]

log = logging.getLogger("plestore")
IGNORE = r"ple\.ple_embedding\.(ngram_embedding\..*|layer_multipliers|ngram_heads_\w+)$"


def _source(path: Path, config: Any) -> CheckpointSource:
    with Checkpoint.open(path) as ck:
        fmt = declare_qwen_shard_format(ck)  # (a float32 save_pretrained declares none)
        names = [s.name for s in detect_tables(ck)]  # validates every shard and hash constant
    if fmt == "fp8_e4m3":
        log.warning(
            "plestore: transformers drops ngram_embedding.weight_scale and computes with the "
            "e4m3 rows unscaled; plestore serves the shared table's e4m3 bytes at scale 1.0"
        )
    return CheckpointSource(names, fmt, torch.bfloat16)


def _table_key(config: Any) -> str:
    first = min(text_config_dict(config)["ple_layer_ids"]) - 1  # 1-based ids
    return f"layers.{first}.ple.ple_embedding.ngram_embedding.weight"


def _module(site: QwenSite, table: Table, dtype: torch.dtype, dev: torch.device) -> NGramEmbedding:
    """The NGramEmbedding serving `site` from `table` (the model still on meta)."""
    if (table.spec.rows, table.spec.dim) != (site.rows, site.dim):
        raise ValueError(
            f"{site.path}: the model expects [{site.rows}, {site.dim}], the packed table "
            f"{table.file.meta_path} is [{table.spec.rows}, {table.spec.dim}]"
        )
    hasher = Qwen4ExpHash.from_spec(site.hash)
    return NGramEmbedding(table, hasher, layer_idx=site.layer_idx, dtype=dtype, device=dev)


def _release(site: QwenSite) -> None:
    site.module.ngram_embedding.weight = None


QWEN4EXP = Family(
    name="qwen4_exp",
    source=_source,
    table_key=_table_key,
    ignore_keys=IGNORE,
    sites=lambda model, fmt, on_meta: find_qwen_sites(model, fmt=fmt, allow_meta=on_meta),
    weight=weight_of,
    table_of=lambda site: ple_table_name(site.layer_idx),
    module=_module,
    spec=lambda model, site, fmt: site.spec,  # (the sites' specs are in `fmt`)
    rows=lambda model, site, weight: WeightSource(weight, site.weight_path),
    compute_device=lambda site, weight: site.parent.key_proj.weight.device,  # the PLE layer's
    release=_release,
    prefetch=hook_prefetch,
)
