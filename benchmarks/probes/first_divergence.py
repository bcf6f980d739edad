"""Where do two identical resident-table runs of the reference decoder first differ? Repeats one
greedy generation in one process and reports, per repetition, the first step whose logits
differ from the first run's (prefill steps come first), under a chosen attention backend.

    python benchmarks/probes/first_divergence.py TABLE_DIR --batch 64 --sdpa math

--sdpa: default | math | efficient | cudnn | flash.

Run once per backend (a fresh process each: deterministic settings must precede CUDA set-up).
"""

from __future__ import annotations

import argparse
import contextlib
import json

import numpy as np
from torch.nn.attention import SDPBackend, sdpa_kernel

import plestore
from plestore.hashing import Qwen4ExpHash
from plestore.models import DecoderConfig, ReferenceDecoder
from plestore.tablefile import TableFile

BACKENDS = {
    "math": SDPBackend.MATH,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("table")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--sdpa", default="default")
    ap.add_argument("--eager-decode", action="store_true")
    a = ap.parse_args()
    ngram = Qwen4ExpHash.from_spec(TableFile.open(a.table).spec.hash)
    cfg = DecoderConfig(
        vocab_size=ngram.spec.vocab_size,
        eos_token_id=ngram.spec.eos_token_id,
        hidden_size=a.hidden,
        num_heads=a.hidden // 128,
        num_layers=4,
        max_seq_len=512 + a.steps + 8,
        max_requests=a.batch,
        cuda_graphs=not a.eager_decode,
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, 512).tolist() for _ in range(a.batch)]
    ctx = sdpa_kernel(BACKENDS[a.sdpa]) if a.sdpa != "default" else contextlib.nullcontext()
    out = {"sdpa": a.sdpa, "batch": a.batch, "eager_decode": a.eager_decode, "runs": []}
    with plestore.open_table(a.table, tier="device") as table, ctx:
        model = ReferenceDecoder(cfg, table, ngram, device=table.device)
        first = None
        for _ in range(a.runs):
            try:
                res = model.generate(prompts, a.steps, chunk_size=128, keep_logits=True)
            except RuntimeError as e:  # e.g. a backend that cannot take this mask
                out["error"] = str(e)[:300]
                break
            if first is None:
                first = res
                continue
            diff = [
                float((x - y).abs().max()) for x, y in zip(first.logits, res.logits, strict=True)
            ]
            where = next((i for i, d in enumerate(diff) if d > 0), None)
            tokens = sum(
                u != v
                for p, q in zip(first.tokens, res.tokens, strict=True)
                for u, v in zip(p, q, strict=True)
            )
            out["runs"].append(
                {"first_step_differing": where, "max_diff": max(diff), "tokens": tokens}
            )
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
