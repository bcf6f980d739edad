"""Every vLLM name the plugin replaces or relies on, listed once: checked at engine start
(`verify`: a renamed symbol is a clear refusal naming it, never an AttributeError mid-load) and,
for every supported release, by the contract job (.ci/vllm-contract, tests/vllm_contract).

    USES       module-level names: what the plugin rebinds, wraps, subclasses, calls or reads,
               with the parameters it passes or relies on, and the releases that have them
    ATTRIBUTES what it reads from vLLM's objects (checked where such an object is first met:
               `check_attributes`, and by the contract tests on real instances)

The torch ops registered over vLLM's Triton kernels (`cpu_ops.OVERRIDES`) are checked from that
mapping itself: each kernel must exist and take the parameters its replacement takes.
"""

from __future__ import annotations

import inspect

from plestore.integrations.contract import (
    ContractBroken,
    Use,
    broken_uses,
    missing_attributes,
    missing_params,
    resolve,
)
from plestore.integrations.vllm.releases import Release

__all__ = [
    "ATTRIBUTES",
    "USES",
    "ContractBroken",
    "Use",
    "broken",
    "check_attributes",
    "resolve",
    "verify",
]

_NGRAM = "vllm.models.qwen4_exp.nvidia.ngram_embedding"
_COMMON = "vllm.models.qwen4_exp.common.ngram_embedding"
_GEMMA = "vllm.model_executor.models.gemma3n"
_V1 = "vllm.v1.worker.gpu_model_runner"  # (steps.RUNNERS: V1's runner, then V2's)
_V2 = "vllm.v1.worker.gpu"
_ENGRAM = "vllm.models.deepseek_v41.common.engram"
_DSV41 = "vllm.models.deepseek_v41.nvidia.model"


