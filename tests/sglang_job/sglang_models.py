"""Tiny Qwen4-Exp checkpoints in the form SGLang 0.5.23 serves (its only native Qwen4-Exp class
is `Qwen4ExpForConditionalGeneration`): transformers' own Qwen4ExpForConditionalGeneration saved
with save_pretrained (model_type qwen4_exp, a nested text_config, `model.language_model.*`
tensors, a one-block vision tower), marked `language_model_only` as text-only checkpoints are,
so SGLang builds no vision tower and skips its tensors. Random weights (tests/qwen4exp_models
.build: PLE rows N(0, 1), the PLE convolution non-zero); bf16, or FP8 PLE shards + one global
scale as the real FP8 checkpoints ship them."""

from __future__ import annotations

import json
from pathlib import Path

import torch

EOS = 5
VOCAB = 300
NEW_TOKENS = 16
#: the FP8 checkpoints' table scale (not a power of two: bf16(scale) != scale)
FP8_SCALE = 0.0123
#: four concurrent prompts, EOS inside two (it restarts the n-gram context), one long
PROMPTS = [
    [11, 12, EOS, 17, 18, 19],
    [13, 14, 16, EOS, EOS, 12, 19, 29],
    [(i * 37) % VOCAB if i % 37 else EOS for i in range(1, 70)],
    [7, 8, EOS, 1],
]


def text_config(**over):
    """Two linear-attention layers, both with a PLE (ple_layer_ids are 1-based), trigrams of two
    heads of 8 values; GDN with 2 key heads and 4 value heads (grouped)."""
    from transformers import Qwen4ExpTextConfig

    layers = 2
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
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
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    kw.update(over)
    return Qwen4ExpTextConfig(**kw)


def _tiny_vision(out_hidden_size: int) -> dict:
    return dict(
        depth=1,
        hidden_size=16,
        intermediate_size=16,
        num_heads=2,
        patch_size=2,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=out_hidden_size,
        num_position_embeddings=16,
    )


def save_qwen(out: Path, fp8: bool = False, seed: int = 0, **over) -> Path:
    """The checkpoint directory `out`; `over` replaces text-config fields."""
    from qwen4exp_models import build  # (tests/: on sys.path, see conftest.py)
    from transformers import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

    text = build(text_config(**over), dtype=torch.bfloat16, seed=seed)
    config = Qwen4ExpConfig(
        text_config=text.config.to_dict(),
        vision_config=_tiny_vision(text.config.hidden_size),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed + 1)
    model = Qwen4ExpForConditionalGeneration(config).eval()
    with torch.no_grad():
        missing, unexpected = model.model.language_model.load_state_dict(
            text.model.state_dict(), strict=False
        )
        assert not unexpected and not missing, (missing, unexpected)
        model.lm_head.weight.copy_(text.lm_head.weight)
    model = model.to(torch.bfloat16)
    if fp8:
        from qwen4exp_models import write_fp8_checkpoint

        write_fp8_checkpoint(model, out, scale=FP8_SCALE)
        _scale_as_vector(out)
    else:
        model.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["language_model_only"] = True
    if fp8:  # the table's dtype is a text_config field (SGLang reads it there)
        cfg["text_config"]["ple_embedding_dtype"] = cfg.pop("ple_embedding_dtype")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def _scale_as_vector(out: Path) -> None:
    """The FP8 table scales as shape [1]: SGLang 0.5.23 loads `ngram_embedding.weight_scale`
    into a bf16 [1] buffer and refuses the scalar the FP8 checkpoints are described with
    ("Shape mismatch ... expected (1,), got ()", _load_qwen4_exp_ple_buffer)."""
    from safetensors.torch import load_file, save_file

    for f in sorted(out.glob("*.safetensors")):
        tensors = load_file(f)
        for k, v in tensors.items():
            if k.endswith(".ngram_embedding.weight_scale"):
                tensors[k] = v.reshape(1)
        save_file(tensors, f, metadata={"format": "pt"})


def reference_model(model_dir: Path, dtype=torch.float32):
    """transformers' model of the checkpoint, for the greedy reference. An FP8 checkpoint's
    tables are dequantized as SGLang does, bf16(row) * bf16(scale) in bf16 (transformers
    5.19 loads the e4m3 rows and leaves the scale out: "UNEXPECTED")."""
    from safetensors import safe_open
    from transformers import Qwen4ExpForConditionalGeneration

    model = Qwen4ExpForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).eval()
    scales = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for k in st.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                if k.endswith(".ngram_embedding.weight_scale"):
                    scales[k.removesuffix("_scale")] = st.get_tensor(k).bfloat16()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, scale in scales.items():
            table = params[name]
            fp8 = table.to(torch.float8_e4m3fn)
            assert torch.equal(fp8.to(table.dtype), table), name  # (loaded e4m3, unscaled)
            table.copy_(fp8.bfloat16() * scale)
    return model


def greedy_ties(model, prompts, tokens) -> tuple[int, list]:
    """Teacher-force an engine's tokens through the transformers model (no cache): (tokens
    checked, [(prompt, step, engine's token, transformers' argmax, logit gap)] where they
    differ)."""
    checked, ties = 0, []
    with torch.no_grad():
        for i, (p, gen) in enumerate(zip(prompts, tokens, strict=True)):
            for step, tok in enumerate(gen):
                ids = torch.tensor([list(p) + list(gen[:step])])
                logits = model(input_ids=ids, use_cache=False).logits[0, -1].float()
                best = int(logits.argmax())
                checked += 1
                if best != tok:
                    ties.append((i, step, tok, best, float(logits[best] - logits[tok])))
    return checked, ties
