"""Benchmark workloads: which row ids one engine step looks up.

Decode steps are 16 rows per request (batch 1, 8, 64); prefill chunks are 2,048 and 4,096
tokens (32,768 and 65,536 rows). Ids come from uniform random tokens or from a Zipf(1.1) token
stream (ranks mapped to random token ids), passed through the table's real Qwen4Exp hash with
each request's n-gram context — so duplicates and locality are what a real step would see.
Or from real text (`dist="text"` with a token stream of `plestore text`): a decode step is
`requests` concurrent requests, each one token into a different document; a prefill chunk is
`tokens_per_request` consecutive tokens of a document, with their context (a short document
is followed by the next ones, each a request of its own).
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


def row_ids(
    spec: TableSpec, workload: Workload, dist: str, seed: int = 0, text: str | None = None
) -> np.ndarray:
    """Flat int64 row ids of one step of `workload` on `spec`'s table (dist "text": from the
    token stream at path `text`)."""
    if dist == "text":
        return _text_row_ids(spec, workload, text, seed)
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


def _text_row_ids(spec: TableSpec, workload: Workload, text: str | None, seed: int) -> np.ndarray:
    from plestore.hashing import make_hash
    from plestore.lookup.profile import TokenStream

    if text is None or spec.hash is None:
        raise ValueError("the text workload needs a token stream (--text) and a hashed table")
    stream, h = TokenStream.load(text), make_hash(spec.hash)
    r, t = workload.requests, workload.tokens_per_request
    if t == 1:  # a decode step: r requests at random places of r documents
        return next(stream.decode_steps(h, r, 1, seed=seed)).reshape(-1)
    rng = np.random.default_rng(seed)
    parts, ctxs = [], []
    for d in rng.choice(stream.documents, size=r, replace=r > stream.documents):
        need, d = t, int(d)
        while need:  # `t` tokens from a random place; short documents: the next ones after it
            doc = stream.doc(d).astype(np.int64)
            a = int(rng.integers(0, max(1, doc.size - need))) if need == t else 0
            parts.append(doc[a : a + need])
            ctx = np.full(h.context_width, h.eos_token_id, np.int64)
            prev = doc[max(0, a - ctx.size) : a]
            ctx[ctx.size - prev.size :] = prev
            ctxs.append(ctx)
            need -= parts[-1].size
            d = (d + 1) % stream.documents
    qsl = np.r_[0, np.cumsum([p.size for p in parts])]
    ids, _ = h.row_ids(np.concatenate(parts), qsl, np.stack(ctxs))
    return ids.reshape(-1)