# (a table: one use a line or two)
# fmt: off
USES: tuple[Use, ...] = (
    Use("vllm.engine.arg_utils:EngineArgs.create_engine_config", "replaced",
        "wrapped: the settings are checked where the engine starts", needed_by="all"),
    Use("vllm:ModelRegistry.register_model", "called", "the plugin's model classes",
        ("model_arch", "model_cls"), needed_by="all"),
    Use("vllm.platforms:current_platform", "read", "is_cpu / is_rocm", needed_by="all"),
    Use("vllm.models.qwen4_exp.nvidia.model:Qwen4ExpForCausalLM", "subclassed",
        "the registered Qwen4Exp class", ("vllm_config", "prefix"), needed_by="qwen"),
    Use("vllm.models.qwen4_exp.nvidia.model:Qwen4ExpForConditionalGeneration", "subclassed",
        "the registered multimodal Qwen4Exp class", ("vllm_config", "prefix"), needed_by="qwen"),
    Use(f"{_NGRAM}:Qwen4ExpPLEPinnedHostEmbedding", "replaced",
        "rebound while the model builds (engram_config.cpu_offload)", needed_by="qwen"),
    Use(f"{_NGRAM}:Qwen4ExpPLEDeviceEmbedding", "replaced",
        "rebound while the model builds (resident tables)", needed_by="qwen"),
    Use(f"{_NGRAM}:Qwen4ExpPLEDiskOffloadEmbedding", "replaced",
        "rebound while the model builds (engram_config.disk_offload)", releases=("0.34",),
        needed_by="qwen"),
    Use(f"{_NGRAM}:Qwen4ExpNGramEmbedding", "read", "the module the plugin's embedding sits in",
        ("config", "embedding_dim", "ple_dense_layer_id", "max_total_tokens",
         "data_parallel_rank", "prefix", "quant_config", "params_dtype",
         "use_sequence_parallel"), needed_by="qwen"),
    Use(f"{_NGRAM}:Qwen4ExpNGramEmbedding._sp_shard_embeddings", "read",
        "where it reduce-scatters (sequence parallel), a sum of the ranks' parts: their -0.0 "
        "rows for other ranks' ids keep it exact", ("embeddings",), needed_by="qwen"),
    Use(f"{_COMMON}:Qwen4ExpPLEEmbedding", "subclassed", "the plugin's PLE embedding",
        ("num_embeddings", "embedding_dim", "params_dtype", "padding_size", "prefix",
         "embedding_method", "num_ngram_heads", "max_total_tokens", "data_parallel_rank",
         "reduce_results"), needed_by="qwen"),
    Use(f"{_COMMON}:Qwen4ExpPLEEmbedding.allocate_embedding_weight", "replaced",
        "allocates nothing", ("num_embeddings", "embedding_dim", "dtype"), needed_by="qwen"),
    Use(f"{_COMMON}:Qwen4ExpPLEEmbedding.start_prefetch", "replaced", "Table.prefetch",
        ("ngram_ids",), needed_by="qwen"),
    Use(f"{_COMMON}:Qwen4ExpPLEEmbedding.finalize_prefetch", "replaced", "Pending.result",
        ("total_tokens",), needed_by="qwen"),
    Use(f"{_COMMON}:Qwen4ExpPLEEmbedding.dequantize", "replaced",
        "identity: plestore's rows are vLLM's dequantised ones", ("embeddings", "output_dtype"),
        needed_by="qwen"),
    Use(f"{_COMMON}:Qwen4ExpPLEEmbedding.supports_prefetch", "replaced",
        "True: the model calls start/finalize_prefetch", needed_by="qwen"),
    Use(f"{_COMMON}:Qwen4ExpPLEEmbedding.bind_file_shards", "replaced",
        "nothing to bind: the table is plestore's", releases=("0.34",), needed_by="qwen"),
    Use(f"{_COMMON}:Qwen4ExpPLEFp8EmbeddingMethod", "read", "an FP8 table (its global scale)",
        needed_by="qwen"),
    Use(f"{_COMMON}:Qwen4ExpPLENvFp4EmbeddingMethod", "read",
        "an NVFP4 table (e2m1 codes, e4m3 block scales, weight_scale_2)",
        releases=("0.33", "0.34"), needed_by="qwen"),
    Use("vllm.model_executor.layers.quantization.base_config:QuantizeMethodBase", "subclassed",
        "the embedding's method that creates no weight", needed_by="qwen"),
    Use("vllm.compilation.breakable_cudagraph:eager_break_during_capture", "called",
        "host tiers' start/finish as eager breaks of a captured step", ("fn",), needed_by="qwen"),
    Use("vllm.model_executor.model_loader.weight_utils:should_skip_weight", "replaced",
        "rebound while loading: the tables' tensors are left unread", needed_by="all"),
    Use(f"{_GEMMA}:Gemma3nForCausalLM", "subclassed", "the registered Gemma 3n class",
        ("vllm_config", "prefix"), needed_by="gemma"),
    Use(f"{_GEMMA}:Gemma3nForCausalLM.forward", "replaced", "passes per_layer_inputs",
        ("input_ids", "positions", "per_layer_inputs"), needed_by="gemma"),
    Use(f"{_GEMMA}:VocabParallelEmbedding", "replaced",
        "rebound while the model builds: no per-layer table", needed_by="gemma"),
    Use(f"{_GEMMA}:Gemma3nTextModel.get_per_layer_input_embeddings", "called",
        "vLLM's masking and scaling of the per-layer rows", ("input_ids",), needed_by="gemma"),
    Use(f"{_V1}:GPUModelRunner.execute_model", "wrapped",
        "the tables' graph feeds woken as a step begins", releases=("0.32", "0.33"),
        needed_by="all"),
    Use(f"{_V1}:GPUModelRunner.sample_tokens", "wrapped",
        "the feeds checked after the sampled tokens' sync", ("grammar_output",),
        releases=("0.32", "0.33"), needed_by="all"),
    Use(f"{_V1}:AsyncGPUModelRunnerOutput.get_output", "wrapped",
        "the feeds checked after the sampled tokens' sync", releases=("0.32", "0.33"),
        needed_by="all"),
    Use(f"{_V2}.model_runner:GPUModelRunner.execute_model", "wrapped",
        "the tables' graph feeds woken as a step begins", needed_by="all"),
    Use(f"{_V2}.model_runner:GPUModelRunner.sample_tokens", "wrapped",
        "the feeds checked after the sampled tokens' sync", ("grammar_output",),
        needed_by="all"),
    Use(f"{_V2}.async_utils:AsyncOutput.get_output", "wrapped",
        "the feeds checked after the sampled tokens' sync", needed_by="all"),
    Use("vllm.models.deepseek_v41.nvidia.vl_model:DeepseekV41ForCausalLM", "subclassed",
        "the registered DeepSeek-V4.1 class", ("vllm_config", "prefix"), needed_by="deepseek"),
    Use(f"{_DSV41}:Engram", "replaced", "rebound while the model builds: plestore's layer",
        needed_by="deepseek"),
    Use(f"{_DSV41}:EngramBatch", "replaced",
        "rebound while the model builds: no batch (the packed path is not served)",
        needed_by="deepseek"),
    Use(f"{_DSV41}:EngramBatch.create", "read", "what the model calls (layers, max_tokens)",
        ("layers", "max_tokens"), needed_by="deepseek"),
    Use(f"{_ENGRAM}:Engram", "subclassed", "the plugin's Engram layer",
        ("config", "quant_config", "layout", "layer_hash_index", "use_sequence_parallel",
         "prefix", "prefetch_stream"), needed_by="deepseek"),
    Use(f"{_ENGRAM}:Engram._create_embedding", "replaced", "builds plestore's embedding",
        ("layout", "layer_hash_index"), needed_by="deepseek"),
    Use(f"{_ENGRAM}:Engram.prepare_embeddings", "replaced",
        "starts the rows before the decoder layers", ("hash_ids",), needed_by="deepseek"),
    Use(f"{_ENGRAM}:Engram._ready_rows", "replaced",
        "finishes them where the layer consumes them, then vLLM's DP exchange",
        ("num_tokens",), needed_by="deepseek"),
    Use(f"{_ENGRAM}:ParallelEngramEmbedding", "subclassed",
        "the plugin's head-sharded embedding (vLLM's split)",
        ("num_embeddings", "dim", "head_sizes", "block_size", "cpu_offload",
         "dp_shared_memory", "use_thp"), needed_by="deepseek"),
    Use(f"{_ENGRAM}:ParallelEngramEmbedding._get_shard_info", "replaced",
        "TP-only heads where the DP replicas share one copy (share: node)", needed_by="deepseek"),
    Use(f"{_DSV41}:can_share_engram_tables", "read",
        "vLLM's check that a node fits one copy (engram_config.dp_shared_memory at build)",
        ("layout",), needed_by="deepseek"),
    Use(f"{_ENGRAM}:ParallelEngramEmbedding._allocate_weights", "replaced",
        "allocates no table", needed_by="deepseek"),
    Use(f"{_ENGRAM}:ParallelEngramEmbedding.lookup", "replaced",
        "decoded rows from the plestore table", ("indices", "out", "background"),
        needed_by="deepseek"),
    Use(f"{_ENGRAM}:ParallelEngramEmbedding.collapse_huge_pages", "replaced",
        "nothing (vLLM's use_thp hook)", needed_by="deepseek"),
    Use(f"{_ENGRAM}:engram_head_shard_rank", "called", "this rank's head slot over TP x DP",
        needed_by="deepseek"),
    Use("vllm.distributed:get_tensor_model_parallel_rank", "called",
        "this rank's head slot over TP", needed_by="deepseek"),
    Use("vllm.config:get_current_vllm_config", "called",
        "scheduler_config.max_num_batched_tokens (the rows' buffer)", needed_by="deepseek"),
    Use("vllm.triton_utils:HAS_TRITON", "read", "whether the CPU stand-in is needed",
        needed_by="cpu"),
    Use("vllm.triton_utils.dispatcher:register_kernels", "called",
        "torch versions of the Triton-only Qwen4Exp ops", ("overrides",), needed_by="cpu"),
    Use("vllm.v1.worker.gpu_model_runner:GPUModelRunner._init_model_kwargs", "replaced",
        "wrapped: the V1 runner's PLE inputs", ("num_reqs",), releases=("0.32", "0.33"),
        needed_by="cpu"),
)

