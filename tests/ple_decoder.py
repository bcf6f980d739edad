"""The reference decoder the model and distributed tests run: a small synthetic checkpoint's PLE
layer (layer 1) over any table — one process's, or one sharded over a group."""

from __future__ import annotations

from plestore.checkpoint import Checkpoint
from plestore.hashing import Qwen4ExpHash
from plestore.models import DecoderConfig, ReferenceDecoder, load_ple_weights


def small_decoder(ckpt_dir, table, device, **cfg_kw) -> ReferenceDecoder:
    ck = Checkpoint.open(ckpt_dir)
    weights, prefix = load_ple_weights(ck, 1)
    ngram = Qwen4ExpHash.from_hf_config(ck.config)
    cfg = DecoderConfig(
        vocab_size=ngram.spec.vocab_size,
        eos_token_id=ngram.spec.eos_token_id,
        hidden_size=ck.config["text_config"]["hidden_size"],
        num_heads=4,
        max_seq_len=128,
        max_requests=4,
        **cfg_kw,
    )
    return ReferenceDecoder(cfg, table, ngram, weights, prefix, device=device)
