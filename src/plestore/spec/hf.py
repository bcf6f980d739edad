"""Hugging Face `config.json` -> table specs, as the engines read it (nested `text_config`
wins; the format from `ple_embedding_dtype` or the quantization config)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from plestore.formats import get_format
from plestore.spec.hashspec import EngramHashSpec, IdentityHashSpec, Qwen4ExpHashSpec
from plestore.spec.table import ShardLayout, TableSpec

__all__ = ["load_hf_config", "merged_text_config", "table_specs_from_hf_config"]


def load_hf_config(config: str | Path | dict) -> dict:
    if isinstance(config, dict):
        return config
    p = Path(config)
    if p.is_dir():
        p = p / "config.json"
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"no config.json at {p}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{p} is not valid JSON: {e}") from None


def merged_text_config(cfg: dict) -> dict:
    """Merged view: nested text_config keys win over top-level ones (as the engines do)."""
    text = cfg.get("text_config") or {}
    merged = {k: v for k, v in cfg.items() if k != "text_config"}
    merged.update(text)
    return merged


def _require(cfg: dict, key: str, family: str) -> Any:
    if key not in cfg:
        raise ValueError(f"{family} config lacks the key {key!r}")
    return cfg[key]


def _qwen_format(cfg: dict) -> str:
    """Table format the engines would load: ple_embedding_dtype, then the quantization config."""
    dtype = cfg.get("ple_embedding_dtype")
    if dtype:
        return get_format(dtype).name
    q = cfg.get("quantization_config") or {}
    method = str(q.get("quant_method", "")).lower()
    ignored = " ".join(
        map(str, q.get("ignore", []) + q.get("ignored_layers", []) + q.get("exclude_modules", []))
    )
    if "ngram_embedding" in ignored:
        return "bf16"
    if method == "fp8":
        return "fp8_e4m3"
    if method == "modelopt":
        algo = str(q.get("quant_algo", "")).upper()
        if algo == "NVFP4":
            return "nvfp4"
        if algo == "FP8":
            return "fp8_e4m3"
        if algo == "MIXED_PRECISION":
            for name, entry in (q.get("quantized_layers") or {}).items():
                if "ngram_embedding" in name or name.endswith(".ple") or ".ple." in name:
                    return {"FP8": "fp8_e4m3", "NVFP4": "nvfp4"}.get(
                        str(entry.get("quant_algo", "")).upper(), "bf16"
                    )
    return "bf16"


def _qwen_specs(cfg: dict, fmt: str | None) -> list[TableSpec]:
    fam = "qwen4_exp"
    layer_ids = sorted(set(_require(cfg, "ple_layer_ids", fam)))
    vocab = _require(cfg, "vocab_size", fam)
    eos = _require(cfg, "eos_token_id", fam)
    if isinstance(eos, list):
        eos = eos[0]
    ngram = cfg.get("ngram_size", 3)
    hpn = cfg.get("heads_per_ngram", 8)
    heads = (ngram - 1) * hpn
    embed_dim = cfg.get("ple_embed_dim") or _require(cfg, "hidden_size", fam)
    if embed_dim % heads:
        raise ValueError(f"ple_embed_dim {embed_dim} is not divisible by {heads} n-gram heads")
    parts = cfg.get("split_ngram_parts", 512)
    fmt = get_format(fmt).name if fmt else _qwen_format(cfg)
    specs = []
    for d, lid in enumerate(layer_ids):
        h = Qwen4ExpHashSpec(
            vocab_size=vocab,
            eos_token_id=eos,
            ngram_size=ngram,
            heads_per_ngram=hpn,
            ngram_vocab_size_base=cfg.get("ngram_vocab_size_base", 20_000_000),
            seed=cfg.get("seed", 1234),
            layer_index=d,
            pad_multiple=cfg.get("make_ngram_vocab_size_divisible_by", 128),
        )
        layer = lid - 1  # ple_layer_ids are 1-based decoder layers
        specs.append(
            TableSpec(
                name=f"ple.layers.{layer}",
                rows=h.num_rows,
                dim=embed_dim // heads,
                format=fmt,
                heads=heads,
                shards=ShardLayout(-(-h.num_rows // parts), parts),
                hash=h,
                tensor=f"model.language_model.layers.{layer}.ple.ple_embedding.ngram_embedding",
            )
        )
    return specs


def _engram_specs(cfg: dict, fmt: str | None) -> list[TableSpec]:
    fam = "engram"
    layer_ids = tuple(_require(cfg, "engram_layer_ids", fam))
    specs = []
    for pos, lid in enumerate(layer_ids):
        h = EngramHashSpec(
            layer_ids=layer_ids,
            layer_position=pos,
            compressed_vocab_size=_require(cfg, "engram_compressed_vocab_size", fam),
            pad_token_id=cfg.get("engram_pad_token_id", 2),
            max_ngram_size=cfg.get("engram_max_ngram_size", 4),
            n_heads=cfg.get("engram_n_heads", 8),
            vocab_size=_require(cfg, "engram_vocab_size", fam),
        )
        declared = cfg.get("engram_num_embeddings")
        if declared is not None and declared[pos] != h.num_rows:
            raise ValueError(
                f"engram layer {lid}: engram_num_embeddings says {declared[pos]} rows, the "
                f"primes give {h.num_rows}"
            )
        specs.append(
            TableSpec(
                name=f"engram.layers.{lid}",
                rows=h.num_rows,
                dim=_require(cfg, "engram_head_dim", fam),
                format=fmt or "fp8_ue8m0",
                heads=h.heads,
                hash=h,
                tensor=f"model.layers.{lid}.engram.embed",
            )
        )
    return specs


def _gemma_specs(cfg: dict, fmt: str | None) -> list[TableSpec]:
    fam = "gemma"
    layers = _require(cfg, "num_hidden_layers", fam)
    per_layer = _require(cfg, "hidden_size_per_layer_input", fam)
    vocab = _require(cfg, "vocab_size_per_layer_input", fam)
    h = IdentityHashSpec(vocab_size=vocab)
    return [
        TableSpec(
            name="embed_tokens_per_layer",
            rows=vocab,
            dim=layers * per_layer,
            format=fmt or "bf16",
            heads=1,
            hash=h,
            tensor="model.language_model.embed_tokens_per_layer",
        )
    ]


def table_specs_from_hf_config(
    config: str | Path | dict, format: str | None = None
) -> list[TableSpec]:
    """Every offloadable table a Hugging Face config describes (Qwen4Exp PLE layers, Engram
    layers, or the Gemma 3n/4 per-layer embedding). `format` overrides the stored format."""
    cfg = merged_text_config(load_hf_config(config))
    if cfg.get("ple_layer_ids"):
        return _qwen_specs(cfg, format)
    if cfg.get("engram_layer_ids"):
        return _engram_specs(cfg, format)
    if "vocab_size_per_layer_input" in cfg:
        return _gemma_specs(cfg, format)
    raise ValueError(
        "config describes no plestore table: expected ple_layer_ids (Qwen4Exp), "
        "engram_layer_ids (DeepSeek Engram) or vocab_size_per_layer_input (Gemma 3n/4)"
    )
