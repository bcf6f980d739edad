"""`load_gemma(path)`: load a Gemma 3n / Gemma 4 checkpoint with its per-layer embedding served
by plestore from the start — the weight is never materialised, on the GPU or anywhere else.
Gemma is a family of the driver (`GEMMA`, common/driver.py), for load and for the offload of a
loaded model's table.

    config.json -> architecture, table shape             (validated before any I/O)
    checkpoint safetensors -> table (packed or reused)   the one packing path every engine and
                                                         `plestore pack` share (prepare_table)
    from_pretrained of a one-off subclass whose __init__ swaps embed_tokens_per_layer for the
    plestore module while the model is still on the meta device: the model then has no such
    parameter, transformers never allocates, initialises or reads it (the checkpoint key is
    ignored as unexpected), and the class is set back to the real one afterwards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from plestore.checkpoint import Checkpoint, detect_tables
from plestore.integrations.transformers.common.driver import CheckpointSource, Family, load_family
from plestore.integrations.transformers.common.family import (
    UnsupportedModelError,
    family_of_config,
)
from plestore.integrations.transformers.common.loading import checkpoint_config
from plestore.integrations.transformers.common.loading import (
    model_class as find_model_class,
)
from plestore.integrations.transformers.common.release import check_release
from plestore.integrations.transformers.common.report import OffloadReport
from plestore.integrations.transformers.common.source import (
    CheckpointSource as CheckpointRows,  # (rows streamed from the checkpoint file)
)
from plestore.integrations.transformers.common.source import (
    RowSource,
    WeightSource,
    find_checkpoint_tensor,
    local_checkpoint_dir,
)
from plestore.integrations.transformers.common.table import default_format
from plestore.integrations.transformers.gemma.module import PerLayerEmbedding
from plestore.integrations.transformers.gemma.site import (
    MODULE_NAME,
    PleSite,
    find_site,
    ple_shape,
    table_spec,
)
from plestore.lookup import Table

__all__ = ["GEMMA", "load_gemma"]

_IGNORE = r"embed_tokens_per_layer\.weight$"


def load_gemma(
    path: str | Path,
    tier: str = "auto",
    table_dir: str | Path | None = None,
    format: str | None = None,
    *,
    device: str | torch.device | None = None,
    model_class: type | str | None = None,
    table_options: dict | None = None,
    **from_pretrained_kwargs: Any,
) -> tuple[nn.Module, OffloadReport]:
    """Load a local Gemma 3n / Gemma 4 safetensors checkpoint with plestore serving its
    per-layer embedding. Returns (model, OffloadReport).

    table_dir: where the table lives (default: `<path>/plestore`); an existing table with this
    checkpoint's fingerprint is reused. tier, format: as in offload_per_layer_embeddings.
    device: where rows are delivered (default: what `device_map` gives the module, else cpu).
    model_class: the transformers class (default: config.json's `architectures[0]`).
    table_options: plestore TableOptions fields. Every other keyword goes to from_pretrained
    (device_map, dtype / torch_dtype, attn_implementation, ...).
    """
    check_release()
    path, config = checkpoint_config(path)
    family_of_config(config)  # a model of another family: refused naming its model_type
    cls = find_model_class(config, model_class)
    table_dir = Path(table_dir) if table_dir is not None else path / "plestore"
    where = (tier, table_dir, format)
    return load_family(
        GEMMA, path, config, cls, where, device, dict(table_options or {}), from_pretrained_kwargs
    )


def _source(path: Path, config: Any) -> CheckpointSource:
    site, tensor = _checkpoint_site(path, config, family_of_config(config))
    with Checkpoint.open(path) as ck:
        names = [t.name for t in detect_tables(ck)]  # validated: one bf16 table of that shape
    return CheckpointSource(names, default_format(tensor.dtype), tensor.dtype, site)


def _module(site: PleSite, table: Table, dtype: torch.dtype, dev: torch.device):
    """The PerLayerEmbedding serving `site` (its rows delivered on the table's device), its
    embed_scale where the module keeps it: the live one (offload), else (on meta: dtypes are
    what from_pretrained would have loaded) a cpu one that from_pretrained moves."""
    m = site.module
    scale = m.embed_scale
    if scale.is_meta:
        scale = torch.full((), m.scalar_embed_scale, dtype=scale.dtype, device="cpu")
    return PerLayerEmbedding(
        table,
        embed_scale=scale,
        scalar_embed_scale=getattr(m, "scalar_embed_scale", float(scale)),
        dtype=dtype,
        padding_idx=m.padding_idx,
        out_of_range=site.out_of_range,
        device=scale.device,
    )


def _rows(model: nn.Module, site: PleSite, weight: torch.Tensor) -> RowSource:
    """The rows to pack: the checkpoint's tensor (checked against the weight as it streams)
    where the model was loaded from a local one of this shape, else the weight itself."""
    ck_dir = local_checkpoint_dir(model)
    ck = find_checkpoint_tensor(ck_dir) if ck_dir else None
    if ck is not None and ck.shape == (site.rows, site.dim):
        return CheckpointRows(ck, dtype=weight.dtype)
    return WeightSource(weight, site.path)


def _loaded(model: nn.Module, served: list[tuple[PleSite, PerLayerEmbedding]]) -> None:
    for _, module in served:
        module.reset_embed_scale()  # from_pretrained recreated non-persistent buffers empty


def _checkpoint_site(path: Path, config: Any, family: str) -> tuple[PleSite, Any]:
    """The per-layer table the config describes, as the checkpoint holds it (not loaded yet),
    and the checkpoint tensor holding it."""
    rows, dim, layers, per_layer = ple_shape(config)
    tensor = find_checkpoint_tensor(path)
    if tensor is None:
        raise UnsupportedModelError(f"{path} has no *embed_tokens_per_layer.weight safetensors")
    if tensor.shape != (rows, dim):
        raise UnsupportedModelError(
            f"{tensor.file.name}: {tensor.key} has shape {tensor.shape}, config.json describes "
            f"[{rows}, {layers} * {per_layer}]"
        )
    key = tensor.key.removesuffix(".weight")
    multimodal = getattr(config, "model_type", "") == family
    site = PleSite(key, None, "", None, family, multimodal, rows, dim, layers, per_layer)
    return site, tensor


GEMMA = Family(
    name="gemma",
    source=_source,
    table_key=lambda config: f"{MODULE_NAME}.weight",
    ignore_keys=_IGNORE,
    sites=lambda model, fmt, on_meta: [find_site(model, allow_meta=on_meta)],
    weight=lambda site: site.module.weight,
    table_of=lambda site: MODULE_NAME,  # the checkpoint's one table (detect_tables' name)
    module=_module,
    spec=lambda model, site, fmt: table_spec(site, model.config, fmt),
    rows=_rows,
    compute_device=lambda site, weight: weight.device,
    release=lambda site: setattr(site.module, "weight", None),
    loaded=_loaded,
    one_report=True,
)
