"""Tiny checkpoints of the real transformers classes that vLLM's CPU build runs, saved with
save_pretrained: Qwen4Exp (two PLE layers, bf16 or FP8 shards + a global scale, every layer
linear attention: vLLM's CPU build has no QSA and its CPU GDN kernel takes head dims of 128) and
Gemma 3n (text-only, a per-layer vocabulary smaller than the text one)."""

from __future__ import annotations

from pathlib import Path

import torch
from qwen4exp_models import build, write_fp8_checkpoint  # (tests/: on the path by its conftest)

EOS = 5
QWEN_VOCAB = 300
#: prompts: EOS inside two, one longer than max_num_batched_tokens (chunked prefill)
PROMPTS = [
    [11, 12, EOS, 17, 18, 19],
    [13, 14, 16, EOS, EOS, 12, 19, 29],
    [(i * 37) % QWEN_VOCAB if i % 37 else EOS for i in range(1, 150)],
    [7, 8, EOS, 1],
]
GEMMA_PROMPTS = [[2, 11, 12, 200, 17, 40], [2, 13, 14, 16, 160, 19, 29, 255], [2, 7, 8, 9]]


def qwen_config(**over):
    from transformers import Qwen4ExpTextConfig

    layers = 2
    kw = dict(
        vocab_size=QWEN_VOCAB,
        hidden_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        hc_count=2,
        hc_lowrank=8,
        ple_layer_ids=[1, 2],
        ple_embed_dim=2 * 2 * 8,  # (ngram_size - 1) * heads_per_ngram heads of 8 values
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=500,
        make_ngram_vocab_size_divisible_by=16,
        split_ngram_parts=4,
        eos_token_id=EOS,
        pad_token_id=0,
        layer_types=["linear_attention"] * layers,
        output_gate_type="silu",
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    kw.update(over)
    return Qwen4ExpTextConfig(**kw)


def save_qwen(out: Path, fp8: bool = False, seed: int = 0, **over) -> Path:
    """A bf16 Qwen4ExpForCausalLM checkpoint with random weights (tests/qwen4exp_models.build);
    `fp8`: its PLE shards e4m3 with one global scale, as the real FP8 checkpoints ship them
    (`ple_embedding_dtype: float8_e4m3fn`), the scale not a power of two: vLLM multiplies by
    bf16(scale), so the table must too."""
    model = build(qwen_config(**over), dtype=torch.bfloat16, seed=seed)
    if fp8:
        return write_fp8_checkpoint(model, out, scale=0.0123)
    model.save_pretrained(out)
    return out


def save_gemma(out: Path, seed: int = 0) -> Path:
    """A float32 Gemma3nForCausalLM checkpoint (vocab 256 = its per-layer vocab: transformers
    5.19's text-only model raises on ids past the per-layer table) with its per-layer table in
    bf16, as the real checkpoints store it."""
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    from plestore.bench.transformers_models import tiny_gemma_text

    cfg = Gemma3nTextConfig(
        **tiny_gemma_text(
            "gemma3n",
            vocab_size=256,
            vocab_size_per_layer_input=256,
            hidden_size=128,
            max_position_embeddings=512,
        )
    )
    torch.manual_seed(seed)
    model = Gemma3nForCausalLM(cfg).eval()
    with torch.no_grad():
        table = model.model.embed_tokens_per_layer.weight
        table.copy_(torch.randn_like(table).to(torch.bfloat16))
    model.save_pretrained(out)
    _table_in_bf16(out)
    return out


def _table_in_bf16(out: Path) -> None:
    from safetensors.torch import load_file, save_file

    for f in sorted(out.glob("*.safetensors")):
        tensors = load_file(f)
        for k in tensors:
            if k.endswith("embed_tokens_per_layer.weight"):
                tensors[k] = tensors[k].to(torch.bfloat16)
        save_file(tensors, f, metadata={"format": "pt"})
