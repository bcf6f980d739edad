"""SGLang's Qwen4-Exp PLE table served by plestore: the class that replaces SGLang's
`Qwen4ExpPinnedHostEmbedding` (which the n-gram module builds when the table is offloaded) and
the two small hooks around the modules that build it.

- `PlestorePinnedHostEmbedding` allocates no host table and no file: it keeps the meta
  embedding's vocab-parallel attributes and its device `weight_scale`, and, once the weights are
  loaded (`open`), this layer's table packed from the checkpoint (or reused) on this rank's vocab
  range. `gather(ids, out)` starts the lookup (a storage tier's reads begin there; inside a CUDA
  graph capture, plestore's staged lookup or graph feed); `reduce(rows)` waits for the rows and
  runs SGLang's own reduce. SGLang's `start_prefetch` calls gather on its prefetch stream one
  layer ahead and `_consume_prefetched_embeddings` calls reduce, then `* weight_scale`, as for
  its own table: the rows are SGLang's exactly (an FP8 table is opened at scale 1.0 and SGLang
  applies its weight_scale; other ranks' rows are -0.0, the identity of its float all-reduce).
- `build_ngram_embedding` (around Qwen4ExpNGramEmbedding.__init__): offload forced on while the
  n-gram module builds, so its table is built on meta and wrapped in the class above whatever
  `--ple-offload-embedding` says; `add_prefetch_stream` (after Qwen4ExpPLELayer.__init__): the
  layer prefetches on CUDA even where SGLang's own offload was off.
"""

from __future__ import annotations

import contextvars
import inspect
import logging

import torch
from sglang.srt.models.qwen4_exp import Qwen4ExpPinnedHostEmbedding
from torch import nn

from plestore.integrations.layerlookup import PleLayerLookup
from plestore.integrations.serving import log_served, open_served
from plestore.integrations.settings import PlestoreSettings, TableServeError
from plestore.integrations.sglang.contract import check_attributes
from plestore.integrations.tables import ple_table_of, prepare_table
from plestore.tablefile import TableFile

__all__ = ["PlestorePinnedHostEmbedding", "add_prefetch_stream", "build_ngram_embedding"]

log = logging.getLogger("sglang.plestore")  # printed with the engine's own log
#: the Qwen4ExpNGramEmbedding being built, and its module name (its table's layer)
_building: contextvars.ContextVar[tuple[nn.Module, str] | None] = contextvars.ContextVar(
    "plestore_sglang_building", default=None
)


