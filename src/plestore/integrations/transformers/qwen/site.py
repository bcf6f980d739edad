"""Where a Qwen4Exp (Qwen3.8-Flash-Next) model keeps its PLE n-gram tables, and what they hash.

    Qwen4ExpForCausalLM                 model.layers.L.ple.ple_embedding
    Qwen4ExpTextModel (bare)            layers.L.ple.ple_embedding
    Qwen4ExpForConditionalGeneration    model.language_model.layers.L.ple.ple_embedding
    Qwen4ExpModel                       language_model.layers.L.ple.ple_embedding

One `Qwen4ExpTextNGramEmbedding` per id in `ple_layer_ids` (1-based; L = id - 1), each with its
own `nn.Embedding` ngram_embedding [padded rows, head_dim] and its own dense `ple_layer_index`
in the hash. transformers derives the hash constants (layer_multipliers, ngram_heads_vocab_sizes,
ngram_heads_offsets) as plestore.hashing.Qwen4ExpHash does (spec §1); they are buffers a
checkpoint may overwrite, so each is compared with plestore's before anything is offloaded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plestore.integrations.transformers.common.family import (
    UnsupportedModelError,
    check_table_weight,
)
from plestore.integrations.transformers.qwen.ngram import NGramEmbedding
from plestore.spec import (
    Qwen4ExpHashSpec,
    TableSpec,
    check_hash_constants,
    table_specs_from_hf_config,
)

__all__ = ["KIND", "QwenSite", "find_qwen_sites", "qwen_table_specs", "text_config_dict"]

KIND = "qwen4exp-ple"
_PATH = re.compile(r"^(|.*\.)layers\.(\d+)\.ple\.ple_embedding$")  # (text model., L)
MODULE_CLASS = "Qwen4ExpTextNGramEmbedding"


def text_config_dict(config: Any) -> dict:
    """The text config's values (the multimodal config's text_config) as a plain dict."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return text.to_dict() if hasattr(text, "to_dict") else dict(text)


def qwen_table_specs(config: Any, fmt: str) -> dict[int, TableSpec]:
    """decoder layer index -> the spec of its table (names `ple.layers.L.<format>`)."""
    cfg = text_config_dict(config)
    if not cfg.get("ple_layer_ids"):
        raise UnsupportedModelError(
            "this Qwen4Exp model has no PLE layers (ple_layer_ids is empty): nothing to offload"
        )
    specs = table_specs_from_hf_config(cfg, format=fmt)
    out = {}
    for s in specs:
        layer = int(s.name.rpartition(".")[2])
        out[layer] = s.replace(name=f"{s.name}.{s.format}")
    return out


@dataclass(frozen=True)
class QwenSite:
    """One PLE n-gram table of a loaded model: where it hangs and what it must keep hashing."""

    path: str  # dotted module path, e.g. "model.layers.1.ple.ple_embedding"
    parent: nn.Module  # the Qwen4ExpTextPLELayer
    attr: str  # "ple_embedding"
    module: nn.Module  # the Qwen4ExpTextNGramEmbedding (None while loading a checkpoint)
    text_model: nn.Module | None  # the Qwen4ExpTextModel holding `layers`
    layer_idx: int  # decoder layer (0-based)
    spec: TableSpec  # rows, dim, heads, hash (with the dense layer index)
    multimodal: bool
    family: str = "qwen4_exp"

    @property
    def rows(self) -> int:
        return self.spec.rows

    @property
    def dim(self) -> int:
        return self.spec.dim

    @property
    def hash(self) -> Qwen4ExpHashSpec:
        return self.spec.hash

    @property
    def family_name(self) -> str:
        return "Qwen4Exp"

    @property
    def weight_path(self) -> str:
        return f"{self.path}.ngram_embedding.weight"

    def identity(self) -> dict:
        """What a table must have been packed for (besides its values): shape and hash."""
        h = self.hash
        return {
            "kind": KIND,
            "rows": self.rows,
            "dim": self.dim,
            "heads": h.heads,
            "layer": self.layer_idx,
            "hash": {
                "vocab_size": h.vocab_size,
                "eos_token_id": h.eos_token_id,
                "ngram_size": h.ngram_size,
                "heads_per_ngram": h.heads_per_ngram,
                "ngram_vocab_size_base": h.ngram_vocab_size_base,
                "seed": h.seed,
                "layer_index": h.layer_index,
                "pad_multiple": h.pad_multiple,
            },
        }


