"""Tiny Gemma 3n / Gemma 4 models of the real transformers classes (text-only and
multimodal) and the comparison helpers the Gemma integration tests share."""

from __future__ import annotations

import contextlib
from functools import cache
from unittest import mock

import pytest
import torch
from torch import nn

from conftest import assert_bit_identical

transformers = pytest.importorskip("transformers")

from plestore.bench.transformers_models import tiny_gemma_text  # noqa: E402
from plestore.integrations.transformers import (  # noqa: E402
    PerLayerEmbedding,
)

TIERS = ["device", "pinned", "mapped", "direct"]
KINDS = ["gemma3n-text", "gemma3n-mm", "gemma4-text", "gemma4-mm"]
PER_LAYER_ROWS = 256
# Gemma 3n: a text vocabulary larger than the per-layer one, so prompts and generated tokens
# include ids >= 256 that transformers maps to row 0. Gemma 4 would raise IndexError on those
# (it maps nothing), so its tiny vocabulary equals the per-layer one, as in the real configs.
VOCAB = {"gemma3n": 400, "gemma4": PER_LAYER_ROWS}


@cache
def _stock_text_masks() -> bool:
    """Does this transformers' Gemma 3n text model map per-layer ids >= vocab_size_per_layer_input
    to row 0 itself? (5.24 does; 5.17 left it to the multimodal model, and its text-only model
    raised IndexError.) plestore maps them to 0 in both: the stock result where it has one."""
    model = build("gemma3n-text", vocab_size=VOCAB["gemma3n"])
    try:
        with torch.no_grad():
            model.model.get_per_layer_inputs(torch.tensor([[PER_LAYER_ROWS + 1]]))
    except IndexError:
        return False
    return True


def _vocab(kind: str) -> int:
    """Text vocabulary of the tiny model: where the stock text-only model cannot take ids past
    the per-layer table, prompts and generated tokens must stay inside it."""
    family = kind.partition("-")[0]
    if kind == "gemma3n-text" and not _stock_text_masks():
        return PER_LAYER_ROWS
    return VOCAB[family]


MM_IDS = dict(image_token_id=250, video_token_id=251, audio_token_id=252)


def _text_kwargs(family: str, vocab: int, **over) -> dict:
    return tiny_gemma_text(
        family,
        vocab_size=vocab,
        vocab_size_per_layer_input=PER_LAYER_ROWS,
        hidden_size=96,  # != 4 layers x 16: no other weight has the per-layer table's shape
        max_position_embeddings=128,
        **over,
    )


@contextlib.contextmanager
def _gemma3n_vision_stub():
    """Gemma 3n's vision tower is a timm MobileNet (timm + Pillow are not test dependencies);
    the text path never calls it, so a stub stands in unless timm is installed."""
    from transformers.models.gemma3n import modeling_gemma3n as m3

    try:
        import timm  # noqa: F401

        yield
        return
    except ImportError:
        pass
    real = m3.AutoModel.from_config

    def from_config(config, *args, **kwargs):
        if config.model_type == "gemma3n_vision":
            stub = nn.Module()
            stub.config = config
            return stub
        return real(config, *args, **kwargs)

    with mock.patch.object(m3.AutoModel, "from_config", side_effect=from_config):
        yield


def _config(kind: str, **text_over):
    family, _, variant = kind.partition("-")
    vocab = text_over.pop("vocab_size") if "vocab_size" in text_over else _vocab(kind)
    text = _text_kwargs(family, vocab, **text_over)
    if family == "gemma3n":
        if variant == "text":
            return transformers.Gemma3nTextConfig(**text)
        return transformers.Gemma3nConfig(
            text_config=text,
            vision_config=dict(hidden_size=32, vocab_size=8, vocab_offset=384),
            audio_config=dict(
                hidden_size=32,
                conf_num_hidden_layers=1,
                conf_num_attention_heads=2,
                sscp_conv_channel_size=[8, 8],
                input_feat_size=16,
                vocab_size=8,
                vocab_offset=392,
            ),
            image_token_id=390,  # above vocab_size_per_layer_input, as in the real model
            audio_token_id=398,
            boi_token_id=380,
            eoi_token_id=384,
            boa_token_id=381,
            eoa_token_id=392,
        )
    if variant == "text":
        return transformers.Gemma4TextConfig(**text)
    return transformers.Gemma4Config(
        text_config=text,
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
            position_embedding_size=64,
        ),
        audio_config=dict(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            subsampling_conv_channels=[8, 8],
            output_proj_dims=32,
        ),
        boi_token_id=253,
        eoi_token_id=254,
        boa_token_id=255,
        eoa_token_index=249,
        **MM_IDS,
    )


