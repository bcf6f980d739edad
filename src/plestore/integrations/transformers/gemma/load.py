"""`load_gemma(path)`: load a Gemma 3n / Gemma 4 checkpoint with its per-layer embedding served
by plestore from the start — the weight is never materialised, on the GPU or anywhere else.

    config.json -> architecture, table shape             (validated before any I/O)
    checkpoint safetensors -> table (packed or reused)   the one packing path every engine and
                                                         `plestore pack` share (prepare_table)
    from_pretrained of a one-off subclass whose __init__ swaps embed_tokens_per_layer for the
    plestore module while the model is still on the meta device: the model then has no such
    parameter, transformers never allocates, initialises or reads it (the checkpoint key is
    ignored as unexpected), and the class is set back to the real one afterwards.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plestore.checkpoint import Checkpoint, detect_tables
from plestore.integrations.transformers.common.family import (
    UnsupportedModelError,
    family_of_config,
)
from plestore.integrations.transformers.common.loading import (
    checkpoint_config,
    load_dtype,
    subclass_installing,
    target_device,
    text_model_key,
)
from plestore.integrations.transformers.common.loading import (
    model_class as find_model_class,
)
from plestore.integrations.transformers.common.packed import checkpoint_tables, load_format
from plestore.integrations.transformers.common.release import check_release
from plestore.integrations.transformers.common.report import OffloadReport, report_for
from plestore.integrations.transformers.common.served import attach_stats
from plestore.integrations.transformers.common.source import find_checkpoint_tensor
from plestore.integrations.transformers.common.table import checked_table_options, default_format
from plestore.integrations.transformers.gemma.module import PerLayerEmbedding
from plestore.integrations.transformers.gemma.offload import make_module
from plestore.integrations.transformers.gemma.site import PleSite, find_site, ple_shape

__all__ = ["load_gemma"]

log = logging.getLogger("plestore")
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
    t0 = time.perf_counter()
    check_release()
    path, config = checkpoint_config(path)
    family = family_of_config(config)
    cls = find_model_class(config, model_class)
    site, tensor = _checkpoint_site(path, config, family)
    dtype = load_dtype(from_pretrained_kwargs, config, tensor.dtype)
    fmt = load_format(format, default_format(tensor.dtype), dtype)
    key = text_model_key(cls, "embed_tokens_per_layer.weight")
    dev = target_device(device, from_pretrained_kwargs.get("device_map"), key)
    opts = checked_table_options(tier, dev, site, table_options or {})
    table_dir = Path(table_dir) if table_dir is not None else path / "plestore"
    (name,) = _table_names(path)
    ((table, prepared),) = checkpoint_tables(path, table_dir, [name], fmt, (tier, dev, opts))
    installed: dict[str, Any] = {}

    def install(model: nn.Module) -> None:
        found = find_site(model, allow_meta=True)
        m = found.module  # on meta: dtypes are what from_pretrained would have loaded
        scale = torch.full((), m.scalar_embed_scale, dtype=m.embed_scale.dtype, device="cpu")
        new = make_module(table, found, scale, m.weight.dtype, "cpu")
        setattr(found.parent, found.attr, new)
        installed.update(site=found, module=new, dtype=m.weight.dtype)

    try:
        loader = subclass_installing(cls, install, _IGNORE)
        model = loader.from_pretrained(path, **from_pretrained_kwargs)
    except BaseException:
        table.close()
        raise
    model.__class__ = cls
    module: PerLayerEmbedding = installed["module"]
    module.reset_embed_scale()  # from_pretrained recreated non-persistent buffers empty
    if installed["dtype"] != dtype:
        log.warning(
            "plestore: the table holds the checkpoint's values cast to %s, the model was loaded "
            "in %s; outputs may differ from a stock load in the last bit",
            dtype,
            installed["dtype"],
        )
    report = report_for(
        installed["site"],
        prepared,
        table,
        installed["dtype"],
        freed_bytes=0,
        freed_from="",
        seconds=time.perf_counter() - t0,
    )
    report.exact = report.exact and installed["dtype"] == dtype
    attach_stats(model)
    return model, report


def _table_names(path: Path) -> list[str]:
    with Checkpoint.open(path) as ck:
        return [t.name for t in detect_tables(ck)]  # validated: one bf16 table of that shape


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
