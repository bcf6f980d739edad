"""A checkpoint's tables for transformers, through the one packing path every engine and the
CLI share (`plestore.integrations.tables.prepare_table`): packed once, reused as they are by
transformers, vLLM and `plestore pack` alike, another checkpoint's refused.

FP8 checkpoints: the table keeps the e4m3 bytes and the checkpoint's `weight_scale` (what vLLM
and `plestore pack` serve); transformers drops weight_scale and computes with the e4m3 values
unscaled, so it opens that same file at table scale 1.0 (`TableFile.with_scale`), exactly the
stock values. No second table, nothing re-packed when the user switches engines.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from plestore.checkpoint import Checkpoint
from plestore.formats import get_format
from plestore.integrations.tables import prepare_table
from plestore.integrations.transformers.common.table import PreparedTable, default_format
from plestore.lookup import Table
from plestore.options import TableOptions
from plestore.tablefile import TableFile

__all__ = ["checkpoint_tables", "load_format", "open_packed", "widens"]

#: the table scale transformers computes FP8 rows with (it drops the checkpoint's weight_scale)
TRANSFORMERS_FP8_SCALE = 1.0
#: (table format, model dtype) pairs a table delivers exactly: the cast widens
_WIDENS = {("bf16", torch.float32), ("fp16", torch.float32)}


def load_format(format: str | None, source: str, dtype: torch.dtype) -> str:
    """The table format giving the values from_pretrained would: `format` if given, else the
    checkpoint's own (`source`) where the model's dtype holds it exactly (FP8: the e4m3
    bytes), else the model's dtype (a table beside the source's)."""
    if format is not None:
        return get_format(format).name
    if source == "fp8_e4m3" or source == default_format(dtype) or (source, dtype) in _WIDENS:
        return source
    return default_format(dtype)


def widens(fmt: str, dtype: torch.dtype) -> bool:
    return (fmt, dtype) in _WIDENS


def open_packed(
    prepared: PreparedTable, tier: str, device: torch.device, opts: dict, scale: float | None
) -> Table:
    """The prepared table opened for a model; `scale` decodes its rows at another table scale
    than the file's."""
    tf = prepared.file if scale is None else prepared.file.with_scale(scale)
    return Table(tf, TableOptions.from_env(tier=tier, device=str(device), **opts))


def checkpoint_tables(
    path: Path,
    table_dir: Path,
    names: list[str],
    fmt: str,
    placement: tuple[str, torch.device, dict],
) -> list[tuple[Table, PreparedTable]]:
    """Every table `names` of the checkpoint at `path` in format `fmt`, prepared (packed or
    reused) and opened on placement = (tier, device, table options); an FP8 table at the
    scale transformers computes with. On any error, what was opened is closed."""
    tier, device, opts = placement
    out: list[tuple[Table, PreparedTable]] = []
    try:
        with Checkpoint.open(path) as ck:
            for name in names:
                t0 = time.perf_counter()
                meta, reused = prepare_table(ck, table_dir, name, fmt)
                tf = TableFile.open(meta)
                source = tf.source.get("source_format", fmt)
                origin = {"kind": "checkpoint", "path": str(path), "source": source}
                took = time.perf_counter() - t0
                prepared = PreparedTable(tf, reused, tf.source["fingerprint"], origin, took)
                # the checkpoint's own e4m3 bytes: transformers computes them unscaled
                fp8 = source == "fp8_e4m3" and tf.spec.format == "fp8_e4m3"
                scale = TRANSFORMERS_FP8_SCALE if fp8 else None
                out.append((open_packed(prepared, tier, device, opts, scale), prepared))
    except BaseException:
        for table, _ in out:
            table.close()
        raise
    return out
