"""Gemma 3n in vLLM with its per-layer embeddings from a plestore table: the class the plugin
registers for `Gemma3nForCausalLM` (vLLM's own, plus, with `additional_config={"plestore": ...}`):

vLLM's text-only Gemma 3n never reads its per-layer table: its forward takes `per_layer_inputs`
that nothing in the runner supplies, and without them the per-layer inputs are the projection
alone, so its tokens differ from transformers'. This class builds the model without the table
(`embed_tokens_per_layer` made as a placeholder, its checkpoint tensor never read), and each
step computes what vLLM's own `get_per_layer_input_embeddings` would from it — rows of the ids
below `vocab_size_per_layer_input` (others: id 0), times `embed_scale_per_layer` — into a fixed
buffer [max_tokens, layers, dim] passed as `per_layer_inputs`, outside the compiled text model.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from vllm.model_executor.models import gemma3n as vllm_gemma

from plestore.integrations.vllm import validate
from plestore.integrations.vllm.config import TableServeError
from plestore.integrations.vllm.loading import close_at_exit, model_dir_of, tables_unread
from plestore.integrations.vllm.tables import prepare_table
from plestore.lookup import Table
from plestore.tablefile import TableFile

__all__ = ["Gemma3nForCausalLM"]

log = logging.getLogger("vllm.plestore")  # printed with the engine's own log
_TABLE = "embed_tokens_per_layer"
_TABLE_TENSOR = re.compile(r"(^|\.)embed_tokens_per_layer\.")


class _NoTable(nn.Module):
    """Where vLLM keeps the per-layer table: nothing (the rows come from plestore)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the per-layer table is served by plestore (Gemma3nForCausalLM)")


@contextlib.contextmanager
def _without_per_layer_table() -> Iterator[None]:
    real = vllm_gemma.VocabParallelEmbedding

    def make(num_embeddings, embedding_dim, *args, prefix: str = "", **kw):
        if prefix.endswith(".per_layer_embed_tokens"):
            return _NoTable(num_embeddings, embedding_dim)
        return real(num_embeddings, embedding_dim, *args, prefix=prefix, **kw)

    vllm_gemma.VocabParallelEmbedding = make
    try:
        yield
    finally:
        vllm_gemma.VocabParallelEmbedding = real


class Gemma3nForCausalLM(vllm_gemma.Gemma3nForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        settings = validate(vllm_config)
        with _without_per_layer_table() if settings else contextlib.nullcontext():
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.plestore_settings = settings
        self.plestore_source = vllm_config.model_config, vllm_config.load_config
        self.plestore_max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.plestore_table: Table | None = None

    def is_unused_checkpoint_weight(self, name: str) -> bool:
        return self.plestore_settings is not None and bool(_TABLE_TENSOR.search(name))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self.plestore_settings is None:
            return super().load_weights(weights)
        with tables_unread(_TABLE_TENSOR):
            loaded = super().load_weights((n, w) for n, w in weights if not _TABLE_TENSOR.search(n))
        try:
            self._open()
        except Exception as e:
            raise TableServeError(f"model.{_TABLE}: {e}") from e
        return loaded

    def _open(self) -> None:
        settings = self.plestore_settings
        decoder = self.model.self_decoder
        model_dir = model_dir_of(*self.plestore_source)
        meta, reused = prepare_table(
            model_dir, settings.tables_in(model_dir), _TABLE, None, settings.pack_timeout_s
        )
        scale = decoder.embed_scale_per_layer
        table = Table(TableFile.open(meta), settings.table_options(device=str(scale.device)))
        close_at_exit(table)
        cfg = self.config
        width = cfg.num_hidden_layers * cfg.hidden_size_per_layer_input
        if (table.spec.rows, table.dim) != (cfg.vocab_size_per_layer_input, width):
            table.close()
            raise ValueError(
                f"{meta} is [{table.spec.rows}, {table.dim}]; the model's per-layer table is "
                f"[{cfg.vocab_size_per_layer_input}, {width}]"
            )
        self.plestore_table = table
        # [max_tokens, layers * dim]: per_layer_inputs at fixed addresses for the graphs
        self.plestore_rows = torch.empty(
            self.plestore_max_tokens, width, dtype=scale.dtype, device=scale.device
        )
        log.info(
            "plestore: %s from %s (%s), tier %s",
            _TABLE,
            meta,
            "reused" if reused else "packed",
            table.tier.name,
        )

    def forward(self, input_ids, positions, *, per_layer_inputs=None, **kwargs):
        if self.plestore_table is not None and per_layer_inputs is None and input_ids is not None:
            per_layer_inputs = self._per_layer_inputs(input_ids)
        return super().forward(input_ids, positions, per_layer_inputs=per_layer_inputs, **kwargs)

    def _per_layer_inputs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T, layers, dim]: the table's rows of the ids (id 0 for ids outside it), scaled."""
        cfg, n = self.config, input_ids.shape[0]
        ids = torch.where(
            (input_ids >= 0) & (input_ids < cfg.vocab_size_per_layer_input), input_ids, 0
        )
        rows = self.plestore_table.lookup(ids[:, None])  # [T, layers * dim]
        out = self.plestore_rows[:n]
        torch.mul(rows.to(out.dtype), self.model.self_decoder.embed_scale_per_layer, out=out)
        return out.view(n, cfg.num_hidden_layers, cfg.hidden_size_per_layer_input)
