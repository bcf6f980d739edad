"""SGLang: PLE tables served by plestore inside a stock SGLang engine (a general plugin; no
SGLang file is patched).

    PLESTORE_SGLANG='{"tier": "direct"}' python -m sglang.launch_server --model-path CKPT
    PLESTORE_SGLANG='{"tier": "mapped"}' python -c 'import sglang; sglang.Engine(...)'

SGLang runs `register()` (entry point `sglang.srt.plugins`: plestore) in every process it
starts. Without PLESTORE_SGLANG it does nothing. With it, it checks the settings, the SGLang
release (`settings.py`) and every SGLang name the plugin relies on (`contract.py`), then
registers its hooks with SGLang's HookRegistry:

    REPLACE Qwen4ExpPinnedHostEmbedding                    embedding.PlestorePinnedHostEmbedding
    AROUND  Qwen4ExpNGramEmbedding.__init__                its table built on meta: ours
    AFTER   Qwen4ExpPLELayer.__init__                      a prefetch stream on CUDA
    AFTER   Qwen4ExpForConditionalGeneration.load_weights  the tables packed / opened
    AFTER   DefaultModelLoader._prepare_weights            table-only files dropped
    BEFORE  load_model_with_memory_saver                   a model plestore serves
    BEFORE  TpModelWorker.forward_batch_generation         the graph feeds woken (steps.py)
    BEFORE  the batch result processor's decode / prefill  the feeds checked after the sync
    rebound weight_utils.safetensors                       table tensors never read

SGLang only logs a plugin's exception and goes on, so a refusal found here (a bad setting, an
untested release, a renamed name) is raised where the engine starts instead: in
`ServerArgs.resolve_once` and in the replaced class's constructor — never a silent fallback to
stock SGLang. docs/sglang.md has the details.
"""

from __future__ import annotations

import functools
import logging
from importlib import metadata

from plestore.integrations.serving import run_once
from plestore.integrations.settings import TableServeError
from plestore.integrations.sglang.settings import (
    ALLOW_UNTESTED,
    ENV,
    SUPPORTED_SGLANG,
    UnsupportedSglang,
    check_sglang_version,
    settings_from_env,
)

__all__ = [
    "ALLOW_UNTESTED",
    "ENV",
    "SUPPORTED_SGLANG",
    "UnsupportedSglang",
    "register",
]

log = logging.getLogger("sglang.plestore")
_MODEL = "sglang.srt.models.qwen4_exp"


@run_once
def register() -> None:
    """SGLang's general-plugin entry point."""
    try:
        settings = settings_from_env()
        if settings is None:
            return
        version = metadata.version("sglang")
        check_sglang_version(version)
        from plestore.integrations.sglang.contract import verify

        verify(version)
    except Exception as e:  # (raised where the engine starts: below)
        _refuse(e)
        return
    _install(settings)
    log.info("plestore: serving SGLang's PLE tables (%s)", settings.options or "defaults")


def _install(settings) -> None:
    from sglang.srt.model_loader import weight_utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from plestore.integrations.sglang import loading, steps
    from plestore.integrations.sglang.embedding import (
        PlestorePinnedHostEmbedding,
        add_prefetch_stream,
        build_ngram_embedding,
    )

    hooks = (
        (f"{_MODEL}.Qwen4ExpPinnedHostEmbedding", PlestorePinnedHostEmbedding, HookType.REPLACE),
        (f"{_MODEL}.Qwen4ExpNGramEmbedding.__init__", build_ngram_embedding, HookType.AROUND),
        (f"{_MODEL}.Qwen4ExpPLELayer.__init__", add_prefetch_stream, HookType.AFTER),
        (
            f"{_MODEL}.Qwen4ExpForConditionalGeneration.load_weights",
            functools.partial(
                loading.open_tables, settings=settings, served=PlestorePinnedHostEmbedding
            ),
            HookType.AFTER,
        ),
        (
            "sglang.srt.model_loader.loader.DefaultModelLoader._prepare_weights",
            loading.drop_table_files,
            HookType.AFTER,
        ),
        (
            "sglang.srt.model_executor.model_runner_components.load_model_utils."
            "load_model_with_memory_saver",
            loading.check_model,
            HookType.BEFORE,
        ),
    )
    hooks += tuple((target, hook, HookType.BEFORE) for target, hook in steps.HOOKS)
    for target, hook, kind in hooks:
        HookRegistry.register(target, hook, kind)
    if not isinstance(weight_utils.safetensors, loading.TableSkippingSafetensors):
        weight_utils.safetensors = loading.TableSkippingSafetensors(weight_utils.safetensors)


def _refuse(error: Exception) -> None:
    """Make the engine's start fail with `error`: SGLang would only log it here."""
    log.error("plestore: %s", error)
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def refuse(*args, **kwargs):
        raise TableServeError(f"plestore: {error}") from error

    HookRegistry.register("sglang.srt.server_args.ServerArgs.resolve_once", refuse, HookType.BEFORE)
    try:
        from plestore.integrations.sglang.embedding import PlestorePinnedHostEmbedding
    except Exception:  # (the class itself cannot be built on this SGLang)
        return
    PlestorePinnedHostEmbedding.refusal = error
    HookRegistry.register(
        f"{_MODEL}.Qwen4ExpPinnedHostEmbedding", PlestorePinnedHostEmbedding, HookType.REPLACE
    )