def _check_module(path: str, module: nn.Module, spec: TableSpec, allow_meta: bool) -> None:
    """The module is the embedding the config describes, hashing as plestore does."""
    if isinstance(module, NGramEmbedding):
        raise UnsupportedModelError(
            f"{path} is already served by plestore (table {module.table.file.meta_path})"
        )
    emb = getattr(module, "ngram_embedding", None)
    if type(module).__name__ != MODULE_CLASS or not isinstance(emb, nn.Embedding):
        raise UnsupportedModelError(
            f"{path} is a {type(module).__name__}, not the {MODULE_CLASS} transformers builds "
            "for Qwen4Exp; this transformers version is not supported"
        )
    h = spec.hash
    described = f"[{spec.rows}, {spec.dim}] (layer index {h.layer_index}, {h.heads} heads)"
    name = f"{path}.ngram_embedding.weight"
    check_table_weight(name, emb.weight, (spec.rows, spec.dim), described, allow_meta, "load(path)")
    mine = (module.ple_layer_index, module.ngram_size, module.eos_token_id)
    want = (h.layer_index, h.ngram_size, h.eos_token_id)
    if mine != want:
        raise UnsupportedModelError(
            f"{path}: (ple_layer_index, ngram_size, eos_token_id) = {mine}, the config gives {want}"
        )
    if emb.weight.device.type == "meta":
        return  # buffers are not loaded yet: the checkpoint's are checked when it is packed
    for key in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"):
        try:
            check_hash_constants(h, **{key: getattr(module, key).detach().cpu().numpy()})
        except ValueError as e:
            raise UnsupportedModelError(f"{path}.{key}: {e}") from None


def find_qwen_sites(
    model: nn.Module, *, fmt: str | None = "bf16", allow_meta: bool = False
) -> list[QwenSite]:
    """Every PLE n-gram embedding of a Qwen4Exp model, checked against its config (and the
    hash against plestore's), with the spec of its table in format `fmt`. Raises
    UnsupportedModelError; nothing is modified."""
    config = model.config
    found = [(n, m) for n, m in model.named_modules() if n.endswith("ple.ple_embedding")]
    specs = qwen_table_specs(config, fmt or "bf16")
    if not found:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no ple.ple_embedding module although its config names "
            f"PLE layers {sorted(i + 1 for i in specs)}"
        )
    by_layer: dict[int, tuple[str, nn.Module]] = {}
    for path, module in found:
        m = _PATH.search(path)
        if m is None:
            raise UnsupportedModelError(f"{path} is not inside a decoder layer (layers.L)")
        by_layer[int(m.group(2))] = (path, module)
    if sorted(by_layer) != sorted(specs):
        raise UnsupportedModelError(
            f"{type(model).__name__} has PLE modules on decoder layers {sorted(by_layer)}, its "
            f"config's ple_layer_ids give {sorted(specs)}"
        )
    multimodal = getattr(config, "model_type", "") == "qwen4_exp"
    sites = []
    for layer, (path, module) in sorted(by_layer.items()):
        spec = specs[layer]
        _check_module(path, module, spec, allow_meta)
        parent_path, _, attr = path.rpartition(".")
        text_path = _PATH.search(path).group(1).rstrip(".")  # the model holding `layers`
        text_model = model.get_submodule(text_path) if text_path else model
        sites.append(
            QwenSite(
                path=path,
                parent=model.get_submodule(parent_path),
                attr=attr,
                module=module,
                text_model=text_model,
                layer_idx=layer,
                spec=spec.replace(tensor=path + ".ngram_embedding"),
                multimodal=multimodal,
            )
        )
    return sites


def weight_of(site: QwenSite) -> torch.Tensor:
    return site.module.ngram_embedding.weight
