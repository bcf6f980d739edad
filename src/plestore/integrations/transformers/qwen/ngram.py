"""`NGramEmbedding`: the drop-in for Qwen4Exp's `Qwen4ExpTextNGramEmbedding`, rows from a
plestore table instead of an `nn.Embedding` of 320M rows.

transformers (5.17 and 5.24) computes, per PLE layer, for ids [B, S] (already EOS where the
attention mask pads):

    context = cache conv state 2 of this layer (int64 [B, n-1]), or all EOS on a fresh cache
    cache conv state 2 <- last n-1 of [context | ids]      (EOS-padded while ids are shorter)
    ids [B, S, heads] = n-gram hash of [context | ids]     (EOS segments, spec §1.4)
    out = embedding(ids).flatten(-2)                       [B, S, heads * head_dim]

This module does the same with plestore's hash (`Qwen4ExpHash.padded_row_ids`: integer ops on
the ids' device, no host sync) and `Table.lookup`. The cache update is transformers' own call,
so generate, a returned cache continued by a second generate, and both cache APIs keep working.

Prefetch: a forward pre-hook on the text model's first decoder layer — where the PLE ids first
exist, already masked — hashes every PLE layer's ids and starts their lookups
(`Table.prefetch`); each layer then only waits for its rows (`Pending.result()`). A module
called without that hook (or with other ids) hashes and looks up inline.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plestore.hashing import Qwen4ExpHash
from plestore.integrations.transformers.common.served import TableServed
from plestore.lookup import Table

__all__ = ["NGramEmbedding", "install_prefetch"]


def cached_context(cache: Any, layer_idx: int) -> torch.Tensor | None:
    """The n-gram context transformers keeps in `cache` for `layer_idx` (None: none yet)."""
    if cache is None:
        return None
    get = getattr(cache, "get_conv_state", None)  # 5.24
    if get is not None:
        return get(layer_idx, state_idx=2)
    if cache.has_previous_state(layer_idx, state_idx=2):  # 5.17
        return cache.layers[layer_idx].conv_states[2]
    return None


class NGramEmbedding(TableServed):
    """ids [B, S] (+ cache) -> n-gram embeddings [B, S, heads * head_dim] from a table."""

    OFFLOADED = ("ngram_embedding", "the n-gram embedding", ".table.lookup(row_ids)")

    def __init__(
        self,
        table: Table,
        hasher: Qwen4ExpHash,
        *,
        layer_idx: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(table)
        self.hasher = hasher
        self.layer_idx = layer_idx
        self.ple_layer_index = hasher.spec.layer_index
        self.ngram_size = hasher.ngram_size
        self.context_len = hasher.context_width
        self.heads_per_ngram = hasher.heads_per_ngram
        self.ngram_heads = hasher.heads
        self.eos_token_id = hasher.eos_token_id
        self.register_buffer("dtype_ref", torch.empty(0, dtype=dtype, device=device), False)
        self._ahead: tuple | None = None  # (ids, cache, Pending) started by the prefetch hook

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weight this module replaces (follows `model.to(dtype)`)."""
        return self.dtype_ref.dtype

    def row_ids(self, ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """Row ids [B, S, heads] of this step (reads the cached context, never writes it)."""
        ctx = cached_context(cache, self.layer_idx)
        if ctx is None:
            ctx = ids.new_full((ids.shape[0], self.context_len), self.eos_token_id)
        return self.hasher.padded_row_ids(ids, ctx.to(ids.device))

    def prefetch(self, input_ids: torch.Tensor, cache: Any) -> None:
        """Start this step's lookup now (the prefetch hook calls it before layer 0 runs)."""
        ids = input_ids.long()
        self._ahead = (input_ids, cache, self.table.prefetch(self.row_ids(ids, cache)))

    def forward(
        self, input_ids: torch.Tensor, cache: Any = None, past_key_values: Any = None
    ) -> torch.Tensor:
        cache = cache if cache is not None else past_key_values  # 5.24 / 5.17 names
        ahead, self._ahead = self._ahead, None
        ids = input_ids.long()
        if ahead is not None and ahead[0] is input_ids and ahead[1] is cache:
            pending = ahead[2]
        else:
            pending = self.table.prefetch(self.row_ids(ids, cache))
        if cache is not None:  # exactly transformers' update of the carried context
            c = self.context_len
            to_cache = ids
            if cached_context(cache, self.layer_idx) is None and ids.shape[1] < c:
                to_cache = F.pad(ids, (c - ids.shape[1], 0), value=self.eos_token_id)
            cache.update_conv_state(to_cache, self.layer_idx, state_idx=2, conv_kernel_size=c)
        rows = pending.result()  # [B, S, heads * dim] in the table's dtype
        return rows.to(device=input_ids.device, dtype=self.dtype)

    def extra_repr(self) -> str:
        spec = self.table.spec
        return (
            f"layer_idx={self.layer_idx}, ple_layer_index={self.ple_layer_index}, "
            f"{self.num_embeddings}, {self.embedding_dim} x {self.ngram_heads} heads, "
            f"table={spec.name} ({spec.format}, tier={self.table.tier.name}, {self.table.device})"
        )


def install_prefetch(text_model: nn.Module, modules: list[NGramEmbedding]) -> Any:
    """Start every PLE layer's lookup before the text model's first decoder layer runs (its
    kwargs carry the masked PLE ids and the cache). Returns the hook handle."""
    layers = text_model.layers
    refs = [weakref.ref(m) for m in modules]

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("ple_input_ids")
        if ids is None:
            return
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        for ref in refs:
            m = ref()
            if m is not None:
                m.prefetch(ids, cache)

    return layers[0].register_forward_pre_hook(hook, with_kwargs=True)
