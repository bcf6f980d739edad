"""Every vLLM name, signature and attribute the plugin replaces or relies on (the one list in
`integrations/vllm/contract.py`) against the installed release's real modules, and the release's
adapter (`releases.py`) against what the release holds: a symbol renamed, a parameter dropped or
a new storage class in a future release fails here, not at a user's engine start."""

from __future__ import annotations

import importlib.util
import inspect

import pytest

pytest.importorskip("vllm", reason="the contract job's venvs have vLLM (.ci/vllm-contract)")

from plestore.integrations.vllm import contract

NGRAM = "vllm.models.qwen4_exp.nvidia.ngram_embedding"


def test_every_name_the_plugin_uses_is_there(release):
    assert contract.broken(release) == []


def test_the_plugin_imports_against_this_release(release):
    from vllm.models.qwen4_exp.common.ngram_embedding import Qwen4ExpPLEEmbedding

    from plestore.integrations.vllm import gemma, loading, qwen  # noqa: F401

    assert issubclass(qwen.PlestorePLEEmbedding, Qwen4ExpPLEEmbedding)
    assert not inspect.isabstract(qwen.PlestorePLEEmbedding), (
        qwen.PlestorePLEEmbedding.__abstractmethods__
    )


def test_the_engram_plugin_imports_against_this_release(release):
    """DeepSeek-V4.1's: the plugin's layer, embedding and model class over vLLM's."""
    from vllm.models.deepseek_v41.common import engram as vllm_engram
    from vllm.models.deepseek_v41.nvidia import model as vllm_model

    from plestore.integrations.vllm import deepseek, engram

    assert issubclass(engram.PlestoreEngram, vllm_engram.Engram)
    assert issubclass(engram.PlestoreEngramEmbedding, vllm_engram.ParallelEngramEmbedding)
    assert vllm_model.Engram is vllm_engram.Engram  # (the name the plugin rebinds, unbound)
    assert deepseek.DeepseekV41ForCausalLM.__mro__[1].__name__ == "ServedTables"


def test_the_adapter_matches_the_release(release):
    """The storage classes the n-gram module picks from, the NVFP4 method, the V1 runner, the
    bind_file_shards hook and the engram_config flags are the adapter's, no more, no fewer."""
    from vllm.config.engram import EngramConfig
    from vllm.models.qwen4_exp.common import ngram_embedding as common
    from vllm.models.qwen4_exp.nvidia import ngram_embedding as ngram

    base = common.Qwen4ExpPLEEmbedding
    storage = {
        name
        for name, obj in vars(ngram).items()
        if isinstance(obj, type) and issubclass(obj, base) and obj is not base
    }
    assert storage == {name for name, _ in release.embedding_classes}
    flags = {flag for _, flag in release.embedding_classes if flag}
    assert flags <= set(EngramConfig.__dataclass_fields__), EngramConfig.__dataclass_fields__
    assert hasattr(common, "Qwen4ExpPLENvFp4EmbeddingMethod") == release.nvfp4
    v1 = importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None
    assert v1 == release.v1_runner
    assert hasattr(base, "bind_file_shards") == release.bind_file_shards


def test_a_renamed_name_is_refused_naming_it(release, monkeypatch):
    """What a future release that renamed a class does at engine start: ContractBroken naming
    the name, its role and why the plugin needs it."""
    import vllm
    from vllm.models.qwen4_exp.nvidia import ngram_embedding as ngram

    monkeypatch.delattr(ngram, "Qwen4ExpPLEDeviceEmbedding")
    with pytest.raises(contract.ContractBroken) as e:
        contract.verify(vllm.__version__, release, ("all", "qwen"))
    assert f"{NGRAM}:Qwen4ExpPLEDeviceEmbedding (replaced: rebound while" in str(e.value)
    assert f"cannot run on vLLM {vllm.__version__}" in str(e.value)
    assert "Gemma3n" not in str(e.value)  # (only what is broken is named)


def test_a_dropped_parameter_is_refused_naming_it(release, monkeypatch):
    from vllm.models.qwen4_exp.common import ngram_embedding as common

    def start_prefetch(self, ids):  # renamed from ngram_ids
        return None

    monkeypatch.setattr(common.Qwen4ExpPLEEmbedding, "start_prefetch", start_prefetch)
    assert any(
        "Qwen4ExpPLEEmbedding.start_prefetch no longer takes ngram_ids" in p
        for p in contract.broken(release, ("qwen",))
    )


def test_the_kernels_the_cpu_build_overrides_take_their_replacements_parameters(release):
    from plestore.integrations.vllm.cpu_ops import OVERRIDES

    assert contract.broken(release, ("cpu",)) == []
    for name, fn in OVERRIDES.items():
        module, _, attr = name.rpartition(".")
        kernel = contract.resolve(f"{module}:{attr}")
        kernel_params = list(inspect.signature(kernel).parameters)
        own = list(inspect.signature(fn).parameters)
        assert kernel_params[: len(own)] == own, name  # called by position or by name


def test_attributes_the_plugin_reads_are_checked_on_vllms_objects():
    class Stub:
        prefix = "x"

    with pytest.raises(contract.ContractBroken, match=r"reads params_dtype, org_vocab_size"):
        contract.check_attributes(Stub(), "ple-embedding")
