"""DeepSeek-V4.1's Engram layers with their tables served by plestore: the classes the model
builds in place of vLLM's `Engram` / `ParallelEngramEmbedding` (`deepseek.py` rebinds them while
vLLM builds the model). What stays vLLM's: `NgramHashState` (the ids), the `wkv` projection, the
fused post-wkv kernel, and every collective (its DP gather of the ids, its DP exchange and TP
all-gather of the rows).

- `PlestoreEngramEmbedding` shards as vLLM's does (heads over TP × DP, slot
  `tp_rank · dp + dp_rank`, ceil(heads / shards) columns, zeros for padded heads: the same split
  as `open_sharded(shard="heads")`, `plestore.distributed.plan_shard`; heads over TP only in
  vLLM's DP-shared layout, which `share="node"` asks for: `deepseek.py`) and allocates no table:
  its rank's rows [Σ primes[:first], Σ primes[:end]) are a plestore table opened on that row
  range (any tier; with `share="node"` the DP replicas on a node map one copy). vLLM's own
  collectives stay, so no group of plestore's is made (`open_sharded` would gather itself). It
  takes vLLM's decoded path only (bf16 rows); `EngramBatch`'s packed one is turned off
  (docs/vllm.md says why and what it costs).
- `PlestoreEngram.prepare_embeddings` (called for both layers before the first decoder layer)
  *starts* the lookup (`PleLayerLookup.start`: a host tier's reads begin there, inside a CUDA
  graph through its graph feed); `_ready_rows`, where the layer consumes them, finishes it. So
  layer 14's reads overlap layers 1-13.

Ids vLLM pads with (`DEAD_ID`, -1: the DP gather's padding and `dummy_hashes`) get zero rows,
as vLLM's kernel writes them; every other id must be in its column's rows (the table checks).
"""

from __future__ import annotations

import logging

import torch
from vllm.config import get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.models.deepseek_v41.common import engram as vllm_engram

from plestore.distributed.partition import plan_shard
from plestore.integrations.layerlookup import PleLayerLookup
from plestore.integrations.serving import log_served, open_served
from plestore.integrations.settings import PlestoreSettings, TableServeError
from plestore.integrations.tables import prepare_table
from plestore.integrations.vllm.contract import check_attributes

__all__ = ["PlestoreEngram", "PlestoreEngramEmbedding", "engram_table_name"]

log = logging.getLogger("vllm.plestore")  # printed with the engine's own log
FORMAT = "fp8_ue8m0"  # the checkpoint's rows: e4m3 values + one ue8m0 scale per 32


def engram_table_name(layer_id: int) -> str:
    """The packed table of Engram layer `layer_id` (the config's raw id: 1, 14)."""
    return f"engram.layers.{layer_id}"