class PlestorePinnedHostEmbedding(Qwen4ExpPinnedHostEmbedding):
    """SGLang's PLE host-table interface over a plestore table of this rank's vocab range."""

    #: set by the plugin where it registers: why this engine must not start (None: it may)
    refusal: BaseException | None = None
    _started = 0  # tokens of the gather that reduce finishes

    def __init__(self, embedding, *, backend: str = "pinned", table_dir: str | None = None):
        nn.Module.__init__(self)
        if self.refusal is not None:
            raise TableServeError(f"plestore: {self.refusal}") from self.refusal
        building = _building.get()
        if building is None:
            raise TableServeError(
                "plestore: SGLang built its PLE host table outside Qwen4ExpNGramEmbedding; the "
                "plugin serves the n-gram module's table only"
            )
        ngram, prefix = building
        check_attributes(embedding, "meta-embedding")
        check_attributes(ngram, "ngram-embedding")
        self.prefix = f"{prefix}.ngram_embedding"
        if embedding.num_added_embeddings:
            raise TableServeError(f"{self.prefix}: added vocabulary rows are not served")
        for name in self._COPIED_ATTRIBUTES:
            setattr(self, name, getattr(embedding, name))
        self.quant_method = None  # (SGLang's loader then stages nothing back to the device)
        self.register_buffer("weight_scale", embedding.weight_scale, persistent=True)
        self.storage_dtype = embedding.weight.dtype  # bf16 | float8_e4m3fn, as SGLang built it
        self.heads = int(ngram.ngram_heads)
        self.lookup: PleLayerLookup | None = None
        if backend != "pinned" or table_dir is not None:
            log.info("plestore: %s is plestore's; SGLang's %s backend is not used", prefix, backend)

    def open(self, model_dir: str, settings: PlestoreSettings) -> None:
        """Pack (or reuse) this layer's table and open it on this rank's rows."""
        try:
            self.lookup = self._open(model_dir, settings)
        except Exception as e:
            raise TableServeError(f"{self.prefix}: {e}") from e

    def _open(self, model_dir: str, settings: PlestoreSettings) -> PleLayerLookup:
        fp8 = self.storage_dtype == torch.float8_e4m3fn
        if not fp8 and self.storage_dtype != torch.bfloat16:
            raise ValueError(f"no plestore table format serves SGLang's {self.storage_dtype}")
        fmt = "fp8_e4m3" if fp8 else "bf16"
        tables = settings.tables_in(model_dir)
        name = ple_table_of(self.prefix)
        meta, reused = prepare_table(model_dir, tables, name, fmt, settings.pack_timeout_s)
        idx = self.shard_indices
        device = self.weight_scale.device
        opts = settings.table_options(
            row_start=idx.org_vocab_start_index, row_end=idx.org_vocab_end_index, device=str(device)
        )
        scale = self._checked_scale(meta) if fp8 else None
        table = open_served(meta, opts, self.org_vocab_size, self.embedding_dim, "SGLang's", scale)
        lookup = PleLayerLookup(table, self.heads, 0, summed=self.tp_size > 1, grow=True)
        rank_rows = (idx.org_vocab_start_index, idx.org_vocab_end_index)
        log_served(log, self.prefix, rank_rows, meta, reused, lookup)
        return lookup

    def _checked_scale(self, meta) -> float:
        """1.0: SGLang multiplies the rows by its weight_scale itself; refused where the table's
        own scale is another (a table converted at its own scale)."""
        own = TableFile.open(meta).spec.scale
        sglang = self.weight_scale.detach().float().cpu()
        if torch.tensor([own]).to(self.weight_scale.dtype).float().ne(sglang).any():
            raise ValueError(
                f"{meta} holds its rows at scale {own}; SGLang's weight_scale is "
                f"{sglang.tolist()}: re-pack the table from this checkpoint"
            )
        return 1.0

    def gather(self, input_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Start the lookup of ids [T, heads]; the rows [T, heads, dim] are ready at reduce."""
        lookup = self._opened()
        shape = (*input_ids.shape, self.embedding_dim)
        if out is not None and tuple(out.shape) != shape:
            raise ValueError(f"{self.prefix}: rows buffer {tuple(out.shape)}, expected {shape}")
        ids = input_ids.long()
        self._started = ids.shape[0]
        if ids.shape[0] == 0:
            return out if out is not None else ids.new_empty(shape, dtype=torch.bfloat16)
        lookup.start(ids, out)
        return (lookup.buffer[: ids.shape[0]] if out is None else out).view(shape)

    def reduce(self, output: torch.Tensor) -> torch.Tensor:
        """The started lookup's rows, summed over the ranks by SGLang's own reduce."""
        n = output.shape[0]
        if n and self._started:
            output = self._opened().finish(n).view(output.shape)
        self._started = 0
        return super().reduce(output)

    def _opened(self) -> PleLayerLookup:
        if self.lookup is None:
            raise RuntimeError(f"{self.prefix}: the plestore table was never opened")
        return self.lookup


_NGRAM_INIT: inspect.Signature | None = None


def build_ngram_embedding(original, *args, **kwargs):
    """Around Qwen4ExpNGramEmbedding.__init__: its table built on meta and wrapped in
    PlestorePinnedHostEmbedding, whatever the engine's offload flag says."""
    global _NGRAM_INIT
    if _NGRAM_INIT is None:
        _NGRAM_INIT = inspect.signature(original)
    bound = _NGRAM_INIT.bind(*args, **kwargs)
    bound.apply_defaults()
    module, config = bound.arguments["self"], bound.arguments["config"]
    saved = getattr(config, "ple_offload_embedding", False)
    config.ple_offload_embedding = True
    token = _building.set((module, bound.arguments["prefix"]))
    try:
        original(*args, **kwargs)
    finally:
        _building.reset(token)
        config.ple_offload_embedding = saved


def add_prefetch_stream(_result, layer, *args, **kwargs) -> None:
    """After Qwen4ExpPLELayer.__init__: a CUDA table prefetches one layer ahead on its own
    stream, as SGLang's offloaded table does (on CPU the layer looks its rows up in place)."""
    check_attributes(layer, "ple-layer")
    emb = layer.ple_embedding.ngram_embedding
    ours = isinstance(emb, PlestorePinnedHostEmbedding)
    if ours and layer._prefetch_stream is None and emb.weight_scale.device.type == "cuda":
        layer._prefetch_stream = torch.cuda.Stream(device=emb.weight_scale.device)
