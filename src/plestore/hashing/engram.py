"""DeepSeek-V4.1 Engram n-gram hash: token ids -> row ids [T, layers, columns] (spec engram.md).

Per token t and Engram layer L, over shifts s = 0..N-1 (N = max_ngram_size; shift 0 is t):

* the source of shift s is token t-s of this chunk, or the request's lookback when it precedes
  the chunk; its value is its *compressed* id (`token_map`), an unknown lookback (-1) is the
  pad id (the compressed id of `engram_pad_token_id`);
* `blocked` turns on at the first source that is DEAD (`dead_mask`, `lookback_dead_mask`) or
  lies before the sequence start (position - s < 0, from `positions`), and stays on: every value
  from there (the current token's too, if it is DEAD) is the pad id; an unknown lookback does
  not block;
* rolling = XOR of value_s * mult[L][s]; after each shift s >= 1 the n-gram of order s+1 gives
  column (s-1)*n_heads + h the id offset[L][col] + rolling mod prime[L][col].

There is no EOS rule. Each layer's ids start at row 0 of its own table. Like the Qwen4Exp hash,
the whole ragged batch is hashed at once from a flat `[lookback | chunk]` buffer
(`RaggedLayout`), numpy and torch alike, with no host sync on CUDA when `check=False`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from plestore.hashing.backend import Array, Backend, same_kind
from plestore.hashing.base import Hasher
from plestore.hashing.checks import (
    check_query_start_loc,
    check_request_count,
    check_state_range,
    check_token_range,
    locate,
    qsl_ok,
    sanitize_query_start_loc,
)
from plestore.hashing.ragged import RaggedLayout
from plestore.hashing.token_map import check_token_map
from plestore.spec import EngramHashSpec, table_specs_from_hf_config

__all__ = ["EngramHash", "EngramState"]


class EngramState(NamedTuple):
    """What a request carries between steps: its lookback (newest first, -1 = unknown) with
    its DEAD flags, and the position of its next token."""

    lookback_token_ids: Array  # int64 [R, w], w >= N-1
    lookback_dead_mask: Array  # bool [R, w]
    next_position: Array  # int64 [R]


class EngramHash(Hasher):
    """Row ids of the Engram tables of `layers` (default: every id in `layer_ids`).

    `token_map` (int [tokenizer vocab], see `plestore.hashing.token_map`) maps token ids to
    compressed ids; with None the ids passed in are taken to be compressed ids already.
    `pad_token_id` (`engram_pad_token_id`) is a token id: blocked sources take its compressed
    id, `pad_id` = token_map[pad_token_id] (vLLM's `NgramHashState` does the same), or
    pad_token_id itself without a map.
    """

    kind = "engram"

    def __init__(
        self,
        layer_ids: tuple[int, ...] | list[int],
        compressed_vocab_size: int,
        pad_token_id: int,
        max_ngram_size: int = 4,
        n_heads: int = 8,
        vocab_size: int = 16_000_000,
        token_map: Any = None,
        layers: Any = None,
    ) -> None:
        layer_ids = tuple(int(x) for x in layer_ids)
        layers = layer_ids if layers is None else tuple(int(x) for x in layers)
        for lid in layers:
            if lid not in layer_ids:
                raise ValueError(f"layer {lid} is not one of the Engram layer ids {layer_ids}")
        self.specs = tuple(
            EngramHashSpec(
                layer_ids=layer_ids,
                layer_position=layer_ids.index(lid),
                compressed_vocab_size=compressed_vocab_size,
                pad_token_id=pad_token_id,
                max_ngram_size=max_ngram_size,
                n_heads=n_heads,
                vocab_size=vocab_size,
            )
            for lid in layers
        )
        self.layers, self.max_ngram_size, self.n_heads = layers, max_ngram_size, n_heads
        self.compressed_vocab_size = compressed_vocab_size
        self.multipliers = tuple(s.multipliers for s in self.specs)  # [L][N]
        self.head_sizes = tuple(s.head_sizes for s in self.specs)  # [L][cols]
        self.head_offsets = tuple(s.head_offsets for s in self.specs)  # [L][cols]
        self.rows_per_layer = tuple(s.num_rows for s in self.specs)
        self.token_map = (
            None if token_map is None else check_token_map(token_map, compressed_vocab_size)
        )
        self.pad_id = pad_token_id
        if self.token_map is not None:
            if pad_token_id >= len(self.token_map):
                raise ValueError(
                    f"pad_token_id {pad_token_id} is outside the token map [0, "
                    f"{len(self.token_map)})"
                )
            self.pad_id = int(self.token_map[pad_token_id])
        self._id_limit = compressed_vocab_size if token_map is None else len(self.token_map)
        shape = (len(layers), max_ngram_size - 1, n_heads)
        self._np = (
            np.array(self.multipliers, dtype=np.int64),  # [L, N]
            np.array(self.head_sizes, dtype=np.int64).reshape(shape),  # [L, N-1, H]
            np.array(self.head_offsets, dtype=np.int64).reshape(shape),
            self.token_map,
        )
        self._on_device: dict[torch.device, tuple] = {}

    @classmethod
    def from_spec(cls, spec: EngramHashSpec, token_map: Any = None) -> EngramHash:
        """The hash of the one layer `spec` describes."""
        if not isinstance(spec, EngramHashSpec):
            raise ValueError(f"EngramHash needs an EngramHashSpec, got {type(spec).__name__}")
        return cls(
            spec.layer_ids,
            spec.compressed_vocab_size,
            spec.pad_token_id,
            spec.max_ngram_size,
            spec.n_heads,
            spec.vocab_size,
            token_map=token_map,
            layers=(spec.layer_id,),
        )

    @classmethod
    def from_hf_config(
        cls, config: str | Path | dict, token_map: Any = None, layers: Any = None
    ) -> EngramHash:
        specs = [t.hash for t in table_specs_from_hf_config(config, format="bf16")]
        if not specs or not isinstance(specs[0], EngramHashSpec):
            raise ValueError("config has no Engram layers (engram_layer_ids)")
        s = specs[0]
        return cls(
            s.layer_ids,
            s.compressed_vocab_size,
            s.pad_token_id,
            s.max_ngram_size,
            s.n_heads,
            s.vocab_size,
            token_map=token_map,
            layers=layers,
        )

    # -- shape ---------------------------------------------------------------------------------
    @property
    def spec(self) -> EngramHashSpec:  # type: ignore[override]
        if len(self.specs) != 1:
            raise ValueError(f"this EngramHash covers layers {self.layers}; use .specs")
        return self.specs[0]

    @property
    def columns(self) -> int:
        """Hash columns per layer: (N-1) * n_heads, order-major."""
        return (self.max_ngram_size - 1) * self.n_heads

    @property
    def heads(self) -> int:
        """Ids per token over all layers (`step` flattens [layers, columns])."""
        return len(self.layers) * self.columns

    @property
    def num_rows(self) -> int:
        """Every id is below this (the largest layer's rows; each layer's table starts at 0)."""
        return max(self.rows_per_layer)

    def check_checkpoint_constants(self, layer_id: int | None = None, **stored: Any) -> None:
        """As `Hasher.check_checkpoint_constants`, for layer `layer_id` (needed if several)."""
        from plestore.spec import check_hash_constants

        spec = self.spec if layer_id is None else self.specs[self.layers.index(layer_id)]
        check_hash_constants(spec, **stored)

    def fresh_state(
        self, num_requests: int, device: str | torch.device | None = None
    ) -> EngramState:
        """New requests: unknown lookback (blocked anyway: it lies before position 0). Numpy
        when `device` is None, else torch there; `step` takes its input_ids' kind either way."""
        w = self.max_ngram_size - 1
        if device is None:
            return EngramState(
                np.full((num_requests, w), -1, dtype=np.int64),
                np.zeros((num_requests, w), dtype=bool),
                np.zeros(num_requests, dtype=np.int64),
            )
        return EngramState(
            torch.full((num_requests, w), -1, dtype=torch.int64, device=device),
            torch.zeros((num_requests, w), dtype=torch.bool, device=device),
            torch.zeros(num_requests, dtype=torch.int64, device=device),
        )

    def step(
        self,
        input_ids: Array,
        query_start_loc: Array,
        state: EngramState,
        *,
        check: bool = True,
        dead_mask: Array | None = None,
    ) -> tuple[Array, EngramState]:
        """Uniform call: ids [T, layers*columns] and the state after this chunk. Positions come
        from the state: each request's chunk continues where its previous one ended."""
        lb, lbd, start = (same_kind(x, input_ids) for x in state)
        xp = Backend(input_ids)
        ids = xp.ints("input_ids", input_ids, ndim=1)
        qsl = xp.int64(xp.ints("query_start_loc", query_start_loc, ndim=1))
        start = xp.int64(xp.ints("next_position", start, ndim=1))
        t = ids.shape[0]
        check_request_count(t, qsl.shape[0])
        if start.shape[0] != qsl.shape[0] - 1:
            raise ValueError(f"state has {start.shape[0]} requests, the batch {qsl.shape[0] - 1}")
        # Positions are gathered before row_ids validates, so they use a query_start_loc that
        # cannot index out of bounds: torch sanitizes (a no-op on valid input, no sync); numpy
        # checks (free).
        if xp.torch:
            safe = sanitize_query_start_loc(qsl, t)
        else:
            if check:
                check_query_start_loc(qsl, t)
            safe = qsl
        seg = xp.segments(safe, t)  # [T]
        positions = start[seg] + (xp.arange(t) - safe[seg])  # [T]
        out = self.row_ids(ids, qsl, lb, dead_mask, lbd, positions, check=check)
        nxt, nxt_dead = self.next_lookback(ids, safe, lb, dead_mask, lbd, check=False)
        nxt_pos = start + (safe[1:] - safe[:-1])
        return out.reshape(t, self.heads), EngramState(nxt, nxt_dead, nxt_pos)

    # -- hashing -------------------------------------------------------------------------------
    def row_ids(
        self,
        input_ids: Array,
        query_start_loc: Array,
        lookback_token_ids: Array,
        dead_mask: Array | None = None,
        lookback_dead_mask: Array | None = None,
        positions: Array | None = None,
        *,
        check: bool = True,
    ) -> Array:
        """Row ids int64 [T, layers, columns] of a ragged batch (columns order-major).

        input_ids [T]: token ids (compressed ids if there is no token map). query_start_loc
        [R+1]. lookback_token_ids [R, w >= N-1]: the raw ids just before each request's chunk,
        NEWEST FIRST, -1 = unknown (columns past N-1 are ignored). dead_mask [T] and
        lookback_dead_mask [R, w]: DEAD tokens (image spans; their ids are not read).
        positions [T]: each token's position in its sequence, so that sources before the start
        block. Without positions nothing blocks for lying before the start; for a fresh request
        an all -1 lookback then gives the same ids (pad values either way), and a lookback slot
        before the start can be marked DEAD for the general case. `check=False`: see
        `Qwen4ExpHash.row_ids`.
        """
        xp, ids, qsl, lb, dead, lbd, pos = self._prepare(
            input_ids,
            query_start_loc,
            lookback_token_ids,
            dead_mask,
            lookback_dead_mask,
            positions,
            check,
        )
        w, pad, t, n_layers = self.max_ngram_size - 1, self.pad_id, ids.shape[0], len(self.layers)
        mult, sizes, offsets, tmap = xp.tables(self._on_device, self._np)
        lay = RaggedLayout(xp, qsl, t, w)
        # [lookback oldest first | chunk] per request: compressed ids, the pad id for unknown
        # lookbacks, -1 for DEAD sources.
        cur = xp.where(dead, -1, self._compress(xp, ids, tmap))  # [T]
        carried = xp.flip_cols(lb[:, :w])  # [R, N-1] oldest first
        carried = xp.where(carried == -1, pad, self._compress(xp, carried, tmap))
        carried = xp.where(xp.flip_cols(lbd[:, :w]), -1, carried)
        buf = lay.buffer(carried, cur)  # [T + R*(N-1)]
        mixed_all = xp.empty((t, n_layers, w))  # [T, L, N-1] rolling value of each order
        blocked, rolling = None, None
        for s in range(self.max_ngram_size):
            v = buf[lay.tok_pos - s]  # [T] source of shift s
            blk = v < 0 if pos is None else (v < 0) | (pos < s)
            blocked = blk if blocked is None else blocked | blk
            term = xp.where(blocked, pad, v)[:, None] * mult[:, s]  # [T, L]
            rolling = term if rolling is None else rolling ^ term
            if s >= 1:
                mixed_all[:, :, s - 1] = rolling
        out = xp.remainder(mixed_all[:, :, :, None], sizes)  # [T, L, N-1, H]
        out += offsets
        return out.reshape(t, n_layers, self.columns)

    def next_lookback(
        self,
        input_ids: Array,
        query_start_loc: Array,
        lookback_token_ids: Array,
        dead_mask: Array | None = None,
        lookback_dead_mask: Array | None = None,
        *,
        check: bool = True,
    ) -> tuple[Array, Array]:
        """Each request's lookback and DEAD flags after this chunk ([R, w] newest first, w the
        width of the given lookback); an empty chunk leaves them unchanged."""
        xp, ids, qsl, lb, dead, lbd, _ = self._prepare(
            input_ids,
            query_start_loc,
            lookback_token_ids,
            dead_mask,
            lookback_dead_mask,
            None,
            check,
        )
        lay = RaggedLayout(xp, qsl, ids.shape[0], lb.shape[1])
        tokens = lay.buffer(xp.flip_cols(lb), ids)
        deads = lay.buffer(xp.int64(xp.flip_cols(lbd)), xp.int64(dead))
        return xp.flip_cols(lay.tail(tokens)), xp.flip_cols(lay.tail(deads)) != 0

    def _compress(self, xp: Backend, raw: Array, tmap: Array | None) -> Array:
        """Raw ids -> compressed ids. Clamped first, so DEAD, unknown or unchecked ids never
        index out of bounds (their values are replaced afterwards)."""
        raw = xp.clip(raw, 0, self._id_limit - 1)
        return raw if tmap is None else tmap[raw]

    # -- validation ----------------------------------------------------------------------------
    def _prepare(self, input_ids, query_start_loc, lookback, dead, lookback_dead, positions, check):
        xp = Backend(input_ids)
        ids = xp.ints("input_ids", input_ids, ndim=1)
        qsl = xp.ints("query_start_loc", query_start_loc, ndim=1)
        lb = xp.ints("lookback_token_ids", lookback, ndim=2)
        t, r, w = ids.shape[0], qsl.shape[0] - 1, self.max_ngram_size - 1
        check_request_count(t, qsl.shape[0])
        if lb.shape[0] != r or lb.shape[1] < w:
            raise ValueError(
                f"lookback_token_ids has shape {list(lb.shape)}, expected [{r}, >= {w}]: one row "
                "per request, the tokens before its chunk newest first"
            )
        dead = xp.mask("dead_mask", dead, (t,))
        lbd = xp.mask("lookback_dead_mask", lookback_dead, tuple(lb.shape))
        pos = None if positions is None else xp.ints("positions", positions, ndim=1)
        if pos is not None and pos.shape[0] != t:
            raise ValueError(f"positions has {pos.shape[0]} entries for {t} tokens")
        if check:
            lim = self._id_limit

            def ok():
                good = qsl_ok(qsl, t) & (((ids >= 0) & (ids < lim)) | dead).all()
                good = good & (((lb >= -1) & (lb < lim)) | lbd).all()
                return good if pos is None else good & (pos >= 0).all()

            xp.validate(ok, self._explain, ids, qsl, lb, dead, lbd, pos)
        ids, qsl, lb = xp.int64(ids), xp.int64(qsl), xp.int64(lb)
        pos = None if pos is None else xp.int64(pos)
        if xp.torch and not check:
            qsl = sanitize_query_start_loc(qsl, t)
        return xp, ids, qsl, lb, dead, lbd, pos

    def _explain(self, ids, qsl, lb, dead, lbd, pos) -> None:
        lim = self._id_limit
        what = "token map" if self.token_map is not None else "compressed vocabulary"
        check_query_start_loc(qsl, ids.shape[0])
        check_token_range(ids, qsl, lim, what, skip=dead)
        check_state_range(
            "lookback_token_ids", lb, lim, "lookback slot (newest first)", allowed=(-1,), skip=lbd
        )
        if pos is not None and pos.size and pos.min() < 0:
            t = int(np.argmin(pos))
            r, j = locate(qsl, t)
            raise ValueError(
                f"positions[{t}] = {int(pos[t])} (request {r}, position {j} of its chunk) is "
                "negative"
            )

    def __repr__(self) -> str:
        return (
            f"EngramHash(layers={list(self.layers)}, n={self.max_ngram_size}, "
            f"columns={self.columns}, rows={list(self.rows_per_layer)}, "
            f"token_map={'none' if self.token_map is None else len(self.token_map)})"
        )
