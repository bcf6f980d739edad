"""Tiny Qwen4Exp models of the real transformers classes, and their real checkpoints, for the
transformers-integration tests: random weights (the PLE convolution too, which transformers
initialises to zero), bf16 / float32, and FP8 checkpoints written as the real ones are
(`ngram_embedding.shard_{i}.weight` F8_E4M3 + `ngram_embedding.weight_scale`,
`ple_embedding_dtype: float8_e4m3fn`)."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import torch

EOS = 5
VOCAB = 300
#: (ple_layer_ids, ngram_size): two PLE layers with trigrams, one (on layer 2) with 4-grams
CONFIGS = {"two-layers-n3": ([1, 2], 3), "one-layer-n4": ([2], 4)}


def tiny_config(ple_layer_ids=(1, 2), ngram_size=3, **over):
    from transformers import Qwen4ExpTextConfig

    from plestore.bench.transformers_models import tiny_qwen_text

    kw = dict(
        vocab_size=VOCAB,
        eos_token_id=EOS,
        ple_layer_ids=list(ple_layer_ids),
        ple_embed_dim=(ngram_size - 1) * 2 * 8,  # 8 values per head
        ngram_size=ngram_size,
        heads_per_ngram=2,
        make_ngram_vocab_size_divisible_by=16,
        split_ngram_parts=4,
    )
    kw.update(over)
    return Qwen4ExpTextConfig(**tiny_qwen_text(**kw))


def build(config, dtype=torch.float32, seed=0):
    """A Qwen4ExpForCausalLM with random weights: the PLE rows N(0, 1) and the PLE convolution
    non-zero, so every row a step reads moves the logits."""
    from transformers import Qwen4ExpForCausalLM

    torch.manual_seed(seed)
    model = Qwen4ExpForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ple.conv1d.weight"):
                p.normal_(0, 0.5)
            elif name.endswith("ngram_embedding.weight"):
                p.normal_(0, 1.0)
    return model.to(dtype)


def prompts():
    """Batch 3, left-padded, EOS inside two prompts: ids [3, 8] and the attention mask."""
    ids = torch.tensor(
        [
            [0, 0, 11, 12, EOS, 17, 18, 19],
            [13, 14, 16, EOS, EOS, 12, 19, 29],
            [0] * 4 + [7, 8, EOS, 1],
        ]
    )
    mask = torch.tensor([[0, 0] + [1] * 6, [1] * 8, [0] * 4 + [1] * 4])
    return ids, mask


def _cache_kw() -> str:
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    names = {f.name for f in fields(GenerateDecoderOnlyOutput)}
    return "cache" if "cache" in names else "past_key_values"  # 5.24 / 5.17


@torch.no_grad()
def run(model, new_tokens=20, more=6):
    """Greedy generate (new_tokens), then a second generate continuing from the returned cache
    with three more prompt tokens (an EOS among them). Returns (sequences, per-step logits)."""
    device = next(model.parameters()).device
    ids, mask = (t.to(device) for t in prompts())
    kw = dict(do_sample=False, return_dict_in_generate=True, output_logits=True)
    first = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, **kw)
    key = _cache_kw()
    extra = torch.tensor([[EOS, 21, 22]] * ids.shape[0], device=device)
    seq = torch.cat([first.sequences, extra], 1)
    pad = torch.ones(ids.shape[0], seq.shape[1] - ids.shape[1], dtype=mask.dtype, device=device)
    mask2 = torch.cat([mask, pad], 1)
    second = model.generate(
        seq, attention_mask=mask2, max_new_tokens=more, **{key: getattr(first, key)}, **kw
    )
    return second.sequences, list(first.logits) + list(second.logits)


def write_fp8_checkpoint(model, out: Path, scale: float = 2.0**-4) -> Path:
    """save_pretrained, then the PLE shards rewritten as the FP8 checkpoints ship them: e4m3
    shards + one table scale, config `ple_embedding_dtype: float8_e4m3fn`; other weights bf16."""
    from safetensors.torch import load_file, save_file

    model.save_pretrained(out)
    files = sorted(out.glob("*.safetensors"))
    for f in files:
        tensors = load_file(f)
        for k in list(tensors):
            v = tensors[k]
            if ".ngram_embedding.shard_" in k:
                q = (v.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
                tensors[k] = q
                tensors[k.split(".shard_")[0] + ".weight_scale"] = torch.tensor(scale)
            elif v.is_floating_point():
                tensors[k] = v.to(torch.bfloat16)
        save_file(tensors, f, metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.exists():
        idx = json.loads(index.read_text())
        for k, f in list(idx["weight_map"].items()):
            if ".ngram_embedding.shard_0." in k:
                idx["weight_map"][k.split(".shard_")[0] + ".weight_scale"] = f
        index.write_text(json.dumps(idx))
    cfg = json.loads((out / "config.json").read_text())
    cfg["ple_embedding_dtype"] = "float8_e4m3fn"
    cfg["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg))
    return out
