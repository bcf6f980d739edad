"""Where a reference-decoder step spends its time (host side), per tier and batch: to tell
launch-bound from GPU-bound steps and see what a host tier's lookup adds.

    python benchmarks/probe_decoder_step.py TABLE_DIR --tiers device,mapped --batches 1,64
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import numpy as np
import torch

import plestore
from plestore.hashing import Qwen4ExpHash
from plestore.models import DecoderConfig, ReferenceDecoder
from plestore.tablefile import TableFile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("table")
    ap.add_argument("--tiers", default="device,mapped")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--top", type=int, default=22)
    a = ap.parse_args()
    ngram = Qwen4ExpHash.from_spec(TableFile.open(a.table).spec.hash)
    batches = [int(b) for b in a.batches.split(",")]
    cfg = DecoderConfig(
        vocab_size=ngram.spec.vocab_size,
        eos_token_id=ngram.spec.eos_token_id,
        hidden_size=2560,
        num_heads=20,
        num_layers=a.layers,
        max_seq_len=512 + 32 + 8,
        max_requests=max(batches),
    )
    rng = np.random.default_rng(0)
    for tier in a.tiers.split(","):
        with plestore.open_table(a.table, tier=tier) as table:
            model = ReferenceDecoder(cfg, table, ngram, device=table.device)
            for b in batches:
                prompts = [rng.integers(0, cfg.vocab_size, 512).tolist() for _ in range(b)]
                model.generate(prompts, 16, chunk_size=512)  # warm
                res = model.generate(prompts, 32, chunk_size=512)
                dec = [s for ph, _, s in res.step_times if ph == "decode"]
                prof = cProfile.Profile()
                prof.enable()
                t0 = time.perf_counter()
                res = model.generate(prompts, 32, chunk_size=512)
                wall = time.perf_counter() - t0
                prof.disable()
                print(
                    f"=== {tier} b{b}: decode median {np.median(dec) * 1e3:.2f} ms/step, "
                    f"profiled generate {wall * 1e3:.0f} ms"
                )
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
                print("\n".join(s.getvalue().splitlines()[6 : 10 + a.top]))
            del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