def _model_class(kind: str):
    family, _, variant = kind.partition("-")
    name = {"gemma3n": "Gemma3n", "gemma4": "Gemma4"}[family]
    suffix = "ForCausalLM" if variant == "text" else "ForConditionalGeneration"
    return getattr(transformers, name + suffix)


def build(kind: str, device: str = "cpu", seed: int = 0, dtype=torch.bfloat16, **text_over):
    """A tiny random-weight model, deterministic in `seed`, in eval mode."""
    config = _config(kind, **text_over)  # first: it may build a probe model (_vocab)
    torch.manual_seed(seed)
    with _gemma3n_vision_stub():
        model = _model_class(kind)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Gemma 3n initialises AltUp's output scale to 0, which multiplies the per-layer
            # path away entirely (test_tiny_models_use_their_per_layer_table guards this)
            if name.endswith("correct_output_scale"):
                p.normal_(1.0, 0.1)
    return model.to(device=device, dtype=dtype).eval()


def _inputs(kind: str, batch: int, device: str, seed: int = 1):
    """Batch 1: one prompt. Batch 3: left-padded prompts of 9, 6 and 4 tokens + a mask."""
    g = torch.Generator().manual_seed(seed)
    lengths = [7] if batch == 1 else [9, 6, 4]
    width = max(lengths)
    ids = torch.zeros((batch, width), dtype=torch.long)  # pad_token_id = 0
    mask = torch.zeros((batch, width), dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, width - n :] = torch.randint(3, _vocab(kind), (n,), generator=g)
        mask[b, width - n :] = 1
    return ids.to(device), mask.to(device)


GEN = dict(max_new_tokens=6, do_sample=False, min_new_tokens=6)


@torch.no_grad()
def _outputs(model, ids, mask):
    logits = model(input_ids=ids, attention_mask=mask).logits
    gen = model.generate(
        ids, attention_mask=mask, output_logits=True, return_dict_in_generate=True, **GEN
    )
    return logits, gen.sequences, torch.stack(gen.logits)


@cache
def _stock(kind: str, device: str):
    """The untouched model's outputs for batch 1 and 3 (computed once per kind and device)."""
    model = build(kind, device)
    return {b: _outputs(model, *_inputs(kind, b, device)) for b in (1, 3)}


def _assert_same_outputs(model, kind: str, device: str) -> None:
    for batch, (logits, seqs, step_logits) in _stock(kind, device).items():
        got_logits, got_seqs, got_steps = _outputs(model, *_inputs(kind, batch, device))
        assert torch.equal(got_seqs, seqs), f"batch {batch}: greedy tokens differ"
        assert_bit_identical(got_logits, logits)
        assert_bit_identical(got_steps, step_logits)


def _snapshot(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_untouched(model, before: dict) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    modules = [m for n, m in model.named_modules() if n.endswith("embed_tokens_per_layer")]
    assert modules and not isinstance(modules[0], PerLayerEmbedding)


def _ple(model) -> nn.Module:
    return next(m for n, m in model.named_modules() if n.endswith("embed_tokens_per_layer"))


@pytest.fixture(scope="module")
def table_dirs(tmp_path_factory):
    """One table directory per (model kind, device): the first tier packs, the others reuse."""
    return cache(lambda kind, device: tmp_path_factory.mktemp(f"{kind}-{device}"))
