"""The Qwen4Exp (Qwen3.8-Flash-Next) PLE n-gram hash: token ids -> row ids [T, heads].

As SGLang and vLLM compute it (golden vectors: tests/data). For token x_t with predecessors
p_1 = x_{t-1}, p_2, ... (from this chunk, or from the request's carried context when they
precede the chunk):

* EOS rule: p_s is replaced by EOS once any newer predecessor p_1..p_{s-1} is EOS (an EOS closes
  a segment; the token after it starts a new one). The current token is never replaced.
* order k (2..n): mixed_k = x_t*m[0] ^ p_1*m[1] ^ ... ^ p_{k-1}*m[k-1] (int64; the multipliers
  are < (2^63-1) // vocab_size, so no product of an in-vocab id overflows).
* head h of order k: id = offset[h] + mixed_k mod size[h]; bigram heads first.

The whole ragged batch is hashed at once: every request's `[context | chunk]` sits in one flat
buffer (`RaggedLayout`), so predecessor s of token t is a gather at a fixed offset, for
numpy and torch alike, with fixed shapes only (no host sync on CUDA with `check=False`). The
next context is the last n-1 entries of the request's `[context | chunk]`, so chunked prefill
and decode give exactly the ids of one unsplit prefill.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from plestore.hashing.backend import Array, Backend, is_torch, same_kind
from plestore.hashing.base import Hasher
from plestore.hashing.checks import (
    check_query_start_loc,
    check_request_count,
    check_state_range,
    check_token_range,
    qsl_ok,
    sanitize_query_start_loc,
)
from plestore.hashing.ragged import RaggedLayout
from plestore.spec import Qwen4ExpHashSpec, table_specs_from_hf_config

__all__ = ["Qwen4ExpHash"]


class Qwen4ExpHash(Hasher):
    """Row ids of one Qwen4Exp PLE table (one PLE layer; `layer_index` is its dense index).

    `row_ids(input_ids [T], query_start_loc [R+1], context [R, n-1]) -> (ids [T, heads],
    next_context [R, n-1])`; numpy in -> numpy out, torch in -> torch out on the same device.
    """

    kind = "qwen4exp"

    def __init__(
        self,
        vocab_size: int,
        eos_token_id: int,
        ngram_size: int = 3,
        heads_per_ngram: int = 8,
        ngram_vocab_size_base: int = 20_000_000,
        seed: int = 1234,
        layer_index: int = 0,
        pad_multiple: int = 128,
    ) -> None:
        self.spec = Qwen4ExpHashSpec(
            vocab_size=vocab_size,
            eos_token_id=eos_token_id,
            ngram_size=ngram_size,
            heads_per_ngram=heads_per_ngram,
            ngram_vocab_size_base=ngram_vocab_size_base,
            seed=seed,
            layer_index=layer_index,
            pad_multiple=pad_multiple,
        )
        s = self.spec
        self.vocab_size, self.eos_token_id, self.ngram_size = vocab_size, eos_token_id, ngram_size
        self.heads_per_ngram = heads_per_ngram
        self.multipliers: tuple[int, ...] = s.multipliers
        self.head_sizes: tuple[int, ...] = s.head_sizes
        self.head_offsets: tuple[int, ...] = s.head_offsets
        self._sizes_np = np.array(s.head_sizes, dtype=np.int64).reshape(ngram_size - 1, -1)
        self._offsets_np = np.array(s.head_offsets, dtype=np.int64).reshape(ngram_size - 1, -1)
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec: Qwen4ExpHashSpec) -> Qwen4ExpHash:
        if not isinstance(spec, Qwen4ExpHashSpec):
            raise ValueError(f"Qwen4ExpHash needs a Qwen4ExpHashSpec, got {type(spec).__name__}")
        return cls(
            vocab_size=spec.vocab_size,
            eos_token_id=spec.eos_token_id,
            ngram_size=spec.ngram_size,
            heads_per_ngram=spec.heads_per_ngram,
            ngram_vocab_size_base=spec.ngram_vocab_size_base,
            seed=spec.seed,
            layer_index=spec.layer_index,
            pad_multiple=spec.pad_multiple,
        )

    @classmethod
    def from_hf_config(cls, config: str | Path | dict, layer_index: int = 0) -> Qwen4ExpHash:
        """The hash of PLE layer `layer_index` (dense: 0 = the first id in ple_layer_ids)."""
        specs = [s.hash for s in table_specs_from_hf_config(config)]
        if not specs or not isinstance(specs[0], Qwen4ExpHashSpec):
            raise ValueError("config has no Qwen4Exp PLE layers (ple_layer_ids)")
        if not 0 <= layer_index < len(specs):
            raise ValueError(
                f"layer_index {layer_index} is not a dense PLE index; the config has "
                f"{len(specs)} PLE layer(s)"
            )
        return cls.from_spec(specs[layer_index])

    # -- shape ---------------------------------------------------------------------------------
    @property
    def heads(self) -> int:
        return self.spec.heads

    @property
    def num_rows(self) -> int:
        """Table rows (sum of head sizes padded to `pad_multiple`)."""
        return self.spec.num_rows

    @property
    def context_width(self) -> int:
        return self.ngram_size - 1

    def fresh_context(self, num_requests: int, device: str | torch.device | None = None) -> Array:
        """Context of `num_requests` new requests: all EOS, int64 [R, n-1] (numpy when
        `device` is None, else a torch tensor there). Either kind serves `row_ids`, which
        takes the kind of its input_ids; make it where the ids live when no copy may happen
        (a CUDA graph capture)."""
        shape = (num_requests, self.context_width)
        if device is None:
            return np.full(shape, self.eos_token_id, dtype=np.int64)
        return torch.full(shape, self.eos_token_id, dtype=torch.int64, device=device)

    fresh_state = fresh_context

    def step(
        self,
        input_ids: Array,
        query_start_loc: Array,
        state: Array,
        *,
        check: bool = True,
        **extras: Any,
    ) -> tuple[Array, Array]:
        if extras:
            raise ValueError(f"Qwen4ExpHash takes no {sorted(extras)}")
        return self.row_ids(input_ids, query_start_loc, state, check=check)

    # -- hashing -------------------------------------------------------------------------------
    def row_ids(
        self, input_ids: Array, query_start_loc: Array, context: Array, *, check: bool = True
    ) -> tuple[Array, Array]:
        """Row ids of a ragged batch and each request's next context.

        input_ids [T] int: all requests' new tokens back to back. query_start_loc [R+1]: request
        r's tokens are input_ids[qsl[r]:qsl[r+1]] (empty requests allowed). context [R, n-1]:
        each request's previous tokens, oldest first (all EOS for a fresh request; see
        `fresh_context`), numpy or torch: it takes input_ids' kind and device (a copy of R x
        (n-1) ints). Returns ids int64 [T, heads] (bigram heads first) and next_context int64
        [R, n-1], of input_ids' kind, to pass with the request's next chunk or decode step.

        Invalid input raises ValueError naming the request and position. On CUDA that check
        costs one sync; `check=False` skips it: the caller vouches for the ids (CUDA-graph
        capture), and invalid input then yields meaningless (but in-table) ids.
        """
        xp = Backend(input_ids)
        ids = xp.ints("input_ids", input_ids, ndim=1)
        qsl = xp.ints("query_start_loc", query_start_loc, ndim=1)
        ctx = xp.ints("context", same_kind(context, input_ids))
        t, c, v = ids.shape[0], self.context_width, self.vocab_size
        check_request_count(t, qsl.shape[0])
        if tuple(ctx.shape) != (qsl.shape[0] - 1, c):
            raise ValueError(
                f"context has shape {list(ctx.shape)}, expected [{qsl.shape[0] - 1}, {c}]: one "
                f"row per request (R = len(query_start_loc) - 1), its {c} previous tokens oldest "
                "first"
            )
        if check:
            xp.validate(
                lambda: (
                    qsl_ok(qsl, t) & ((ids >= 0) & (ids < v)).all() & ((ctx >= 0) & (ctx < v)).all()
                ),
                self._explain,
                ids,
                qsl,
                ctx,
            )
        ids, qsl, ctx = xp.int64(ids), xp.int64(qsl), xp.int64(ctx)
        if xp.torch and not check:
            qsl = sanitize_query_start_loc(qsl, t)
        return self._hash(xp, ids, qsl, ctx)

    def padded_row_ids(self, tokens: Array, context: Array) -> Array:
        """Row ids [B, S, heads] of a dense batch — B requests of S new tokens each, as
        transformers lays them out ([batch, seq]; padding is the caller's, e.g. EOS) — with
        context [B, n-1] (oldest first). Same ids as `row_ids` with query_start_loc =
        arange(0, B*S + 1, S), without the ragged bookkeeping; no range check, no host sync.
        The next context is the last n-1 columns of `[context | tokens]`."""
        xp = Backend(tokens)
        ids, ctx = xp.int64(tokens), xp.int64(context)
        c = self.context_width
        if ids.ndim != 2 or tuple(ctx.shape) != (ids.shape[0], c):
            raise ValueError(
                f"padded_row_ids takes tokens [B, S] and context [B, {c}], got "
                f"{list(ids.shape)} and {list(ctx.shape)}"
            )
        b, s = ids.shape
        buf = (torch.cat if xp.torch else np.concatenate)([ctx, ids], 1)  # [B, c + S]
        preds = [buf[:, c - k : c - k + s].reshape(-1) for k in range(1, c + 1)]  # p_k, [B*S]
        return self._mix(xp, ids.reshape(-1), preds).reshape(b, s, -1)

    def decode_row_ids(self, tokens: Array, context: Array) -> tuple[Array, Array]:
        """`row_ids` for a decode step — one new token per request, query_start_loc =
        arange(R+1) — without the ragged bookkeeping: a fifth of the host time (a decode step
        waits for it). tokens int [R], context int [R, n-1]: numpy, or torch tensors on one
        device (no host sync: a captured decode step can hash its sampled tokens); no range
        check: the caller vouches for the values (sampled tokens, carried contexts). Returns
        (`decode_ids`, `advance_context`)."""
        xp, ids, ctx = self._decode_inputs(tokens, context)
        return self._decode_ids(xp, ids, ctx), self._advance(xp, ids, ctx)

    def decode_ids(self, tokens: Array, context: Array) -> Array:
        """Row ids [R, heads] of one decode token per request (decode_row_ids' first result)."""
        return self._decode_ids(*self._decode_inputs(tokens, context))

    def advance_context(self, tokens: Array, context: Array) -> Array:
        """The context [R, n-1] after one decode token per request (decode_row_ids' second
        result, without the hash)."""
        return self._advance(*self._decode_inputs(tokens, context))

    def _decode_inputs(self, tokens: Array, context: Array) -> tuple:
        xp = Backend(tokens)
        if xp.torch != is_torch(context) or (xp.torch and context.device != xp.device):
            raise ValueError(f"context must be {xp.kind}, as tokens are")
        ids, ctx = xp.int64(tokens), xp.int64(context)
        c = self.context_width
        if ids.ndim != 1 or tuple(ctx.shape) != (ids.shape[0], c):
            raise ValueError(
                f"decode_row_ids takes tokens [R] and context [R, {c}], got "
                f"{list(ids.shape)} and {list(ctx.shape)}"
            )
        return xp, ids, ctx

    def _decode_ids(self, xp: Backend, ids: Array, ctx: Array) -> Array:
        c = self.context_width
        return self._mix(xp, ids, [ctx[:, c - s] for s in range(1, c + 1)])  # newest first

    @staticmethod
    def _advance(xp: Backend, ids: Array, ctx: Array) -> Array:
        cat = torch.cat if xp.torch else np.concatenate
        return cat([ctx[:, 1:], ids[:, None]], 1)  # drop the oldest, append the token

    def _hash(self, xp: Backend, ids: Array, qsl: Array, ctx: Array) -> tuple[Array, Array]:
        """ids int64 [T], qsl int64 [R+1] (valid), ctx int64 [R, n-1]."""
        lay = RaggedLayout(xp, qsl, ids.shape[0], self.context_width)
        buf = lay.buffer(ctx, ids)  # [T + R*c]: [context_r | chunk_r] per request r
        preds = [buf[lay.tok_pos - s] for s in range(1, self.context_width + 1)]  # [T] each
        return self._mix(xp, ids, preds), lay.tail(buf)  # [T, heads]; [R, n-1]

    def _mix(self, xp: Backend, ids: Array, preds: list[Array]) -> Array:
        """Row ids [T, heads] (bigram heads first) from each token and its predecessors
        p_1..p_{n-1} (p_s: s tokens back, [T] each)."""
        c, hpn, t = self.context_width, self.heads_per_ngram, ids.shape[0]
        eos, m = self.eos_token_id, self.multipliers
        sizes, offsets = xp.tables(self._on_device, (self._sizes_np, self._offsets_np))
        mixed_all = xp.empty((t, c))  # [T, n-1] mixed value of each order
        mixed = ids * m[0]  # [T]
        crossed = None  # [T] bool: an EOS among the newer predecessors
        for s, p in enumerate(preds, 1):
            if crossed is None:
                crossed = p == eos  # p_1 itself is kept even when it is EOS
            else:
                p = xp.where(crossed, eos, p)
                crossed = crossed | (p == eos)
            mixed = mixed ^ (p * m[s])
            mixed_all[:, s - 1] = mixed  # order s+1
        out = xp.remainder(mixed_all[:, :, None], sizes)  # [T, n-1, hpn]
        out += offsets
        return out.reshape(t, c * hpn)

    def _explain(self, ids: np.ndarray, qsl: np.ndarray, ctx: np.ndarray) -> None:
        check_query_start_loc(qsl, ids.shape[0])
        check_token_range(ids, qsl, self.vocab_size)
        check_state_range("context", ctx, self.vocab_size, "carried token")

    def __repr__(self) -> str:
        s = self.spec
        return (
            f"Qwen4ExpHash(vocab_size={s.vocab_size}, eos={s.eos_token_id}, n={s.ngram_size}, "
            f"heads={s.heads}, layer_index={s.layer_index}, rows={s.num_rows})"
        )
