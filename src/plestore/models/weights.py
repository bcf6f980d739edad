"""Load a PLE sublayer's weights from a checkpoint by their real names."""

from __future__ import annotations

import torch

from plestore.checkpoint import Checkpoint

__all__ = ["load_ple_weights"]

_NAMES = (
    "key_proj.weight",
    "value_proj.weight",
    "kv_proj.weight",
    "norm_key.weight",
    "norm_query.weight",
    "norm_conv.weight",
    "conv1d.weight",
)


def load_ple_weights(checkpoint: Checkpoint, layer: int) -> tuple[dict[str, torch.Tensor], str]:
    """({name: tensor}, prefix) of decoder layer `layer`'s PLE weights, under whichever prefix
    the checkpoint uses (`model.language_model.layers.L.ple.` or text-only `model.layers.L.ple.`).
    Raises naming the prefixes tried when the checkpoint has none."""
    tried = []
    for prefix in (f"model.language_model.layers.{layer}.ple.", f"model.layers.{layer}.ple."):
        tried.append(prefix)
        found = {}
        for name in _NAMES:
            try:
                info = checkpoint.tensor(prefix + name)
            except (KeyError, ValueError):
                continue
            found[prefix + name] = torch.from_numpy(checkpoint.read_tensor(info.name).copy())
        if found:
            return found, prefix
    raise ValueError(f"checkpoint {checkpoint.root} has no PLE weights under {tried}")
