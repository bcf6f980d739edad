"""Presets: real model configs (their text part), scalable through the n-gram vocabulary base
(the Engram prime base, the Gemma per-layer vocabulary) for small synthetic copies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from plestore.formats import get_format

__all__ = ["PRESETS", "Preset", "preset_config"]


_QWEN_FORMAT_KEYS = {
    "bf16": {"ple_embedding_dtype": "bfloat16"},
    "fp8_e4m3": {"ple_embedding_dtype": "float8_e4m3fn"},
    "nvfp4": {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}},
}


def _qwen_preset(fmt: str, base: int | None, seed: int | None) -> dict:
    text = {
        "model_type": "qwen4_exp_text",
        "vocab_size": 248320,
        "eos_token_id": 248044,
        "hidden_size": 2560,
        "hc_count": 4,
        "ple_layer_ids": [2],
        "ple_embed_dim": 2560,
        "ple_conv_kernel_size": 4,
        "ngram_size": 3,
        "heads_per_ngram": 8,
        "ngram_vocab_size_base": base or 20_000_000,
        "make_ngram_vocab_size_divisible_by": 128,
        "split_ngram_parts": 128,
        "rms_norm_eps": 1e-6,
    }
    if seed is not None:
        text["seed"] = seed
    if fmt not in _QWEN_FORMAT_KEYS:
        raise ValueError(f"qwen3.8-flash-next ships bf16, fp8_e4m3 or nvfp4 tables, not {fmt}")
    extra = _QWEN_FORMAT_KEYS[fmt]
    text.update({k: v for k, v in extra.items() if k != "quantization_config"})
    cfg = {
        "model_type": "qwen4_exp",
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "text_config": text,
    }
    if "quantization_config" in extra:
        cfg["quantization_config"] = extra["quantization_config"]
    return cfg


def _engram_preset(fmt: str, base: int | None, seed: int | None) -> dict:
    if fmt != "fp8_ue8m0":
        raise ValueError(f"deepseek-v4.1-flash ships fp8_ue8m0 Engram tables, not {fmt}")
    cfg = {
        "model_type": "deepseek_v41",
        "architectures": ["DeepseekV41ForCausalLM"],
        "engram_layer_ids": [1, 14],
        "engram_max_ngram_size": 4,
        "engram_n_heads": 8,
        "engram_head_dim": 256,
        "engram_vocab_size": base or 16_000_000,
        "engram_compressed_vocab_size": 99092,
        "engram_pad_token_id": 2,
    }
    if base is None:
        cfg["engram_num_embeddings"] = [384006168, 384016682]
    return cfg


def _gemma_preset(model_type: str, layers: int, hidden: int):
    def make(fmt: str, base: int | None, seed: int | None) -> dict:
        # `base` scales the per-layer vocabulary (the table's rows) for small synthetic copies.
        text = {
            "model_type": f"{model_type}_text",
            "num_hidden_layers": layers,
            "hidden_size": hidden,
            "vocab_size": 262144,
            "vocab_size_per_layer_input": base or 262144,
            "hidden_size_per_layer_input": 256,
        }

        return {"model_type": model_type, "text_config": text}

    return make


@dataclass(frozen=True)
class Preset:
    """A named real model: its config (text part) and the formats its checkpoints ship."""

    name: str
    formats: tuple[str, ...]
    make: Any = field(repr=False)
    note: str = ""

    def config(
        self,
        format: str | None = None,
        ngram_vocab_size_base: int | None = None,
        seed: int | None = None,
    ) -> dict:
        fmt = get_format(format or self.formats[0]).name
        return self.make(fmt, ngram_vocab_size_base, seed)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "qwen3.8-flash-next",
            ("fp8_e4m3", "nvfp4", "bf16"),
            _qwen_preset,
            "Qwen3.8-Flash-Next PLE: 320,001,536 rows x 160, 128 shards",
        ),
        Preset(
            "deepseek-v4.1-flash",
            ("fp8_ue8m0",),
            _engram_preset,
            "DeepSeek-V4.1-Flash Engram: layers 1 and 14, 384M rows x 256 each",
        ),
        Preset(
            "gemma3n-e2b",
            ("bf16",),
            _gemma_preset("gemma3n", 30, 2048),
            "Gemma 3n E2B per-layer embeddings [262144, 30*256]",
        ),
        Preset(
            "gemma3n-e4b",
            ("bf16",),
            _gemma_preset("gemma3n", 35, 2048),
            "Gemma 3n E4B per-layer embeddings [262144, 35*256]",
        ),
        Preset(
            "gemma4-e2b",
            ("bf16",),
            _gemma_preset("gemma4", 35, 1536),
            "Gemma 4 E2B per-layer embeddings [262144, 35*256]",
        ),
        Preset(
            "gemma4-e4b",
            ("bf16",),
            _gemma_preset("gemma4", 42, 2560),
            "Gemma 4 E4B per-layer embeddings [262144, 42*256]",
        ),
    )
}


def preset_config(
    name: str,
    format: str | None = None,
    ngram_vocab_size_base: int | None = None,
    seed: int | None = None,
) -> dict:
    """The Hugging Face config of preset `name` (see PRESETS)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    p = PRESETS[name]
    fmt = get_format(format or p.formats[0]).name
    if fmt not in p.formats:
        raise ValueError(f"preset {name} ships {', '.join(p.formats)} tables, not {fmt}")
    return p.config(fmt, ngram_vocab_size_base, seed)
