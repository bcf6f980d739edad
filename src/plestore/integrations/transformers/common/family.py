"""Which model family a transformers config describes, the error for any other, and the check
of a model's table weight against its config."""

from __future__ import annotations

from typing import Any

__all__ = ["FAMILIES", "UnsupportedModelError", "check_table_weight", "family_of_config"]

#: model_type (without "_text") -> (name, what the model does with out-of-range ids)
FAMILIES = {
    "gemma3n": ("Gemma 3n", "zero"),
    "gemma4": ("Gemma 4", "error"),
    "qwen4_exp": ("Qwen4Exp", "hash"),  # ids are hashed: every id maps to some row
}


class UnsupportedModelError(ValueError):
    """The model is not a Gemma 3n / Gemma 4 / Qwen4Exp model with per-layer tables to offload."""


def family_of_config(config: Any) -> str:
    """'gemma3n', 'gemma4' or 'qwen4_exp' for a (text or multimodal) config; raises for
    anything else, for Gemma 4 variants without per-layer embeddings
    (hidden_size_per_layer_input 0/None) and for Qwen4Exp configs without PLE layers."""
    model_type = str(getattr(config, "model_type", "") or "")
    family = model_type.removesuffix("_text")
    if family not in FAMILIES:
        raise UnsupportedModelError(
            f"plestore offloads the per-layer embeddings of Gemma 3n, Gemma 4 and Qwen4Exp "
            f"models (model_type gemma3n[_text] / gemma4[_text] / qwen4_exp[_text]); this model "
            f"has model_type {model_type or '(none)'!r}"
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if family == "qwen4_exp":
        if not getattr(text, "ple_layer_ids", None):
            raise UnsupportedModelError(
                "this Qwen4Exp model has no PLE layers (ple_layer_ids is empty): nothing to offload"
            )
        return family
    if not getattr(text, "hidden_size_per_layer_input", None) or not getattr(
        text, "vocab_size_per_layer_input", None
    ):
        raise UnsupportedModelError(
            f"this {FAMILIES[family][0]} model has no per-layer embedding "
            f"(hidden_size_per_layer_input={getattr(text, 'hidden_size_per_layer_input', None)!r},"
            f" vocab_size_per_layer_input={getattr(text, 'vocab_size_per_layer_input', None)!r})"
        )
    return family


def check_table_weight(
    name: str, weight: Any, shape: tuple, described: str, allow_meta: bool, loader: str
) -> None:
    """The table weight `name` a model holds is what its config describes: that shape, loaded
    (not on the meta device unless `allow_meta`; `loader` loads it without), floating-point."""
    if tuple(weight.shape) != tuple(shape):
        raise UnsupportedModelError(
            f"{name} has shape {tuple(weight.shape)}; the config describes {described}"
        )
    if weight.device.type == "meta" and not allow_meta:
        raise UnsupportedModelError(
            f"{name} is on the meta device (not loaded, or offloaded by accelerate); load the "
            f"model with its weights, or use plestore's {loader}"
        )
    if not weight.is_floating_point():
        raise UnsupportedModelError(f"{name} is not a floating-point tensor")
