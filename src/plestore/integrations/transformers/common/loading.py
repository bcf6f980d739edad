"""What loading a checkpoint with its tables served needs, whatever the model: its class, the
device and dtype from_pretrained will give the rows, and the one-off subclass that swaps the
modules while the model is still on the meta device."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from plestore.integrations.transformers.common.family import UnsupportedModelError
from plestore.lookup.table import resolve_device as _lookup_device

__all__ = [
    "checkpoint_config",
    "load_dtype",
    "model_class",
    "resolve_device",
    "subclass_installing",
    "target_device",
    "text_model_key",
]

#: where a model class keeps its text model (the module holding `layers` and the per-layer
#: tables), by the class name's ending: the same for Gemma 3n / Gemma 4 and Qwen4Exp
_TEXT_MODEL_AT = (
    ("ForCausalLM", "model."),
    ("ForConditionalGeneration", "model.language_model."),
    ("TextModel", ""),
    ("Model", "language_model."),
)


def resolve_device(device: Any) -> torch.device:
    try:
        return _lookup_device(None if device is None else str(torch.device(device)))
    except RuntimeError as e:  # torch.device("nonsense")
        raise ValueError(str(e)) from None


def checkpoint_config(path: str | Path) -> tuple[Path, Any]:
    """(path, its transformers config) of a local checkpoint directory, or a clear error."""
    import transformers

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a local checkpoint directory (no config.json); download it first, "
            "e.g. huggingface_hub.snapshot_download(repo_id)"
        )
    config = transformers.AutoConfig.from_pretrained(path)
    _refuse_synthetic(path, config)
    return path, config


def _refuse_synthetic(path: Path, config: Any) -> None:
    """A `plestore synth` checkpoint holds the tables and a few weights, not a whole model:
    refused in one line naming what its config lacks (transformers would fail deep inside)."""
    if not getattr(config, "plestore_synth", None):
        return
    import transformers

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    generic = {k for k, v in transformers.PretrainedConfig().to_dict().items() if v is None}
    lacks = sorted(
        k for k, v in text.to_dict().items() if v is None and k not in generic and "token" not in k
    )
    what = f" (its config has no {', '.join(lacks)})" if lacks else ""
    raise UnsupportedModelError(
        f"{path} is a `plestore synth` checkpoint: its embedding tables and a few weights, not a "
        f"whole model load() can build{what}; serve its tables with `plestore pack {path} "
        'TABLES` and plestore.open_table("TABLES"), or load a real checkpoint'
    )


def model_class(config: Any, model_class: type | str | None) -> type:
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


def text_model_key(cls: type, name: str) -> str:
    """The module path (a device_map key) of `name` inside `cls`'s text model, e.g.
    Qwen4ExpForCausalLM, "layers.1.ple" -> "model.layers.1.ple"."""
    for ending, prefix in _TEXT_MODEL_AT:
        if cls.__name__.endswith(ending):
            return prefix + name
    raise UnsupportedModelError(f"{cls.__name__} is not a model class plestore knows the layout of")


def target_device(device: Any, device_map: Any, key: str) -> torch.device:
    """Where the per-layer rows are needed: `device`, else what device_map gives the module."""
    _refuse_cuda_map(device_map)
    if device is not None:
        return resolve_device(device)
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
        return resolve_device(f"cuda:{device_map}")
    if str(device_map) in ("auto", "balanced", "balanced_low_0", "sequential"):
        return resolve_device(None)  # the first GPU if there is one
    if str(device_map) == "disk":
        return torch.device("cpu")
    return resolve_device(device_map)


def _refuse_cuda_map(device_map: Any) -> None:
    """A device_map naming CUDA on a torch without it, refused up front (from_pretrained would
    fail deep inside: "Torch not compiled with CUDA enabled")."""
    places = device_map.values() if isinstance(device_map, dict) else [device_map]
    if not torch.cuda.is_available() and any(
        isinstance(v, int) or str(v).startswith("cuda") for v in places if v is not None
    ):
        raise ValueError(
            f"device_map={device_map!r} puts weights on CUDA, which this torch does not have: "
            "leave device_map out (the model and its rows stay on the CPU) or pass "
            "device_map='cpu'"
        )


def load_dtype(kwargs: dict, config: Any, tensor_dtype: torch.dtype) -> torch.dtype:
    """The dtype from_pretrained will give the weight (its "auto" rule: config, then file)."""
    d = kwargs.get("dtype") or kwargs.get("torch_dtype") or "auto"
    if isinstance(d, dict):
        d = d.get("", "auto")
    if d == "auto":
        d = getattr(config, "dtype", None) or tensor_dtype
    return getattr(torch, d) if isinstance(d, str) else d


def subclass_installing(cls: type, install, ignore_keys: str) -> type:
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
