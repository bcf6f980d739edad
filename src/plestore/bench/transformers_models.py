"""The models `plestore bench transformers` times: random-weight instances of the real
transformers classes — Gemma 3n / 4 at a preset's shapes, Qwen4Exp with the real n-gram table on a
small trunk — built on the device in bf16."""

from __future__ import annotations

import torch

GEMMA = ("gemma3n-e2b", "gemma3n-e4b", "gemma4-e2b", "gemma4-e4b")
# Gemma 3n config.json values the presets leave out (the text model's MLP and KV sharing)
_GEMMA3N = {
    "gemma3n-e2b": dict(
        intermediate_size=8192,
        num_kv_shared_layers=10,
        activation_sparsity_pattern=[0.95] * 10 + [0.0] * 20,
    ),
    "gemma3n-e4b": dict(
        intermediate_size=16384,
        num_kv_shared_layers=15,
        activation_sparsity_pattern=[0.95] * 10 + [0.0] * 25,
    ),
}


def tiny_gemma_text(family: str, **over) -> dict:
    """A tiny Gemma 3n / Gemma 4 text config (the CPU benchmark's and the tests'): 4 layers, the
    last two sharing KV, a 512-row per-layer table of 4 x 16 values. `over` replaces fields."""
    text = dict(
        vocab_size=512,
        vocab_size_per_layer_input=512,
        hidden_size=64,
        hidden_size_per_layer_input=16,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=128,
        num_kv_shared_layers=2,
        sliding_window=16,
        max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )
    if family == "gemma3n":
        text.update(laurel_rank=8, activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0])
    else:
        text.update(global_head_dim=32)
    text.update(over)
    return text


def _gemma(preset: str, tiny: bool):
    import transformers

    from plestore.spec import preset_config

    family = preset.split("-")[0]
    if tiny:
        text = tiny_gemma_text(family)
    else:
        cfg = preset_config(preset)
        text = {k: v for k, v in cfg["text_config"].items() if k != "model_type"}
        extra = _GEMMA3N.get(preset) or dict(intermediate_size=4 * text["hidden_size"])
        text.update(extra)
    if family == "gemma3n":
        return transformers.Gemma3nTextConfig(**text), transformers.Gemma3nForCausalLM
    return transformers.Gemma4TextConfig(**text), transformers.Gemma4ForCausalLM


def tiny_qwen_text(**over) -> dict:
    """A tiny Qwen4Exp text config (the CPU benchmark's and the tests'): 3 layers (2 linear
    attention + 1 indexed full), one PLE layer (2) of trigrams, 2 n-gram heads of 8 values.
    `over` replaces fields."""
    text = dict(
        vocab_size=300,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        hc_count=2,
        hc_lowrank=8,
        ple_layer_ids=[2],
        ple_embed_dim=2 * 8,  # (ngram_size - 1) * heads_per_ngram heads of 8 values
        ngram_size=3,
        heads_per_ngram=1,
        ngram_vocab_size_base=500,
        eos_token_id=5,
        pad_token_id=0,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=8,
        indexer_compress_ratio=4,
        layer_types=["linear_attention", "linear_attention", "full_attention"],  # 5.17 and 5.24
    )
    text.update(over)
    return text


def _qwen(a):
    import transformers

    if a.tiny:
        text = tiny_qwen_text()
    else:
        layers, heads = a.layers, 16  # n-gram heads: (ngram_size - 1) * heads_per_ngram
        text = tiny_qwen_text(
            vocab_size=248320,
            hidden_size=a.hidden_size,
            num_hidden_layers=layers,
            num_attention_heads=8,
            head_dim=128,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=8,
            linear_num_value_heads=8,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            num_experts=16,
            num_experts_per_tok=4,
            hc_count=4,
            hc_lowrank=64,
            ple_embed_dim=160 * heads,  # 160 values per row, as the real
            heads_per_ngram=heads // 2,
            ngram_vocab_size_base=a.ngram_vocab_size_base,
            eos_token_id=248044,
            indexer_head_dim=128,
            indexer_budget=2048,
            layer_types=["linear_attention"] * (layers - 1) + ["full_attention"],
        )
    return transformers.Qwen4ExpTextConfig(**text), transformers.Qwen4ExpForCausalLM


def build_model(a, device: torch.device):
    config, cls = _qwen(a) if a.model == "qwen4exp" else _gemma(a.model, a.tiny)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model = cls(config)
    finally:
        torch.set_default_dtype(default)
    model = model.to(torch.bfloat16).eval()
    if a.model == "qwen4exp":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("ngram_embedding.weight"):
                    p.normal_(0, 1.0)
                    step = 1 << 24  # rows at a time: no full-size temporaries
                    for i in range(0, p.shape[0] if a.fp8 else 0, step):
                        # e4m3 values in bf16: what transformers loads an FP8 table as
                        p[i : i + step] = p[i : i + step].to(torch.float8_e4m3fn).to(p.dtype)
                elif name.endswith("ple.conv1d.weight"):
                    p.normal_(0, 0.5)
    return model
