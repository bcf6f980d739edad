"""Qwen4Exp in vLLM with its PLE tables served by plestore: the model classes the plugin
registers for `Qwen4ExpForCausalLM` and `Qwen4ExpForConditionalGeneration` (vLLM's own, plus):

- with `additional_config={"plestore": {...}}`: while vLLM builds the model, the names its n-gram
  module picks the embedding class by (globals of `nvidia/ngram_embedding.py`, per release:
  `releases.py`) name `PlestorePLEEmbedding`, whatever `engram_config.cpu_offload` /
  `disk_offload` say (logged). It allocates no weight; the loader skips the table's tensors
  before reading them; after loading, each layer's table is packed from the checkpoint (or
  reused) and opened on this rank's vocab range; its rows for other ranks' ids are -0.0, so
  vLLM's own all-reduce (or, under sequence parallelism, its n-gram module's reduce-scatter)
  sums the ranks' parts exactly (integrations/layerlookup.py);
- on vLLM's CPU build (no Triton): `cpu.install()`, and the resident class where vLLM would pick
  the pinned one (which needs CUDA). Otherwise the classes are vLLM's, unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator

import torch
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.models.qwen4_exp.common import ngram_embedding as vllm_common
from vllm.models.qwen4_exp.common.ngram_embedding import Qwen4ExpPLEEmbedding
from vllm.models.qwen4_exp.nvidia import model as vllm_model
from vllm.models.qwen4_exp.nvidia import ngram_embedding as vllm_ngram

from plestore.integrations.layerlookup import PleLayerLookup
from plestore.integrations.serving import log_served, open_served
from plestore.integrations.tables import ple_table_of, prepare_table
from plestore.integrations.vllm import cpu, current_release, validate
from plestore.integrations.vllm.config import PlestoreSettings, TableServeError
from plestore.integrations.vllm.contract import check_attributes
from plestore.integrations.vllm.loading import ServedTables

__all__ = [
    "PlestorePLEEmbedding",
    "Qwen4ExpForCausalLM",
    "Qwen4ExpForConditionalGeneration",
]

log = logging.getLogger("vllm.plestore")  # printed with the engine's own log
_TABLE_TENSOR = re.compile(r"\.ple\.ple_embedding\.ngram_embedding\.")
_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


class _NoWeight(QuantizeMethodBase):
    """Creates no parameter: the layer's rows live in a plestore table."""

    def create_weights(self, layer, input_size_per_partition, *args, params_dtype, **kw):
        layer.weight = torch.empty(0, input_size_per_partition, dtype=params_dtype)

    def apply(self, layer, *args, **kwargs):
        raise RuntimeError("a plestore PLE table has no weight to apply")

    def embedding(self, layer, *args, **kwargs):
        raise RuntimeError("a plestore PLE table is read with start_prefetch/finalize_prefetch")


class PlestorePLEEmbedding(Qwen4ExpPLEEmbedding):
    """vLLM's PLE embedding interface over a plestore table of this rank's vocab range."""

    supports_prefetch = True

    def __init__(self, num_embeddings: int, embedding_dim: int, **kw) -> None:
        method = kw.pop("embedding_method")
        self.quantized = _quantized(method)  # None | "fp8_e4m3" | "nvfp4"
        self.heads = kw.get("num_ngram_heads", 1)
        self.max_tokens = kw.get("max_total_tokens", 0)
        super().__init__(num_embeddings, embedding_dim, embedding_method=_NoWeight(), **kw)
        check_attributes(self, "ple-embedding")
        if self.etp_data_parallel_size != 1:
            raise TableServeError(
                f"{self.prefix}: plestore serves PLE tables sharded over TP "
                "(engram_config.embedding_across_dp=False); one table per DP replica, shared "
                'on the node with "share": "node"'
            )
        self.lookup: PleLayerLookup | None = None

    def open(self, model_dir: str, settings: PlestoreSettings) -> None:
        """Pack (or reuse) this layer's table and open it on this rank's rows."""
        try:
            self.lookup = self._open(model_dir, settings)
        except Exception as e:
            raise TableServeError(f"{self.prefix}: {e}") from e

    def _open(self, model_dir: str, settings: PlestoreSettings) -> PleLayerLookup:
        dtype = self.params_dtype
        if self.quantized and dtype != torch.bfloat16:
            raise ValueError(
                f"a {self.quantized} PLE table dequantises to bf16; the model's dtype is {dtype}"
            )
        fmt = self.quantized or _FORMATS.get(dtype)
        if fmt is None:
            raise ValueError(f"no plestore table format delivers {dtype}")
        meta, reused = prepare_table(
            model_dir,
            settings.tables_in(model_dir),
            ple_table_of(self.prefix),
            fmt,
            settings.pack_timeout_s,
        )
        idx = self.shard_indices
        opts = settings.table_options(
            row_start=idx.org_vocab_start_index,
            row_end=idx.org_vocab_end_index,
            device=str(self.weight.device),
        )
        rows, dim = self.org_vocab_size, self.embedding_dim
        table = open_served(meta, opts, rows, dim, "vLLM's table")
        combine = None  # (reduce_results False: vLLM's n-gram module reduce-scatters the parts)
        if self.tp_size > 1 and self.reduce_results:
            combine = self.parallel_group.all_reduce
        summed = self.tp_size > 1
        lookup = PleLayerLookup(table, self.heads, self.max_tokens, combine, summed=summed)
        rank_rows = (idx.org_vocab_start_index, idx.org_vocab_end_index)
        log_served(log, self.prefix, rank_rows, meta, reused, lookup)
        return lookup

    def allocate_embedding_weight(self, num_embeddings, embedding_dim, dtype):
        raise RuntimeError("a plestore PLE table allocates no weight")

    def bind_file_shards(self) -> None:
        """(vLLM 0.34's hook after loading: the table is plestore's, nothing to bind.)"""

    def dequantize(self, embeddings: torch.Tensor, output_dtype: torch.dtype) -> torch.Tensor:
        return embeddings  # the table's rows are already vLLM's dequantised ones, exactly

    def start_prefetch(self, ngram_ids: torch.Tensor) -> None:
        lookup = self._opened()
        if lookup.captures:  # inside a captured step: the GPU reads the ids where they are
            lookup.start(ngram_ids)
        else:
            self._start_eager(ngram_ids)

    @eager_break_during_capture
    def _start_eager(self, ngram_ids: torch.Tensor) -> None:
        self._opened().start(ngram_ids)

    def finalize_prefetch(self, total_tokens: int) -> torch.Tensor:
        lookup = self._opened()
        if lookup.captures or not lookup.capturing():
            return lookup.finish(total_tokens)
        out = lookup.buffer.new_empty((total_tokens, lookup.width))  # fixed across replays
        self._finish_eager(out)
        return out

    @eager_break_during_capture
    def _finish_eager(self, out: torch.Tensor) -> None:
        out.copy_(self._opened().finish(out.shape[0]))

    def forward(self, ngram_ids: torch.Tensor) -> torch.Tensor:
        self.start_prefetch(ngram_ids)
        return self.finalize_prefetch(ngram_ids.shape[0])

    def _opened(self) -> PleLayerLookup:
        if self.lookup is None:
            raise RuntimeError(f"{self.prefix}: the plestore table was never opened")
        return self.lookup