class PlestoreEngramEmbedding(vllm_engram.ParallelEngramEmbedding):
    """vLLM's head-sharded Engram embedding over a plestore table of this rank's rows."""

    def __init__(
        self, num_embeddings: int, dim: int, head_sizes: tuple[int, ...], *, layer_id: int
    ) -> None:
        # vLLM's own offload choices are plestore's tier and share settings here: its
        # constructor only computes the split (TP-only where the DP replicas share a copy)
        config = get_current_vllm_config()
        self.node_copy = bool(getattr(config.engram_config, "dp_shared_memory", False))
        self.max_tokens = config.scheduler_config.max_num_batched_tokens
        super().__init__(num_embeddings, dim, head_sizes)
        check_attributes(self, "engram-embedding")
        self.device = self.weight.device  # (made under the model's device context)
        del self.weight, self.weight_scale_inv  # no parameter: the loader loads nothing here
        self.layer_id, self.head_sizes = layer_id, tuple(head_sizes)
        # (vLLM asserts every shard has a head; the last one's may be short: padded with zeros)
        self.local_heads = min(self.part_n_hash_cols, self.n_hash_cols - self.head_start)
        self.rows: PleLayerLookup | None = None
        self._step: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (out, DEAD ids)

    def _get_shard_info(self) -> tuple[int, int]:
        if self.node_copy:  # (vLLM's dp_shared_memory layout: every DP replica all heads)
            self.dp_size = 1
        return super()._get_shard_info()

    def _allocate_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """No table: zero rows (a device marker only)."""
        return (
            torch.empty(0, self.dim, dtype=torch.float8_e4m3fn),
            torch.empty(0, self.dim // self.block_size, dtype=torch.uint8),
        )

    @property
    def shard(self) -> tuple[int, int]:
        """(this rank's slot, shards): TP-major over TP × DP, as vLLM splits the heads."""
        if self.dp_size == 1:
            return get_tensor_model_parallel_rank(), self.tp_size
        return vllm_engram.engram_head_shard_rank(), self.tp_size * self.dp_size

    def open(self, model_dir: str, settings: PlestoreSettings) -> None:
        """Pack (or reuse) this layer's table and open it on this rank's rows."""
        try:
            self.rows = self._open(model_dir, settings)
        except Exception as e:
            raise TableServeError(
                f"Engram layer {self.layer_id} ({engram_table_name(self.layer_id)}): {e}"
            ) from e

    def _open(self, model_dir: str, settings: PlestoreSettings) -> PleLayerLookup:
        name = engram_table_name(self.layer_id)
        meta, reused = prepare_table(
            model_dir, settings.tables_in(model_dir), name, FORMAT, settings.pack_timeout_s
        )
        slot, shards = self.shard
        opts = settings.table_options(
            row_start=self.vocab_start_idx, row_end=self.vocab_end_idx, device=str(self.device)
        )
        table = open_served(meta, opts, self.num_embeddings, self.dim, "vLLM's Engram table")
        try:
            self._check_split(table.spec, slot, shards)
        except ValueError:
            table.close()
            raise
        lookup = PleLayerLookup(table, self.local_heads, self.max_tokens * self.dp_size)
        rank_rows = (self.vocab_start_idx, self.vocab_end_idx)
        log_served(log, f"engram layer {self.layer_id}", rank_rows, meta, reused, lookup)
        return lookup

    def _check_split(self, spec, slot: int, shards: int) -> None:
        """The table's primes and split are vLLM's (its config and the table agree)."""
        sizes = tuple(int(s) for s in getattr(spec.hash, "head_sizes", None) or ())
        if sizes != self.head_sizes:
            raise ValueError(
                f"the table's {len(sizes)} hash heads of {sizes[:3]}... rows differ from the "
                f"model config's {len(self.head_sizes)} ({self.head_sizes[:3]}...): re-pack the "
                "tables from this checkpoint (remove the table directory)"
            )
        plan = plan_shard(spec, "heads", slot, shards)
        want = (self.head_start, self.head_start + self.local_heads)
        got = (plan.rows.start, plan.rows.end)
        if plan.columns != want or got != (self.vocab_start_idx, self.vocab_end_idx):
            raise ValueError(f"plestore's head split {plan} is not vLLM's (columns {want})")

    # -- a step ------------------------------------------------------------------------------
    def start(self, hash_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Start the rows of ids [T, heads] (every column; this rank reads its own) into
        `out` [T, part_heads, dim] bf16, finished by `finish()`."""
        lookup = self._opened()
        n, local = hash_ids.shape[0], self.local_heads
        ids = hash_ids[:, self.head_start : self.head_start + local].to(torch.int64)
        dead = ids < 0  # vLLM's padding ids (DEAD_ID): zero rows, as its kernel writes
        ids = ids.masked_fill(dead, self.vocab_start_idx)
        direct = local == self.part_n_hash_cols and out.is_contiguous()
        lookup.start(ids, out.view(n, -1) if direct else None)
        self._step = (out, dead)

    def finish(self) -> torch.Tensor:
        """The started step's rows, in the `out` given to start()."""
        if self._step is None:
            raise RuntimeError(f"Engram layer {self.layer_id}: rows finished without a start")
        out, dead = self._step
        self._step = None
        n, local = out.shape[0], self.local_heads
        rows = self._opened().finish(n).view(n, local, self.dim)
        if rows.data_ptr() != out.data_ptr():
            out[:, :local].copy_(rows)
            out[:, local:].zero_()
        out[:, :local].masked_fill_(dead.unsqueeze(-1), 0)
        return out

    def lookup(self, indices: torch.Tensor, out: torch.Tensor, background: bool = False) -> None:
        """vLLM's lookup, decoded rows only ([T, part_heads, dim] bf16)."""
        if out.dtype != torch.bfloat16:
            raise RuntimeError(
                f"Engram layer {self.layer_id}: plestore serves decoded (bf16) rows, not "
                "EngramBatch's packed bytes (turned off with plestore; docs/vllm.md)"
            )
        if indices.shape[0]:
            self.start(indices, out)
            self.finish()

    def collapse_huge_pages(self) -> None:
        """(vLLM's use_thp hook: plestore's tiers manage their own memory.)"""

    def _opened(self) -> PleLayerLookup:
        if self.rows is None:
            raise RuntimeError(f"Engram layer {self.layer_id}: the plestore table was never opened")
        return self.rows


class PlestoreEngram(vllm_engram.Engram):
    """vLLM's Engram layer; its rows are started before the decoder layers and finished where
    the layer consumes them."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        check_attributes(self, "engram-layer")

    def _create_embedding(self, layout, layer_hash_index: int) -> PlestoreEngramEmbedding:
        i = layer_hash_index
        head_sizes = tuple(size for order in layout.primes[i] for size in order)
        return PlestoreEngramEmbedding(
            layout.num_embeddings[i], layout.head_dim, head_sizes, layer_id=layout.layer_ids[i]
        )

    def prepare_embeddings(self, hash_ids: torch.Tensor) -> None:
        """Start this layer's rows (DP-sharded tables: the group's gathered ids)."""
        rows = self.staged_rows[: hash_ids.shape[0]]
        if rows.shape[0] != hash_ids.shape[0]:
            raise RuntimeError(f"{hash_ids.shape[0]} tokens exceed the Engram staging buffer")
        self.embed_tokens.start(hash_ids, rows)

    def _ready_rows(self, num_tokens: int) -> torch.Tensor:
        self.embed_tokens.finish()
        return super()._ready_rows(num_tokens)
