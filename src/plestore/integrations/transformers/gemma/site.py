"""Where a Gemma 3n / Gemma 4 model keeps its per-layer embedding, and what its lookup means.

    Gemma3nForCausalLM, Gemma4ForCausalLM            model.embed_tokens_per_layer
    Gemma3n/Gemma4ForConditionalGeneration           model.language_model.embed_tokens_per_layer
    Gemma3nTextModel, Gemma3nModel, ... (bare)       [language_model.]embed_tokens_per_layer

The module is a `...TextScaledWordEmbedding`: `embedding(ids) * embed_scale.to(weight.dtype)`,
weight [vocab_size_per_layer_input, num_hidden_layers * hidden_size_per_layer_input].

Out-of-range ids (transformers 5.x, checked against the installed code in the tests):
- Gemma 3n: `Gemma3nTextModel.get_per_layer_inputs` maps ids outside
  [0, vocab_size_per_layer_input) to 0 before the lookup (text-only and multimodal models; in
  4.x the multimodal `Gemma3nModel.forward` did it). The replacement does the same remap itself,
  so no id it is given can be out of range and no check (no GPU sync) is needed.
- Gemma 4: nothing is remapped (the multimodal model swaps image/audio/video placeholders for
  `pad_token_id` first); `nn.Embedding` raises IndexError on anything else, and so does the
  replacement (the table checks its ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from plestore.integrations.transformers.common.family import (
    FAMILIES,
    UnsupportedModelError,
    check_table_weight,
    family_of_config,
)
from plestore.integrations.transformers.gemma.module import PerLayerEmbedding
from plestore.spec import TableSpec, table_specs_from_hf_config

__all__ = ["PleSite", "find_site", "ple_shape", "table_spec"]

MODULE_NAME = "embed_tokens_per_layer"


def ple_shape(config: Any) -> tuple[int, int, int, int]:
    """(rows, dim, layers, per-layer dim) of the per-layer table a config describes."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers, per_layer = int(text.num_hidden_layers), int(text.hidden_size_per_layer_input)
    return int(text.vocab_size_per_layer_input), layers * per_layer, layers, per_layer


@dataclass(frozen=True)
class PleSite:
    """The per-layer embedding of one model: where it hangs and what it must keep doing."""

    path: str  # dotted module path, e.g. "model.language_model.embed_tokens_per_layer"
    parent: nn.Module
    attr: str
    module: nn.Module
    family: str  # gemma3n | gemma4
    multimodal: bool
    rows: int
    dim: int
    layers: int
    per_layer_dim: int

    @property
    def out_of_range(self) -> str:
        """What the model does with ids outside [0, rows): 'zero' (row 0) or 'error'."""
        return FAMILIES[self.family][1]

    @property
    def family_name(self) -> str:
        return FAMILIES[self.family][0]

    @property
    def weight_path(self) -> str:
        return f"{self.path}.weight"

    def identity(self) -> dict:
        """What a table must have been packed for (besides its values)."""
        return {
            "kind": "gemma-per-layer-embedding",
            "rows": self.rows,
            "dim": self.dim,
            "layers": self.layers,
            "per_layer_dim": self.per_layer_dim,
        }


def find_site(model: nn.Module, *, allow_meta: bool = False) -> PleSite:
    """Locate the per-layer embedding of a supported model, checking it is the module the
    config describes. Raises UnsupportedModelError (nothing is modified)."""
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no transformers config; pass a Gemma 3n / Gemma 4 "
            "model from transformers"
        )
    family = family_of_config(config)
    rows, dim, layers, per_layer = ple_shape(config)
    found = [(n, m) for n, m in model.named_modules() if n.rpartition(".")[2] == MODULE_NAME]
    if not found:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no {MODULE_NAME} module (is it a Gemma audio or vision "
            "tower alone?)"
        )
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise UnsupportedModelError(f"{type(model).__name__} has several per-layer tables: {names}")
    path, module = found[0]
    if isinstance(module, PerLayerEmbedding):
        raise UnsupportedModelError(
            f"{path} is already served by plestore (table {module.table.file.meta_path})"
        )
    weight = getattr(module, "weight", None)
    if not isinstance(module, nn.Embedding) or not hasattr(module, "embed_scale"):
        raise UnsupportedModelError(
            f"{path} is a {type(module).__name__}, not the scaled word embedding transformers "
            "builds for Gemma 3n / Gemma 4; this transformers version is not supported"
        )
    described = f"[{rows}, {layers} * {per_layer}]"
    check_table_weight(
        f"{path}.weight", weight, (rows, dim), described, allow_meta, "load_gemma(path)"
    )
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    multimodal = getattr(config, "model_type", "") in FAMILIES
    return PleSite(path, parent, attr, module, family, multimodal, rows, dim, layers, per_layer)


def table_spec(site: PleSite, config, fmt: str) -> TableSpec:
    """The table's spec from the model config (plestore.spec knows Gemma configs)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    cfg = {
        "num_hidden_layers": site.layers,
        "hidden_size_per_layer_input": site.per_layer_dim,
        "vocab_size_per_layer_input": site.rows,
        "model_type": getattr(text, "model_type", site.family),
    }
    (spec,) = table_specs_from_hf_config(cfg, format=fmt)
    return spec.replace(name=f"{spec.name}.{spec.format}", tensor=site.path + ".weight")
