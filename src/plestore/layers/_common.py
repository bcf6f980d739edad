"""Config helpers shared by the layer configs."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from plestore.spec import load_hf_config, merged_text_config

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_positive_ints(obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{type(obj).__name__}.{n} must be a positive int, got {v!r}")


def check_activation_dtype(obj: Any) -> None:
    if obj.dtype not in ACTIVATION_DTYPES:
        raise ValueError(
            f"{type(obj).__name__}.dtype must be one of {ACTIVATION_DTYPES}, got {obj.dtype!r}"
        )
    if not isinstance(obj.rms_norm_eps, int | float) or not obj.rms_norm_eps > 0:
        raise ValueError(f"rms_norm_eps must be a positive number, got {obj.rms_norm_eps!r}")


def hf_text_config(config: str | Path | Mapping | Any) -> dict:
    """A config.json path/dir, a dict or a transformers config object -> one flat dict in which
    the keys of a nested `text_config` win over top-level ones."""
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if isinstance(config, Mapping):
        config = dict(config)
    return merged_text_config(load_hf_config(config))
