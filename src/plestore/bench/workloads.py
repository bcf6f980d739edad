"""Benchmark workloads: which row ids one engine step looks up.

Decode steps are 16 rows per request (batch 1, 8, 64); prefill chunks are 2,048 and 4,096
tokens (32,768 and 65,536 rows). Ids come from uniform random tokens or from a Zipf(1.1) token
stream (ranks mapped to random token ids), passed through the table's real Qwen4Exp hash with
each request's n-gram context — so duplicates and locality are what a real step would see.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plestore.hashing import Qwen4ExpHash
from plestore.spec import Qwen4ExpHashSpec, TableSpec

__all__ = ["WORKLOADS", "Workload", "row_ids"]


@dataclass(frozen=True)
class Workload:
    name: str
    requests: int
    tokens_per_request: int

    @property
    def tokens(self) -> int:
        return self.requests * self.tokens_per_request


WORKLOADS = {
    w.name: w
    for w in (
        Workload("decode-b1", 1, 1),
        Workload("decode-b8", 8, 1),
        Workload("decode-b64", 64, 1),
        Workload("prefill-2048", 1, 2048),
        Workload("prefill-4096", 1, 4096),
    )
}


def _tokens(rng: np.random.Generator, n: int, vocab: int, dist: str) -> np.ndarray:
    if dist == "uniform":
        return rng.integers(0, vocab, n)
    if dist == "zipf":
        ranks = np.minimum(rng.zipf(1.1, n), vocab) - 1
        perm = np.random.default_rng(12345).permutation(vocab)  # fixed rank -> token map
        return perm[ranks]
    raise ValueError(f"unknown id distribution {dist!r}: uniform or zipf")


def row_ids(spec: TableSpec, workload: Workload, dist: str, seed: int = 0) -> np.ndarray:
    """Flat int64 row ids of one step of `workload` on `spec`'s table."""
    rng = np.random.default_rng(seed)
    if not isinstance(spec.hash, Qwen4ExpHashSpec):  # no n-gram hash: rows directly
        n = workload.tokens * spec.heads
        return _tokens(rng, n, spec.rows, "uniform" if dist == "uniform" else dist)
    h = Qwen4ExpHash.from_spec(spec.hash)
    vocab, r, t = h.spec.vocab_size, workload.requests, workload.tokens_per_request
    tokens = _tokens(rng, r * t, vocab, dist)
    context = _tokens(rng, r * (h.spec.ngram_size - 1), vocab, dist).reshape(r, -1)
    qsl = np.arange(r + 1, dtype=np.int64) * t
    ids, _ = h.row_ids(tokens, qsl, context)
    return ids.reshape(-1)