#: attributes of vLLM's objects the plugin reads: {what: names (dotted: a chain)}
ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "vllm-config": (  # the engine's VllmConfig
        "additional_config", "engram_config", "model_config.model",
        "model_config.architecture", "model_config.hf_text_config", "model_config.enforce_eager",
        "model_config.revision", "load_config.download_dir",
        "scheduler_config.max_num_batched_tokens",
    ),
    "ple-embedding": (  # a Qwen4ExpPLEEmbedding, after vLLM's __init__
        "prefix", "params_dtype", "org_vocab_size", "embedding_dim", "tp_size",
        "reduce_results", "etp_data_parallel_size", "weight",
        "shard_indices.org_vocab_start_index", "shard_indices.org_vocab_end_index",
        "parallel_group.all_reduce",
    ),
    "v1-runner": (  # vLLM's V1 GPUModelRunner (the CPU build's runner), after __init__
        "model_config.hf_text_config", "max_num_reqs", "max_num_tokens",
        "query_start_loc.np", "input_batch.num_reqs", "input_batch.num_computed_tokens_cpu",
        "input_batch.token_ids_cpu",
    ),
    "engram-embedding": (  # a ParallelEngramEmbedding, after vLLM's __init__
        "num_embeddings", "dim", "block_size", "n_hash_cols", "part_n_hash_cols", "head_start",
        "vocab_start_idx", "vocab_end_idx", "tp_size", "dp_size", "weight", "weight_scale_inv",
    ),
    "engram-layer": (  # an Engram layer, after vLLM's __init__
        "embed_tokens", "staged_rows", "layer_hash_index",
    ),
    "gemma-model": (  # Gemma3nForCausalLM's model, after __init__
        "self_decoder.embed_tokens_per_layer", "self_decoder.embed_scale_per_layer",
    ),
}
# fmt: on


