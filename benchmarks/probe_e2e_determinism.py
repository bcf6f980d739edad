"""Is the reference decoder itself run-to-run deterministic on this GPU at a given batch? The
e2e benchmark compares every tier's greedy tokens with the resident tier's; if two resident runs
already differ, a mismatch says nothing about the table.

    python benchmarks/probe_e2e_determinism.py TABLE_DIR --batch 64 [--deterministic]
    python benchmarks/probe_e2e_determinism.py TABLE_DIR --tiers device,pinned,device --runs 1

Each tier gets a fresh table and decoder (as in the e2e benchmark); all runs are compared with
the first.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import numpy as np
import torch

import plestore
from plestore.hashing import Qwen4ExpHash
from plestore.models import DecoderConfig, ReferenceDecoder
from plestore.tablefile import TableFile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("table")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tiers", default="device")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument(
        "--warn-only",
        action="store_true",
        help="deterministic kernels where torch has them; warn (and list) the ops without",
    )
    a = ap.parse_args()
    if a.deterministic or a.warn_only:  # strict mode needs CUBLAS_WORKSPACE_CONFIG=:4096:8
        torch.use_deterministic_algorithms(True, warn_only=a.warn_only)
    warnings.simplefilter("always")
    seen: list[str] = []
    warnings.showwarning = lambda msg, *_: seen.append(str(msg)[:200])
    ngram = Qwen4ExpHash.from_spec(TableFile.open(a.table).spec.hash)
    cfg = DecoderConfig(
        vocab_size=ngram.spec.vocab_size,
        eos_token_id=ngram.spec.eos_token_id,
        hidden_size=2560,
        num_heads=20,
        num_layers=4,
        max_seq_len=512 + 16 + 8,
        max_requests=a.batch,
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, 512).tolist() for _ in range(a.batch)]
    runs, labels = [], []
    for tier in a.tiers.split(","):
        with plestore.open_table(a.table, tier=tier) as table:
            model = ReferenceDecoder(cfg, table, ngram, device=table.device)
            for _ in range(a.runs):
                runs.append(model.generate(prompts, 16, chunk_size=512).tokens)
                labels.append(f"{len(labels)}:{tier}")
            del model
        torch.cuda.empty_cache()
    diff = {
        label: sum(
            x != y for p, q in zip(r, runs[0], strict=True) for x, y in zip(p, q, strict=True)
        )
        for label, r in zip(labels, runs, strict=True)
    }
    print(
        json.dumps(
            {
                "batch": a.batch,
                "deterministic": a.deterministic,
                "warn_only": a.warn_only,
                "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                "tokens_differing": diff,
                "warnings": sorted(set(seen)),
            }
        )
    )


if __name__ == "__main__":
    main()
