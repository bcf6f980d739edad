"""vLLM: PLE tables served by plestore inside a stock vLLM engine (a general plugin; no vLLM file
is patched).

    vllm serve CKPT --additional-config '{"plestore": {"tier": "direct"}}'
    LLM(CKPT, additional_config={"plestore": {"tier": "pinned", "share": "node"}})

vLLM runs `register()` (entry point `vllm.general_plugins`: plestore) in every process it starts.
It is cheap and idempotent and changes nothing an engine does unless that engine's
`additional_config` has a "plestore" entry — except on vLLM's CPU build without Triton, where it
is what lets Qwen4Exp run at all (`cpu.py`). What it does:

- registers plestore's subclasses of vLLM's `Qwen4ExpForCausalLM`,
  `Qwen4ExpForConditionalGeneration` (`qwen.py`), `Gemma3nForCausalLM` (`gemma.py`) and
  `DeepseekV41ForCausalLM` (`deepseek.py`: its Engram layers, `engram.py`), imported
  lazily by vLLM's model registry; they are vLLM's classes unless plestore is asked for;
- checks a "plestore" entry when the engine's config is made (`EngineArgs.create_engine_config`),
  in the process that starts the engine: unknown keys, the vLLM release (`releases.py`: the
  tested ones, each with its adapter), every vLLM name the plugin relies on (`contract.py`), a
  model without tables;
- puts every served table's counters into vLLM's Prometheus `/metrics` (`metrics.py`).

docs/vllm.md has the details, the CUDA-graph decision and what is measured.
"""

from __future__ import annotations

import functools
import logging

from plestore.integrations.metrics import install_collector
from plestore.integrations.serving import run_once
from plestore.integrations.vllm.config import (
    ALLOW_UNTESTED,
    SUPPORTED_VLLM,
    PlestoreSettings,
    TableServeError,
    UnsupportedVllm,
    check_vllm_version,
)
from plestore.integrations.vllm.contract import ContractBroken, check_attributes, verify
from plestore.integrations.vllm.releases import Release, release_line

__all__ = [
    "ALLOW_UNTESTED",
    "SUPPORTED_VLLM",
    "ContractBroken",
    "PlestoreSettings",
    "TableServeError",
    "UnsupportedVllm",
    "current_release",
    "register",
    "validate",
]

log = logging.getLogger("vllm.plestore")  # printed with the engine's own log
#: architecture -> the module of plestore's class of that name
MODELS = {
    "Qwen4ExpForCausalLM": "qwen",
    "Qwen4ExpForConditionalGeneration": "qwen",
    "Gemma3nForCausalLM": "gemma",
    "DeepseekV41ForCausalLM": "deepseek",
}


@run_once
def register() -> None:
    """vLLM's general-plugin entry point."""
    import vllm
    from vllm.platforms import current_platform

    _check_at_config()
    try:
        release = check_vllm_version(vllm.__version__)
    except UnsupportedVllm as e:
        log.warning("plestore: %s; the plugin stays off", e)
        return
    if release.version != release_line(vllm.__version__):
        log.warning(
            "plestore: vLLM %s is not a release the plugin was tested with (%s); running "
            "it with vLLM %s's adapter, at your own risk (%s is set)",
            vllm.__version__,
            ", ".join(SUPPORTED_VLLM),
            release.version,
            ALLOW_UNTESTED,
        )
    if current_platform.is_rocm():
        return  # vLLM's ROCm Qwen4Exp is a separate copy the plugin was not built for
    install_collector()  # (plestore's counters in /metrics, from every engine process)
    from vllm import ModelRegistry

    for arch, module in MODELS.items():
        ModelRegistry.register_model(arch, f"plestore.integrations.vllm.{module}:{arch}")


def current_release() -> Release:
    """The adapter of the installed vLLM (UnsupportedVllm outside the tested releases, unless
    ALLOW_UNTESTED is set)."""
    import vllm

    return check_vllm_version(vllm.__version__)


def validate(vllm_config) -> PlestoreSettings | None:
    """The engine's plestore settings, checked against the vLLM and the model: ValueError /
    TableServeError / UnsupportedVllm / ContractBroken now, in the process starting the
    engine."""
    settings = PlestoreSettings.from_additional_config(vllm_config.additional_config)
    if settings is None:
        return None
    import vllm
    from vllm.platforms import current_platform

    release = current_release()
    check_attributes(vllm_config, "vllm-config")
    model = vllm_config.model_config
    if current_platform.is_rocm():
        raise TableServeError("plestore's vLLM plugin serves tables on CUDA and CPU, not ROCm")
    arch = model.architecture
    if arch not in MODELS:
        raise TableServeError(
            f"additional_config.plestore is set, but {model.model} ({arch}) has no table "
            f"plestore serves in vLLM; it serves {', '.join(MODELS)}"
        )
    verify(vllm.__version__, release, ("all", MODELS[arch]))
    cfg = model.hf_text_config
    if MODELS[arch] == "qwen" and not getattr(cfg, "ple_layer_ids", None):
        raise TableServeError(
            f"additional_config.plestore is set, but {model.model} has no PLE layers "
            "(ple_layer_ids is empty)"
        )
    if MODELS[arch] == "deepseek" and not getattr(cfg, "engram_layer_ids", None):
        raise TableServeError(
            f"additional_config.plestore is set, but {model.model} has no Engram layers "
            "(engram_layer_ids is empty)"
        )
    from plestore.kernels import triton_available

    gpu_graphs = not current_platform.is_cpu() and not model.enforce_eager
    if MODELS[arch] in ("gemma", "deepseek") and gpu_graphs and not triton_available():
        raise TableServeError(  # (its lookup runs in the model's forward, which graphs capture)
            f"plestore captures {arch}'s table lookups in vLLM's CUDA graphs with Triton "
            "(a host tier's wait for its rows): install Triton, or start the engine with "
            "enforce_eager=True (--enforce-eager)"
        )
    return settings


def _check_at_config() -> None:
    """Wrap EngineArgs.create_engine_config so a bad "plestore" entry fails before any worker
    starts (the same checks run again where the model is built)."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, "plestore_checks", False):
        return

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        validate(config)
        return config

    create_engine_config.plestore_checks = True
    EngineArgs.create_engine_config = create_engine_config
