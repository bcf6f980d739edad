"""Every SGLang name the plugin replaces or relies on, listed once: checked when the plugin
registers (a renamed symbol is a refusal naming it: `verify`) and, for every supported release,
by the contract job (.ci/sglang-contract, tests/sglang_contract).

    USES       module-level names: what the plugin replaces, wraps, rebinds, calls or reads,
               with the parameters it passes or relies on
    ATTRIBUTES what it reads from SGLang's objects (checked where one is first met:
               `check_attributes`, and by the contract tests on real instances)
"""

from __future__ import annotations

from plestore.integrations.contract import (
    ContractBroken,
    Use,
    broken_uses,
    missing_attributes,
)

__all__ = ["ATTRIBUTES", "USES", "check_attributes", "verify"]

_MODEL = "sglang.srt.models.qwen4_exp"
_LOADER = "sglang.srt.model_loader"
_RESULTS = "sglang.srt.managers.scheduler_components.batch_result_processor"

# (a table: one use a line or two)
# fmt: off
USES: tuple[Use, ...] = (
    Use("sglang.srt.plugins.hook_registry:HookRegistry.register", "called",
        "the plugin's hooks", ("target", "hook", "hook_type")),
    Use("sglang.srt.plugins.hook_registry:HookType", "read", "REPLACE / AROUND / BEFORE / AFTER"),
    Use(f"{_MODEL}:Qwen4ExpPinnedHostEmbedding", "replaced",
        "the class: the n-gram module builds plestore's (no host table, no file)",
        ("embedding", "backend", "table_dir")),
    Use(f"{_MODEL}:Qwen4ExpPinnedHostEmbedding._COPIED_ATTRIBUTES", "read",
        "the vocab-parallel attributes kept from the meta embedding"),
    Use(f"{_MODEL}:Qwen4ExpPinnedHostEmbedding.allocate_output", "called",
        "SGLang's buffer for a layer's rows (symmetric memory under TP)", ("shape", "device")),
    Use(f"{_MODEL}:Qwen4ExpPinnedHostEmbedding.gather", "replaced", "starts plestore's lookup",
        ("input_ids", "out")),
    Use(f"{_MODEL}:Qwen4ExpPinnedHostEmbedding.reduce", "replaced",
        "waits for the rows, then SGLang's own all-reduce", ("output",)),
    Use(f"{_MODEL}:Qwen4ExpNGramEmbedding.__init__", "wrapped",
        "offload forced on while it builds (its table on meta), the layer's name kept",
        ("config", "embedding_dim", "ple_layer_index", "quant_config", "prefix")),
    Use(f"{_MODEL}:Qwen4ExpPLELayer.__init__", "wrapped",
        "a prefetch stream on CUDA", ("config", "quant_config", "prefix", "layer_id")),
    Use(f"{_MODEL}:Qwen4ExpPLELayer.start_prefetch", "read",
        "calls gather on its stream one layer ahead", ("batch", "forward_batch")),
    Use(f"{_MODEL}:Qwen4ExpPLELayer._consume_prefetched_embeddings", "read",
        "calls reduce, then * weight_scale", ("forward_batch",)),
    Use(f"{_MODEL}:Qwen4ExpForConditionalGeneration.load_weights", "wrapped",
        "the tables opened once the rest is loaded", ("weights",)),
    Use(f"{_LOADER}.weight_utils:safetensors", "replaced",
        "rebound: its safe_open lists no table tensor (they are never read)"),
    Use(f"{_LOADER}.weight_utils:safetensors_weights_iterator", "read",
        "opens files through weight_utils.safetensors", ("hf_weights_files",)),
    Use(f"{_LOADER}.weight_utils:buffered_multi_thread_safetensors_weights_iterator", "read",
        "opens files through weight_utils.safetensors", ("hf_weights_files",)),
    Use(f"{_LOADER}.loader:DefaultModelLoader._prepare_weights", "wrapped",
        "files holding only table tensors dropped (never opened)",
        ("model_name_or_path", "revision")),
    Use("sglang.srt.model_executor.model_runner_components.load_model_utils:"
        "load_model_with_memory_saver", "wrapped", "the model is one plestore serves",
        ("model_config", "is_draft_worker")),
    Use("sglang.srt.server_args:ServerArgs.resolve_once", "wrapped",
        "a refused start fails where the engine starts"),
    Use("sglang.srt.runtime_context:get_server_args", "called", "the model's path"),
    Use("sglang.srt.managers.tp_worker:TpModelWorker.forward_batch_generation", "wrapped",
        "the graph feeds woken as a step begins"),
    Use(f"{_RESULTS}:SchedulerBatchResultProcessor.process_batch_result_decode", "wrapped",
        "the feeds checked after the sampled tokens' sync", ("batch", "result")),
    Use(f"{_RESULTS}:SchedulerBatchResultProcessor.process_batch_result_prefill", "wrapped",
        "the feeds checked after the sampled tokens' sync", ("batch", "result")),
)

#: attributes of SGLang's objects the plugin reads: {what: names (dotted: a chain)}
ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "meta-embedding": (  # the n-gram module's VocabParallelEmbedding, built on meta
        "weight.dtype", "weight_scale", "num_added_embeddings", "org_vocab_size",
        "embedding_dim", "tp_size", "shard_indices.org_vocab_start_index",
        "shard_indices.org_vocab_end_index",
    ),
    "ngram-embedding": ("ngram_heads",),  # Qwen4ExpNGramEmbedding, while it builds
    "ple-layer": ("ple_embedding.ngram_embedding", "_prefetch_stream"),
    "server-args": ("model_path", "revision", "download_dir"),
    "model-config": ("hf_config.architectures", "hf_text_config", "model_path"),
}
# fmt: on


def verify(version: str) -> None:
    """ContractBroken naming every name this SGLang lacks or changed."""
    problems = broken_uses(USES)
    if problems:
        raise ContractBroken(
            f"plestore's SGLang plugin cannot run on SGLang {version}: it relies on names this "
            "release lacks or changed:\n  " + "\n  ".join(problems)
        )


def check_attributes(obj, what: str) -> None:
    """ContractBroken if `obj` (SGLang's object of kind `what`) lacks an attribute the plugin
    reads from it."""
    missing = missing_attributes(obj, ATTRIBUTES[what])
    if missing:
        raise ContractBroken(
            f"plestore's SGLang plugin reads {', '.join(missing)} from SGLang's "
            f"{type(obj).__name__} ({what}), which this SGLang lacks"
        )
