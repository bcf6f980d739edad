"""`NGramEmbedding`: the drop-in for Qwen4Exp's `Qwen4ExpTextNGramEmbedding`, rows from a
plestore table instead of an `nn.Embedding` of 320M rows.

transformers (5.17 to 5.25) computes, per PLE layer, for ids [B, S] (already EOS where the
attention mask pads):

    context = cache conv state 2 of this layer (int64 [B, n-1]), or all EOS on a fresh cache
    cache conv state 2 <- last n-1 of [context | ids]      (EOS-padded while ids are shorter)
    ids [B, S, heads] = n-gram hash of [context | ids]     (EOS segments, spec §1.4)
    out = embedding(ids).flatten(-2)                       [B, S, heads * head_dim]

This module does the same with plestore's hash (`Qwen4ExpHash.padded_row_ids`: integer ops on
the ids' device, no host sync) and `Table.lookup`. The cache update is transformers' own call,
so generate, a returned cache continued by a second generate, and both cache APIs (5.17 - 5.20:
has_previous_state + conv_states; 5.21+: get_conv_state) keep working; a cache with neither is
refused naming the release (never rows computed another way).

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
from plestore.integrations.transformers.common.release import unknown_api
from plestore.integrations.transformers.common.served import TableServed
from plestore.lookup import Table

__all__ = ["NGramEmbedding", "hook_prefetch", "install_prefetch"]


def cached_context(cache: Any, layer_idx: int, width: int) -> torch.Tensor | None:
    """The n-gram context transformers keeps in `cache` for `layer_idx`: its last `width` ids
    [B, width] (None: none yet). Raises for a cache API plestore does not know."""
    if cache is None:
        return None
    if callable(getattr(cache, "get_conv_state", None)):  # 5.21 and later
        ctx = cache.get_conv_state(layer_idx, state_idx=2)
    elif callable(getattr(cache, "has_previous_state", None)) and hasattr(cache, "layers"):
        # 5.17 - 5.20
        has = cache.has_previous_state(layer_idx, state_idx=2)
        ctx = cache.layers[layer_idx].conv_states[2] if has else None
    else:
        raise unknown_api(
            f"{type(cache).__name__} has neither get_conv_state nor has_previous_state (where "
            "Qwen4Exp keeps each PLE layer's n-gram context)"
        )
    if ctx is None:
        return None
    if ctx.ndim != 2 or ctx.shape[1] < width:
        raise unknown_api(
            f"layer {layer_idx}'s n-gram context (conv state 2) is {list(ctx.shape)}, not "
            f"[batch, >= {width}]"
        )
    # a cache recording its past (assisted decoding) keeps every id; the hash reads the last n-1
    return ctx[:, -width:]


def update_context(cache: Any, ids: torch.Tensor, layer_idx: int, width: int, eos: int) -> None:
    """transformers' own update of the carried context: ids [B, S] appended (EOS-padded to
    `width` on a fresh cache: its update would pad with zeros)."""
    update = getattr(cache, "update_conv_state", None)
    if not callable(update):
        raise unknown_api(f"{type(cache).__name__} has no update_conv_state")
    if cached_context(cache, layer_idx, width) is None and ids.shape[1] < width:
        ids = F.pad(ids, (width - ids.shape[1], 0), value=eos)
    update(ids, layer_idx, state_idx=2, conv_kernel_size=width)


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
        ctx = cached_context(cache, self.layer_idx, self.context_len)
        if ctx is None:
            ctx = ids.new_full((ids.shape[0], self.context_len), self.eos_token_id)
        return self.hasher.padded_row_ids(ids, ctx.to(ids.device))

    def prefetch(self, input_ids: torch.Tensor, cache: Any) -> None:
        """Start this step's lookup now (the prefetch hook calls it before layer 0 runs)."""
        ids = input_ids.long()
        self._ahead = (input_ids, cache, self.table.prefetch(self.row_ids(ids, cache)))

    def forward(
        self, input_ids: torch.Tensor, cache: Any = None, past_key_values: Any = None, **kwargs: Any
    ) -> torch.Tensor:
        # 5.24+ name the cache `cache` (past_key_values deprecated), 5.17 - 5.23 past_key_values;
        # 5.25 passes the layer's TransformersKwargs on (router / attention flags): the stock
        # module hands them to its shift helper, which ignores them, so the rows never depend
        # on them and they are ignored here
        cache = cache if cache is not None else past_key_values
        ahead, self._ahead = self._ahead, None
        ids = input_ids.long()
        if ahead is not None and ahead[0] is input_ids and ahead[1] is cache:
            pending = ahead[2]
        else:
            pending = self.table.prefetch(self.row_ids(ids, cache))
        if cache is not None:
            update_context(cache, ids, self.layer_idx, self.context_len, self.eos_token_id)
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


def hook_prefetch(model: nn.Module, served: list[tuple[Any, NGramEmbedding]]) -> None:
    """One prefetch hook per text model of `model`, starting all its PLE layers' lookups;
    served: (site, module) of every PLE layer."""
    by_text: dict[int, list] = {}
    for site, module in served:
        text_model = model.get_submodule(site.path.rpartition(".layers.")[0])
        by_text.setdefault(id(text_model), [text_model, []])[1].append(module)
    for text_model, modules in by_text.values():
        hook = install_prefetch(text_model, modules)
        for m in modules:
            m.prefetch_hook = hook