def _quantized(method) -> str | None:
    """The plestore format of vLLM's quantized PLE embedding method, None if unquantized."""
    if isinstance(method, vllm_common.Qwen4ExpPLEFp8EmbeddingMethod):
        return "fp8_e4m3"
    nvfp4 = getattr(vllm_common, "Qwen4ExpPLENvFp4EmbeddingMethod", None)  # (0.33 on)
    if nvfp4 is not None and isinstance(method, nvfp4):
        return "nvfp4"
    return None


@contextlib.contextmanager
def _embedding_classes(settings: PlestoreSettings | None, engram_config) -> Iterator[None]:
    """The classes vLLM's n-gram module picks from, for the duration of the model's build: with
    plestore, each name the engine's engram_config can pick (releases.py) is plestore's; a
    disk-offload name only where disk_offload is on, so vLLM's other choices (its
    reduce-scatter under sequence parallelism) stay as they would be."""
    names = current_release().embedding_classes
    saved = {name: getattr(vllm_ngram, name) for name, _ in names}
    flags = {flag: bool(getattr(engram_config, flag, False)) for _, flag in names if flag}
    if settings is not None:
        for name, flag in names:
            if flag is None or flag == "cpu_offload" or flags[flag]:
                setattr(vllm_ngram, name, PlestorePLEEmbedding)
        picked = next((flag for flag, on in flags.items() if on), None)  # (in vLLM's order)
        if picked:
            log.info(
                "plestore: the PLE tables are plestore's; vLLM's own offload "
                "(engram_config.%s) is not used",
                picked,
            )
    elif cpu.needed():  # the pinned class needs CUDA; a CPU's tables are resident anyway
        vllm_ngram.Qwen4ExpPLEPinnedHostEmbedding = saved["Qwen4ExpPLEDeviceEmbedding"]
    try:
        yield
    finally:
        for name, cls in saved.items():
            setattr(vllm_ngram, name, cls)


class _PlestoreModel(ServedTables):
    """What both Qwen4Exp classes add to vLLM's (mixed in front of them)."""

    TABLE_TENSOR = _TABLE_TENSOR

    def __init__(self, *, vllm_config, prefix: str | None = None) -> None:
        settings = validate(vllm_config)
        if cpu.needed():
            cpu.install(current_release())
        with _embedding_classes(settings, vllm_config.engram_config):
            kw = {} if prefix is None else {"prefix": prefix}  # (each class has its default)
            super().__init__(vllm_config=vllm_config, **kw)
        self.keep_plestore(vllm_config, settings)

    def open_tables(self, model_dir: str) -> None:
        for module in self.modules():
            if isinstance(module, PlestorePLEEmbedding):
                module.open(model_dir, self.plestore_settings)


class Qwen4ExpForCausalLM(_PlestoreModel, vllm_model.Qwen4ExpForCausalLM):
    pass


class Qwen4ExpForConditionalGeneration(_PlestoreModel, vllm_model.Qwen4ExpForConditionalGeneration):
    pass
