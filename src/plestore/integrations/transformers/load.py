"""The two entry points, each handing over to the model family's own: `load(path)` (a
checkpoint, its tables served from the start) and `offload_per_layer_embeddings(model, ...)` (a
loaded model's tables moved out)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from plestore.integrations.transformers.common.driver import load_family, offload_family
from plestore.integrations.transformers.common.family import (
    UnsupportedModelError,
    family_of_config,
)
from plestore.integrations.transformers.common.loading import checkpoint_config
from plestore.integrations.transformers.common.loading import model_class as model_class_of
from plestore.integrations.transformers.common.release import check_release
from plestore.integrations.transformers.common.report import OffloadReport
from plestore.integrations.transformers.common.served import attach_stats
from plestore.integrations.transformers.gemma.load import GEMMA
from plestore.integrations.transformers.qwen.load import QWEN4EXP

__all__ = ["load", "offload_per_layer_embeddings"]


def load(
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
    """Load a local safetensors checkpoint — Gemma 3n / Gemma 4 or Qwen4Exp, detected from its
    config.json — with plestore serving its per-layer embedding tables; they are never
    materialised. Returns (model, OffloadReport).

    table_dir: where the tables live (default: `<path>/plestore`); tables packed from these
    very files are reused. format: None (exact: the values from_pretrained would give) or an
    explicit one. tier, device, model_class, table_options and every other keyword (device_map,
    dtype, ...) as in load_gemma.
    """
    check_release()
    path, config = checkpoint_config(path)
    family = QWEN4EXP if family_of_config(config) == "qwen4_exp" else GEMMA
    cls = model_class_of(config, model_class)
    table_dir = Path(table_dir) if table_dir is not None else path / "plestore"
    where = (tier, table_dir, format)
    options = dict(table_options or {})
    return load_family(family, path, config, cls, where, device, options, from_pretrained_kwargs)


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
    touched: on any error the model is left as it was. Afterwards `model.plestore_stats()`
    returns every served table's `stats()`, keyed by table name.
    """
    check_release()
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no transformers config; pass a Gemma 3n / Gemma 4 / "
            "Qwen4Exp model from transformers"
        )
    family = QWEN4EXP if family_of_config(config) == "qwen4_exp" else GEMMA
    report = offload_family(family, model, table_dir, (tier, format, device), table_options)
    attach_stats(model)
    return report
