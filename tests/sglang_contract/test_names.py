"""The installed SGLang against the plugin's contract (integrations/sglang/contract.py): every
name and parameter it relies on is there, the attributes it reads are on SGLang's real objects,
a renamed name is refused naming it, and every refusal fails the engine's start where SGLang
would have only logged it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata

import pytest

from .conftest import build_ngram


def test_every_name_the_plugin_uses_is_in_this_sglang():
    from plestore.integrations.sglang import SUPPORTED_SGLANG
    from plestore.integrations.sglang.contract import verify

    version = metadata.version("sglang")
    assert version in SUPPORTED_SGLANG, f"a release outside SUPPORTED_SGLANG: {version}"
    verify(version)


def test_a_renamed_name_is_refused_naming_it(monkeypatch):
    from sglang.srt.models import qwen4_exp

    from plestore.integrations.contract import ContractBroken
    from plestore.integrations.sglang.contract import verify

    monkeypatch.delattr(qwen4_exp.Qwen4ExpPLELayer, "_consume_prefetched_embeddings")
    with pytest.raises(ContractBroken, match=r"Qwen4ExpPLELayer\._consume_prefetched_embeddings"):
        verify("0.5.23")


def test_the_attributes_read_are_on_sglangs_objects(stock, sglang_world):
    from sglang.srt.models.qwen4_exp import Qwen4ExpPLELayer

    from plestore.integrations.sglang.contract import check_attributes

    _, cfg, module = stock["bf16"]
    check_attributes(module, "ngram-embedding")
    cfg.ple_offload_embedding = False  # (True would ask for a CUDA stream)
    layer = Qwen4ExpPLELayer(cfg, None, "model.layers.1.ple", 1, 0)
    check_attributes(layer, "ple-layer")
    check_attributes(sglang_world, "server-args")


def test_the_plugin_takes_effect_inside_sglangs_ngram_module(plugin, stock):
    """Loaded by SGLang's own load_plugins(), the n-gram module builds plestore's embedding
    whatever --ple-offload-embedding says, allocating no table."""
    _, cfg, _ = stock["bf16"]
    cfg.ple_offload_embedding = False
    module = build_ngram(cfg)
    assert isinstance(module.ngram_embedding, plugin)
    assert not list(module.ngram_embedding.parameters())
    assert cfg.ple_offload_embedding is False


def _start(settings: str, tmp_path) -> subprocess.CompletedProcess:
    """A fresh process that loads SGLang's plugins with PLESTORE_SGLANG=settings and makes the
    ServerArgs an engine starts from."""
    code = (
        "import sglang.srt.plugins as p; p.load_plugins()\n"
        "from sglang.srt.server_args import ServerArgs\n"
        "ServerArgs(model_path='dummy').resolve_once()\n"
        "print('STARTED')\n"
    )
    env = {**os.environ, "PLESTORE_SGLANG": settings}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
        cwd=tmp_path,
    )  # fmt: skip


@pytest.mark.parametrize(
    "settings, said",
    [
        ('{"tier": "bogus"}', "PLESTORE_SGLANG: tier must be one of"),
        ('{"teir": "mapped"}', "PLESTORE_SGLANG has an unknown key 'teir'"),
        ('{"row_start": 5}', "PLESTORE_SGLANG.row_start is set by SGLang"),
        ("{tier: mapped}", "PLESTORE_SGLANG is not JSON"),
    ],
)
def test_a_bad_setting_stops_the_engines_start(settings, said, tmp_path):
    done = _start(settings, tmp_path)
    assert done.returncode != 0 and "STARTED" not in done.stdout, done.stdout
    assert said in done.stderr, done.stderr[-3000:]


def test_an_untested_release_stops_the_start_unless_allowed(tmp_path, monkeypatch):
    from plestore.integrations.sglang.settings import UnsupportedSglang, check_sglang_version

    with pytest.raises(UnsupportedSglang, match="PLESTORE_ALLOW_UNTESTED_SGLANG=1"):
        check_sglang_version("0.5.99")
    monkeypatch.setenv("PLESTORE_ALLOW_UNTESTED_SGLANG", "1")
    check_sglang_version("0.5.99")


def test_a_model_plestore_does_not_serve_is_refused(plugin):
    import types

    from plestore.integrations.settings import TableServeError
    from plestore.integrations.sglang.loading import check_model

    config = types.SimpleNamespace(
        hf_config=types.SimpleNamespace(architectures=["LlamaForCausalLM"]),
        hf_text_config=types.SimpleNamespace(),
        model_path="/models/llama",
    )
    with pytest.raises(TableServeError, match=r"/models/llama \(LlamaForCausalLM\) has no table"):
        check_model(model_config=config, is_draft_worker=False)
    check_model(model_config=config, is_draft_worker=True)  # (a draft model is not ours)


def test_settings_are_the_vllm_plugins_keys():
    from plestore.integrations.sglang.settings import settings_from_env
    from plestore.integrations.vllm import PlestoreSettings

    raw = {"tier": "direct", "table_dir": "/t", "cache_bytes": 1 << 20, "pack_timeout_s": 5}
    ours = settings_from_env({"PLESTORE_SGLANG": json.dumps(raw)})
    theirs = PlestoreSettings.from_additional_config({"plestore": raw})
    assert (ours.table_dir, ours.pack_timeout_s, ours.options) == (
        theirs.table_dir, theirs.pack_timeout_s, theirs.options,
    )  # fmt: skip
    assert settings_from_env({}) is None and settings_from_env({"PLESTORE_SGLANG": " "}) is None
