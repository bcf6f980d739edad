"""`load_gemma(path)`: load a Gemma 3n / Gemma 4 checkpoint with its per-layer embedding served
by plestore from the start — the weight is never materialised, on the GPU or anywhere else.

    config.json -> architecture, table shape             (validated before any I/O)
    checkpoint safetensors -> table (packed or reused)   rows streamed 64 MiB at a time
    from_pretrained of a one-off subclass whose __init__ swaps embed_tokens_per_layer for the
    plestore module while the model is still on the meta device: the model then has no such
    parameter, transformers never allocates, initialises or reads it (the checkpoint key is
    ignored as unexpected), and the class is set back to the real one afterwards.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plestore.formats import get_format
from plestore.integrations.transformers.arch import (
    PleSite,
    UnsupportedModelError,
    family_of_config,
    find_site,
    ple_shape,
)
from plestore.integrations.transformers.module import PerLayerEmbedding
from plestore.integrations.transformers.offload import (
    OffloadReport,
    _options,
    _resolve,
    default_format,
    make_module,
    open_for,
    report_for,
)
from plestore.integrations.transformers.source import CheckpointSource, find_checkpoint_tensor
from plestore.integrations.transformers.table import check_table_dir, prepare_table, table_spec

__all__ = ["load", "load_gemma"]

log = logging.getLogger("plestore")
_IGNORE = r"embed_tokens_per_layer\.weight$"


def _model_class(config: Any, model_class: type | str | None) -> type:
    import transformers

    name = model_class or (getattr(config, "architectures", None) or [None])[0]
    if name is None:
        raise UnsupportedModelError("config.json names no architecture; pass model_class=")
    cls = getattr(transformers, name, None) if isinstance(name, str) else name
    if not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedModel):
        raise UnsupportedModelError(f"{name!r} is not a transformers model class")
    if not re.match(r"Gemma(3n|4)|Qwen4Exp", cls.__name__):
        raise UnsupportedModelError(
            f"plestore loads Gemma 3n / Gemma 4 / Qwen4Exp models, not {cls.__name__}; use "
            "offload_per_layer_embeddings(model, ...) on other loaded models"
        )
    return cls


def _target_device(device: Any, device_map: Any, key: str) -> torch.device:
    """Where the per-layer rows are needed: `device`, else what device_map gives the module."""
    places = device_map.values() if isinstance(device_map, dict) else [device_map]
    if not torch.cuda.is_available() and any(
        isinstance(v, int) or str(v).startswith("cuda") for v in places if v is not None
    ):  # (from_pretrained would fail deep inside: "Torch not compiled with CUDA enabled")
        raise ValueError(
            f"device_map={device_map!r} puts weights on CUDA, which this torch does not have: "
            "leave device_map out (the model and its rows stay on the CPU) or pass "
            "device_map='cpu'"
        )
    if device is not None:
        return _resolve(device)
    if device_map is None:
        return torch.device("cpu")  # from_pretrained's default
    if isinstance(device_map, dict):
        module = key.removesuffix(".weight")
        best, where = -1, None
        for prefix, dev in device_map.items():
            covers = prefix == "" or module == prefix or module.startswith(prefix + ".")
            if covers and len(prefix) > best:
                best, where = len(prefix), dev
        device_map = where if where is not None else next(iter(device_map.values()), "cpu")
    if isinstance(device_map, int):
        return _resolve(f"cuda:{device_map}")
    if str(device_map) in ("auto", "balanced", "balanced_low_0", "sequential"):
        return _resolve(None)  # the first GPU if there is one
    if str(device_map) == "disk":
        return torch.device("cpu")
    return _resolve(device_map)


def _load_dtype(kwargs: dict, config: Any, tensor_dtype: torch.dtype) -> torch.dtype:
    """The dtype from_pretrained will give the weight (its "auto" rule: config, then file)."""
    d = kwargs.get("dtype") or kwargs.get("torch_dtype") or "auto"
    if isinstance(d, dict):
        d = d.get("", "auto")
    if d == "auto":
        d = getattr(config, "dtype", None) or tensor_dtype
    return getattr(torch, d) if isinstance(d, str) else d


def _subclass(cls: type, install, ignore_keys: str = _IGNORE) -> type:
    """cls whose __init__ swaps the per-layer embeddings (still on meta) for plestore's:
    `install(model)` does the swap; checkpoint keys matching `ignore_keys` are then unexpected,
    skipped without being read."""

    class Plestore(cls):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            install(self)
            ignore = set(self._keys_to_ignore_on_load_unexpected or ())
            self._keys_to_ignore_on_load_unexpected = ignore | {ignore_keys}

    Plestore.__name__, Plestore.__qualname__ = cls.__name__, cls.__qualname__
    return Plestore


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
    import transformers

    t0 = time.perf_counter()
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a local checkpoint directory (no config.json); download it first, "
            "e.g. huggingface_hub.snapshot_download(repo_id)"
        )
    config = transformers.AutoConfig.from_pretrained(path)
    family = family_of_config(config)
    cls = _model_class(config, model_class)
    rows, dim, layers, per_layer = ple_shape(config)
    tensor = find_checkpoint_tensor(path)
    if tensor is None:
        raise UnsupportedModelError(f"{path} has no *embed_tokens_per_layer.weight safetensors")
    if tensor.shape != (rows, dim):
        raise UnsupportedModelError(
            f"{tensor.file.name}: {tensor.key} has shape {tensor.shape}, config.json describes "
            f"[{rows}, {layers} * {per_layer}]"
        )
    dtype = _load_dtype(from_pretrained_kwargs, config, tensor.dtype)
    fmt = get_format(format or default_format(dtype)).name
    key = tensor.key.removesuffix(".weight")
    multimodal = getattr(config, "model_type", "") == family
    site = PleSite(key, None, "", None, family, multimodal, rows, dim, layers, per_layer)
    dev = _target_device(device, from_pretrained_kwargs.get("device_map"), tensor.key)
    opts = _options(tier, dev, site, table_options or {})
    spec = table_spec(site, config, fmt)
    table_dir = Path(table_dir) if table_dir is not None else path / "plestore"
    check_table_dir(table_dir, spec)

    prepared = prepare_table(table_dir, spec, site, CheckpointSource(tensor, dtype=dtype))
    table, _ = open_for(prepared, tier, dev, opts)
    installed: dict[str, Any] = {}

    def install(model: nn.Module) -> None:
        found = find_site(model, allow_meta=True)
        m = found.module  # on meta: dtypes are what from_pretrained would have loaded
        scale = torch.full((), m.scalar_embed_scale, dtype=m.embed_scale.dtype, device="cpu")
        new = make_module(table, found, scale, m.weight.dtype, "cpu")
        setattr(found.parent, found.attr, new)
        installed.update(site=found, module=new, dtype=m.weight.dtype)

    try:
        model = _subclass(cls, install).from_pretrained(path, **from_pretrained_kwargs)
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
    return model, report


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
    import transformers

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a local checkpoint directory (no config.json); download it first, "
            "e.g. huggingface_hub.snapshot_download(repo_id)"
        )
    config = transformers.AutoConfig.from_pretrained(path)
    if family_of_config(config) != "qwen4_exp":
        return load_gemma(
            path,
            tier,
            table_dir,
            format,
            device=device,
            model_class=model_class,
            table_options=table_options,
            **from_pretrained_kwargs,
        )
    from plestore.integrations.transformers.load_qwen import load_qwen

    cls = _model_class(config, model_class)
    key = "model.language_model.layers.0.ple.ple_embedding.ngram_embedding.weight"
    dev = _target_device(device, from_pretrained_kwargs.get("device_map"), key)
    dtype = _load_dtype(from_pretrained_kwargs, config, torch.bfloat16)
    table_dir = Path(table_dir) if table_dir is not None else path / "plestore"
    return load_qwen(
        path,
        config,
        cls,
        dev,
        dtype,
        tier,
        table_dir,
        format,
        dict(table_options or {}),
        from_pretrained_kwargs,
    )
