"""Hugging Face `config.json` -> table specs, as the engines read it (nested `text_config`
wins; the format from `ple_embedding_dtype` or the quantization config)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plestore.formats import get_format
from plestore.io.jsonfile import read_json
from plestore.spec.hashspec import (
    MAX_FIELD,
    MAX_HASH_PRIMES,
    MAX_NGRAM,
    EngramHashSpec,
    IdentityHashSpec,
    Qwen4ExpHashSpec,
)

__all__ = ["load_hf_config", "merged_text_config", "table_fields_from_hf_config"]


def load_hf_config(config: str | Path | dict) -> dict:
    if isinstance(config, dict):
        return config
    p = Path(config)
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = read_json(p)
    except FileNotFoundError:
        raise ValueError(f"no config.json at {p}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{p} is not a config: a JSON object is expected")
    return cfg


def merged_text_config(cfg: dict) -> dict:
    """Merged view: nested text_config keys win over top-level ones (as the engines do)."""
    if not isinstance(cfg, dict):
        raise ValueError(f"a config is a JSON object, got {type(cfg).__name__}")
    text = cfg.get("text_config") or {}
    if not isinstance(text, dict):
        raise ValueError(f"text_config must be an object, got {type(text).__name__}")
    merged = {k: v for k, v in cfg.items() if k != "text_config"}
    merged.update(text)
    return merged


_MISSING = object()


def _require(cfg: dict, key: str, family: str) -> Any:
    if cfg.get(key) is None:
        raise ValueError(f"{family} config lacks the key {key!r}")
    return cfg[key]


def _int(
    cfg: dict, key: str, family: str, default: Any = _MISSING, lo: int = 0, hi: int = MAX_FIELD
) -> int:
    """cfg[key] (or `default` when absent or null) as an int in [lo, hi]."""
    v = _require(cfg, key, family) if default is _MISSING or cfg.get(key) is not None else default
    if type(v) is not int or not lo <= v <= hi:
        raise ValueError(f"{family} config: {key} must be an int in [{lo}, {hi}], got {v!r}"[:200])
    return v


def _ints(cfg: dict, key: str, family: str, lo: int = 0) -> list[int]:
    """cfg[key] as a non-empty list of at most MAX_HASH_PRIMES ints in [lo, MAX_FIELD]."""
    v = _require(cfg, key, family)
    if not isinstance(v, list) or not v or len(v) > MAX_HASH_PRIMES:
        raise ValueError(
            f"{family} config: {key} must be a list of 1 to {MAX_HASH_PRIMES} ints, got {v!r}"[:200]
        )
    if not all(type(x) is int and lo <= x <= MAX_FIELD for x in v):
        raise ValueError(f"{family} config: {key} must hold ints >= {lo}, got {v!r}"[:200])
    return v


def _list(q: dict, key: str) -> list:
    v = q.get(key) or []
    if not isinstance(v, list):
        raise ValueError(f"quantization_config.{key} must be a list, got {v!r}"[:200])
    return v


def _qwen_format(cfg: dict) -> str:
    """Table format the engines would load: ple_embedding_dtype, then the quantization config."""
    dtype = cfg.get("ple_embedding_dtype")
    if dtype:
        if not isinstance(dtype, str):
            raise ValueError(f"ple_embedding_dtype must be a string, got {dtype!r}")
        return get_format(dtype).name
    q = cfg.get("quantization_config") or {}
    if not isinstance(q, dict):
        raise ValueError(f"quantization_config must be an object, got {type(q).__name__}")
    method = str(q.get("quant_method", "")).lower()
    ignored = " ".join(
        map(str, _list(q, "ignore") + _list(q, "ignored_layers") + _list(q, "exclude_modules"))
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
            layers = q.get("quantized_layers") or {}
            if not isinstance(layers, dict):
                raise ValueError("quantization_config.quantized_layers must be an object")
            for name, entry in layers.items():
                if "ngram_embedding" in name or name.endswith(".ple") or ".ple." in name:
                    algo = entry.get("quant_algo", "") if isinstance(entry, dict) else ""
                    return {"FP8": "fp8_e4m3", "NVFP4": "nvfp4"}.get(str(algo).upper(), "bf16")
    return "bf16"


def _qwen_specs(cfg: dict, fmt: str | None) -> list[dict]:
    fam = "qwen4_exp"
    layer_ids = sorted(set(_ints(cfg, "ple_layer_ids", fam, lo=1)))
    vocab = _int(cfg, "vocab_size", fam, lo=1)
    eos = _require(cfg, "eos_token_id", fam)
    if isinstance(eos, list) and eos:
        eos = eos[0]
    if type(eos) is not int:
        raise ValueError(f"{fam} config: eos_token_id must be an int or a list of ints")
    ngram = _int(cfg, "ngram_size", fam, 3, lo=2, hi=MAX_NGRAM)
    hpn = _int(cfg, "heads_per_ngram", fam, 8, lo=1, hi=MAX_HASH_PRIMES)
    heads = (ngram - 1) * hpn
    if cfg.get("ple_embed_dim"):
        embed_dim = _int(cfg, "ple_embed_dim", fam, lo=1)
    else:
        embed_dim = _int(cfg, "hidden_size", fam, lo=1)
    if embed_dim % heads:
        raise ValueError(f"ple_embed_dim {embed_dim} is not divisible by {heads} n-gram heads")
    if len(layer_ids) * heads > MAX_HASH_PRIMES:  # the last layer's hash needs them all
        raise ValueError(
            f"{fam} config: {len(layer_ids)} ple_layer_ids x {heads} heads need "
            f"{len(layer_ids) * heads} primes, more than the {MAX_HASH_PRIMES} any real model needs"
        )
    parts = _int(cfg, "split_ngram_parts", fam, 512, lo=1)
    fmt = get_format(fmt).name if fmt else _qwen_format(cfg)
    specs = []
    for d, lid in enumerate(layer_ids):
        h = Qwen4ExpHashSpec(
            vocab_size=vocab,
            eos_token_id=eos,
            ngram_size=ngram,
            heads_per_ngram=hpn,
            ngram_vocab_size_base=_int(cfg, "ngram_vocab_size_base", fam, 20_000_000, lo=1),
            seed=_int(cfg, "seed", fam, 1234, hi=2**63 - 1),
            layer_index=d,
            pad_multiple=_int(cfg, "make_ngram_vocab_size_divisible_by", fam, 128, lo=1),
        )
        layer = lid - 1  # ple_layer_ids are 1-based decoder layers
        specs.append(
            dict(
                name=f"ple.layers.{layer}",
                rows=h.num_rows,
                dim=embed_dim // heads,
                format=fmt,
                heads=heads,
                shards=(-(-h.num_rows // parts), parts),  # ShardLayout(rows per shard, shards)
                hash=h,
                tensor=f"model.language_model.layers.{layer}.ple.ple_embedding.ngram_embedding",
            )
        )
    return specs


def _engram_specs(cfg: dict, fmt: str | None) -> list[dict]:
    fam = "engram"
    layer_ids = tuple(_ints(cfg, "engram_layer_ids", fam))
    declared = cfg.get("engram_num_embeddings")
    if declared is not None and (not isinstance(declared, list) or len(declared) != len(layer_ids)):
        raise ValueError(
            f"engram_num_embeddings must list one row count per layer of {list(layer_ids)}, got "
            f"{declared!r}"[:200]
        )
    specs = []
    for pos, lid in enumerate(layer_ids):
        h = EngramHashSpec(
            layer_ids=layer_ids,
            layer_position=pos,
            compressed_vocab_size=_int(cfg, "engram_compressed_vocab_size", fam, lo=1),
            pad_token_id=_int(cfg, "engram_pad_token_id", fam, 2),
            max_ngram_size=_int(cfg, "engram_max_ngram_size", fam, 4, lo=2, hi=MAX_NGRAM),
            n_heads=_int(cfg, "engram_n_heads", fam, 8, lo=1, hi=MAX_HASH_PRIMES),
            vocab_size=_int(cfg, "engram_vocab_size", fam, lo=1),
        )
        if declared is not None and declared[pos] != h.num_rows:
            raise ValueError(
                f"engram layer {lid}: engram_num_embeddings says {declared[pos]} rows, the "
                f"primes give {h.num_rows}"
            )
        specs.append(
            dict(
                name=f"engram.layers.{lid}",
                rows=h.num_rows,
                dim=_int(cfg, "engram_head_dim", fam, lo=1),
                format=fmt or "fp8_ue8m0",
                heads=h.heads,
                hash=h,
                tensor=f"model.layers.{lid}.engram.embed",
            )
        )
    return specs


def _gemma_specs(cfg: dict, fmt: str | None) -> list[dict]:
    fam = "gemma"
    layers = _int(cfg, "num_hidden_layers", fam, lo=1, hi=1 << 16)
    per_layer = _int(cfg, "hidden_size_per_layer_input", fam, lo=1, hi=1 << 20)
    vocab = _int(cfg, "vocab_size_per_layer_input", fam, lo=1)
    h = IdentityHashSpec(vocab_size=vocab)
    return [
        dict(
            name="embed_tokens_per_layer",
            rows=vocab,
            dim=layers * per_layer,
            format=fmt or "bf16",
            heads=1,
            hash=h,
            tensor="model.language_model.embed_tokens_per_layer",
        )
    ]


def table_fields_from_hf_config(config: str | Path | dict, format: str | None = None) -> list[dict]:
    """The TableSpec fields of every offloadable table a Hugging Face config describes (Qwen4Exp
    PLE layers, Engram layers, or the Gemma 3n/4 per-layer embedding); `format` overrides the
    stored format. `plestore.spec.table_specs_from_hf_config` makes them TableSpecs."""
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
