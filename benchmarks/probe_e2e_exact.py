"""Diagnose a token mismatch at batch 64: are the rows exact on every tier for a 524,288-id
prefill lookup on the GPU, and is the reference decoder deterministic run to run?

    python benchmarks/probe_e2e_exact.py TABLE_DIR
"""

from __future__ import annotations

import sys

import numpy as np
import torch

import plestore
from plestore.hashing import Qwen4ExpHash
from plestore.models import DecoderConfig, ReferenceDecoder


def main(table_dir: str) -> None:
    rng = np.random.default_rng(0)
    ref_t = plestore.open_table(table_dir, tier="device")
    ng = Qwen4ExpHash.from_spec(ref_t.spec.hash)
    tokens = rng.integers(0, ng.spec.vocab_size, 64 * 512)
    ids, _ = ng.row_ids(tokens, np.arange(65) * 512, ng.fresh_context(64))
    want = ref_t.lookup(ids).view(torch.int16).cpu()
    for tier in ("pinned", "mapped", "direct"):
        with plestore.open_table(table_dir, tier=tier) as t:
            for rep in range(3):
                got = t.lookup(ids).view(torch.int16).cpu()
                bad = int((got != want).any(1).sum())
                print(
                    f"lookup {tier} rep{rep}: {bad} of {len(want)} tokens' rows differ", flush=True
                )
    cfg = DecoderConfig(vocab_size=ng.spec.vocab_size, eos_token_id=ng.spec.eos_token_id,
                        hidden_size=2560, num_heads=20, num_layers=4, max_seq_len=536,
                        max_requests=64)  # fmt: skip
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, 512).tolist() for _ in range(64)]
    runs = {}
    for tier in ("device", "device", "direct"):
        with plestore.open_table(table_dir, tier=tier) as t:
            m = ReferenceDecoder(cfg, t, ng, device="cuda")
            res = m.generate(prompts, 16, chunk_size=512, keep_logits=True)
            key = tier if tier not in runs else tier + "2"
            runs[key] = res
            del m
    a, b, c = runs["device"], runs["device2"], runs["direct"]
    for name, r in (("device again", b), ("direct", c)):
        same_tok = r.tokens == a.tokens
        first = next((i for i, (x, y) in enumerate(zip(r.logits, a.logits, strict=True))
                      if not torch.equal(x, y)), None)  # fmt: skip
        print(f"decoder {name} vs device: tokens equal {same_tok}, first differing step {first}")


if __name__ == "__main__":
    main(sys.argv[1])