def broken(
    release: Release, needed_by: tuple[str, ...] = ("all", "qwen", "gemma", "deepseek", "cpu")
):
    """What of the contract this vLLM breaks: ['target: why it fails', ...] for the uses of
    `release` by the given parts of the plugin (and the kernel overrides, for "cpu")."""
    uses = [u for u in USES if u.in_release(release.version) and u.needed_by in needed_by]
    problems = broken_uses(uses)
    if "cpu" in needed_by:
        problems += _broken_overrides()
    return problems


def _broken_overrides() -> list[str]:
    from plestore.integrations.vllm.cpu_ops import OVERRIDES

    problems = []
    for name, fn in OVERRIDES.items():
        module, _, attr = name.rpartition(".")
        try:
            kernel = resolve(f"{module}:{attr}")
        except (ImportError, AttributeError) as e:
            problems.append(f"{name} (a kernel plestore overrides): {type(e).__name__}: {e}")
            continue
        want = tuple(inspect.signature(fn).parameters)
        missing = missing_params(kernel, want)
        if missing:
            problems.append(f"{name} no longer takes {', '.join(missing)}")
    return problems


def verify(version: str, release: Release, needed_by: tuple[str, ...]) -> None:
    """ContractBroken naming every break, for the parts of the plugin this engine uses."""
    problems = broken(release, needed_by)
    if problems:
        raise ContractBroken(
            f"plestore's vLLM plugin cannot run on vLLM {version}: it relies on names this "
            f"release lacks or changed (checked against vLLM {release.version}'s):\n  "
            + "\n  ".join(problems)
        )


def check_attributes(obj, what: str) -> None:
    """ContractBroken if `obj` (vLLM's object of kind `what`) lacks an attribute the plugin
    reads from it."""
    missing = missing_attributes(obj, ATTRIBUTES[what])
    if missing:
        raise ContractBroken(
            f"plestore's vLLM plugin reads {', '.join(missing)} from vLLM's "
            f"{type(obj).__name__} ({what}), which this vLLM lacks"
        )
