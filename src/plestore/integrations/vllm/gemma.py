"""Gemma 3n in vLLM with its per-layer embeddings from a plestore table: the class the plugin
registers for `Gemma3nForCausalLM` (vLLM's own, plus, with `additional_config={"plestore": ...}`):

vLLM's text-only Gemma 3n never reads its per-layer table: its forward takes `per_layer_inputs`
that nothing in the runner supplies, and without them the per-layer inputs are the projection
alone, so its tokens differ from transformers'. This class builds the model with a
`PlestorePerLayerTable` as `embed_tokens_per_layer` (no weight; the checkpoint's table tensor is
dropped unread) and each step passes vLLM's own `get_per_layer_input_embeddings` of the ids (its
masking of ids past the per-layer vocabulary, its `embed_scale_per_layer`) as `per_layer_inputs`,
from a fixed buffer [max_tokens, layers, dim]. The lookup runs in the model's forward, so a CUDA
graph captures it: through the same `PleLayerLookup` as Qwen4Exp's (a tier the GPU reads: its
kernel; a host tier: the table's graph feed, its wait on the GPU). The multimodal
`Gemma3nForConditionalGeneration` is not served (refused at start): its first step fails in
stock vLLM's CPU build, so nothing here runs it.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator

import torch
from torch import nn
from vllm.model_executor.models import gemma3n as vllm_gemma

from plestore.integrations.layerlookup import PleLayerLookup
from plestore.integrations.serving import open_served
from plestore.integrations.tables import prepare_table
from plestore.integrations.vllm import validate
from plestore.integrations.vllm.config import TableServeError
from plestore.integrations.vllm.contract import check_attributes
from plestore.integrations.vllm.loading import ServedTables

__all__ = ["Gemma3nForCausalLM"]

log = logging.getLogger("vllm.plestore")  # printed with the engine's own log
_TABLE = "embed_tokens_per_layer"
_TABLE_TENSOR = re.compile(r"(^|\.)embed_tokens_per_layer\.")


class PlestorePerLayerTable(nn.Module):
    """What vLLM keeps as `embed_tokens_per_layer`: no weight; its rows [T, layers * dim] come
    from a plestore table (opened after loading), in the model's dtype — vLLM's own code masks
    the ids and scales the rows around it."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self.lookup: PleLayerLookup | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.lookup is None:
            raise RuntimeError("the per-layer table was never opened")
        flat = ids.reshape(-1, 1).long()  # [T, 1]: one row a token (captured: the graph's ids)
        self.lookup.start(flat)
        rows = self.lookup.finish(flat.shape[0])  # [T, layers * dim]
        return rows.to(self.dtype).view(*ids.shape, -1)


@contextlib.contextmanager
def _without_per_layer_table() -> Iterator[None]:
    real = vllm_gemma.VocabParallelEmbedding

    def make(num_embeddings, embedding_dim, *args, prefix: str = "", **kw):
        if prefix.endswith(".per_layer_embed_tokens"):
            return PlestorePerLayerTable(num_embeddings, embedding_dim, torch.get_default_dtype())
        return real(num_embeddings, embedding_dim, *args, prefix=prefix, **kw)

    vllm_gemma.VocabParallelEmbedding = make
    try:
        yield
    finally:
        vllm_gemma.VocabParallelEmbedding = real


class Gemma3nForCausalLM(ServedTables, vllm_gemma.Gemma3nForCausalLM):
    TABLE_TENSOR = _TABLE_TENSOR

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        settings = validate(vllm_config)
        with _without_per_layer_table() if settings else contextlib.nullcontext():
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        if settings:
            check_attributes(self.model, "gemma-model")
        self.keep_plestore(vllm_config, settings)
        self.plestore_max_tokens = vllm_config.scheduler_config.max_num_batched_tokens

    def open_tables(self, model_dir: str) -> None:
        try:
            self._open(model_dir)
        except Exception as e:
            raise TableServeError(f"model.{_TABLE}: {e}") from e

    def _open(self, model_dir: str) -> None:
        settings, cfg = self.plestore_settings, self.config
        meta, reused = prepare_table(
            model_dir, settings.tables_in(model_dir), _TABLE, None, settings.pack_timeout_s
        )
        per_layer = self.model.self_decoder.embed_tokens_per_layer
        device = self.model.self_decoder.embed_scale_per_layer.device
        table = open_served(
            meta,
            settings.table_options(device=str(device)),
            per_layer.num_embeddings,
            per_layer.embedding_dim,
            "the model's per-layer table",
        )
        per_layer.lookup = PleLayerLookup(table, 1, self.plestore_max_tokens)
        # [max_tokens, layers, dim]: per_layer_inputs at fixed addresses for the graphs
        shape = (self.plestore_max_tokens, cfg.num_hidden_layers, cfg.hidden_size_per_layer_input)
        self.plestore_rows = torch.empty(shape, dtype=per_layer.dtype, device=device)
        log.info(
            "plestore: %s from %s (%s), tier %s",
            _TABLE,
            meta,
            "reused" if reused else "packed",
            table.tier.name,
        )

    def forward(self, input_ids, positions, *, per_layer_inputs=None, **kwargs):
        """vLLM's forward, given the per-layer inputs its runner never computes: vLLM's own
        get_per_layer_input_embeddings of the ids (rows from plestore), at fixed addresses."""
        if (
            self.plestore_settings is not None
            and per_layer_inputs is None
            and input_ids is not None
        ):
            n = input_ids.shape[0]
            rows = self.model.get_per_layer_input_embeddings(input_ids)  # [T, layers * dim]
            per_layer_inputs = self.plestore_rows[:n]
            per_layer_inputs.view(n, -1).copy_(rows)
        return super().forward(input_ids, positions, per_layer_inputs=per_layer_inputs, **kwargs)
