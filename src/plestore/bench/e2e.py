"""`plestore bench e2e`: the reference decoder's step time with the table on each tier, divided
by the resident table's, at several batch sizes, warm and cold.

Each configuration generates greedily (one prefill chunk per request, then decode steps); the
step times come from the decoder (host wall time per step, which includes the sampler's sync).
Cold runs evict the table file first, so every step's rows start on the disk. `exposed_ms` is
the time the PLE layer waited for its rows on the host (work not hidden behind layer 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

import plestore
from plestore.hashing import Qwen4ExpHash
from plestore.io.memory import evict
from plestore.models import DecoderConfig, ReferenceDecoder
from plestore.tablefile import TableFile

__all__ = ["E2EResult", "run_e2e"]


@dataclass
class E2EResult:
    tier: str
    batch: int
    cache: str  # warm | cold
    prefill_step_ms: float
    decode_step_ms: float
    prefill_ratio: float | None = None  # resident step time / this tier's (1.0 = no cost)
    decode_ratio: float | None = None
    exposed_ms_per_step: float = 0.0
    tokens_equal_resident: bool | None = None


def run_e2e(
    table_dir: str,
    tiers: list[str],
    batches: list[int],
    device: torch.device,
    hidden_size: int = 2560,
    num_layers: int = 4,
    prompt_tokens: int = 512,
    decode_steps: int = 16,
    log: Callable[[str], None] = print,
) -> list[E2EResult]:
    """Step times per (tier, batch, warm|cold) and their ratio to the resident tier."""
    ngram = Qwen4ExpHash.from_spec(TableFile.open(table_dir).spec.hash)
    cfg = DecoderConfig(
        vocab_size=ngram.spec.vocab_size,
        eos_token_id=ngram.spec.eos_token_id,
        hidden_size=hidden_size,
        num_heads=max(1, hidden_size // 128),
        num_layers=num_layers,
        max_seq_len=prompt_tokens + decode_steps + 8,
        max_requests=max(batches),
    )
    rng = np.random.default_rng(0)
    prompts = {
        b: [rng.integers(0, cfg.vocab_size, prompt_tokens).tolist() for _ in range(b)]
        for b in batches
    }
    results: list[E2EResult] = []
    reference: dict[tuple[int, str], list] = {}
    for tier in ["device", *[t for t in tiers if t != "device"]]:
        table = plestore.open_table(table_dir, tier=tier, device=str(device))
        model = ReferenceDecoder(cfg, table, ngram, device=device)
        model.generate(prompts[batches[0]][:1], 2, chunk_size=prompt_tokens)  # warm-up
        for batch in batches:
            for cache in ("cold", "warm") if tier in ("mapped", "direct") else ("warm",):
                if cache == "cold":
                    evict(table_dir)
                    if tier == "direct":
                        table.tier.cache.clear()
                else:  # warm: the same run once first (caches, allocator, kernels for shapes)
                    model.generate(prompts[batch], decode_steps, chunk_size=prompt_tokens)
                table.metrics.reset()
                res = model.generate(prompts[batch], decode_steps, chunk_size=prompt_tokens)
                steps = len(res.step_times)
                waited = sum(p["wait_s"] for p in table.stats()["phases"].values())
                r = E2EResult(
                    tier,
                    batch,
                    cache,
                    float(np.median([s for ph, _, s in res.step_times if ph == "prefill"])) * 1e3,
                    float(np.median([s for ph, _, s in res.step_times if ph == "decode"])) * 1e3,
                    exposed_ms_per_step=waited / steps * 1e3,
                )
                ref = reference.setdefault((batch, "tokens"), res.tokens)
                r.tokens_equal_resident = res.tokens == ref
                results.append(r)
                log(
                    f"e2e {tier} b{batch} {cache}: prefill {r.prefill_step_ms:.2f} ms, "
                    f"decode {r.decode_step_ms:.2f} ms/step"
                )
        del model
        table.close()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = {(r.batch): r for r in results if r.tier == "device"}
    for r in results:
        r.prefill_ratio = base[r.batch].prefill_step_ms / r.prefill_step_ms
        r.decode_ratio = base[r.batch].decode_step_ms / r.decode_step_ms
    return results
