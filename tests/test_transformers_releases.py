"""transformers releases: plestore's modules take every call the stock modules take (in the
installed release: CI runs this file at the oldest declared and the newest), an unknown cache
API is refused naming the release, a release outside the tested range is refused at load /
offload naming the range and the one setting that runs it anyway, and load()'s device-map key
is a real module path of every model class."""

from __future__ import annotations

import copy
import logging
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen4_exp", reason="Qwen4Exp needs transformers >= 5.17")

from gemma_models import build as build_gemma  # noqa: E402
from qwen4exp_models import EOS, build, tiny_config  # noqa: E402

from plestore.integrations.transformers import (  # noqa: E402
    UntestedTransformersError,
    load,
    load_gemma,
    offload_per_layer_embeddings,
)
from plestore.integrations.transformers.common import release  # noqa: E402
from plestore.integrations.transformers.common.loading import text_model_key  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ALLOW = "PLESTORE_ALLOW_UNTESTED_TRANSFORMERS"


def _pyproject_oldest() -> str:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = data["project"]["optional-dependencies"]
    bounds = {
        req.split(">=")[1].split(",")[0]
        for extra in ("transformers", "test")
        for req in extras[extra]
        if req.startswith("transformers>=")
    }
    assert len(bounds) == 1, bounds  # one declared oldest release, in both extras
    return bounds.pop()


def test_what_pip_installs_is_what_load_accepts():
    """Both extras bound transformers above by the minor after the newest tested release."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [
        r
        for e in ("transformers", "test")
        for r in extras["optional-dependencies"][e]
        if r.startswith("transformers")
    ]
    newest = f"{release.TESTED_NEWEST[0]}.{release.TESTED_NEWEST[1] + 1}"
    assert len(reqs) == 2 and all(r.endswith(f",<{newest}") for r in reqs), reqs


def test_the_declared_oldest_release_is_the_tested_range_and_the_installed_one_is_in_it():
    oldest = tuple(int(x) for x in _pyproject_oldest().split("."))
    assert oldest + (0,) * (3 - len(oldest)) == release.TESTED_OLDEST
    assert release.check_release() == transformers.__version__  # CI runs only tested releases


@pytest.mark.parametrize(
    "version,tested",
    [
        ("5.17.0", True),
        ("5.21.1", True),
        ("5.25.0", True),
        ("5.25.7", True),
        ("5.16.1", False),
        ("5.17.0.dev0", False),
        ("5.26.0", False),
        ("5.26.0.dev0", False),
        ("6.0.0", False),
        ("4.57.6", False),
        ("not-a-version", False),
    ],
)
def test_release_range(version, tested, monkeypatch):
    monkeypatch.delenv(ALLOW, raising=False)
    if tested:
        assert release.check_release(version) == version
        return
    with pytest.raises(UntestedTransformersError) as e:
        release.check_release(version)
    msg = str(e.value)
    assert version in msg and release.tested_range() in msg and f"{ALLOW}=1" in msg


def test_the_setting_runs_an_untested_release_with_one_warning(monkeypatch, caplog):
    monkeypatch.setenv(ALLOW, "1")
    with caplog.at_level(logging.WARNING, "plestore"):
        assert release.check_release("5.99.0") == "5.99.0"
        release.check_release("5.99.0")
    assert sum("5.99.0 is untested" in r.message for r in caplog.records) == 1
    monkeypatch.setenv(ALLOW, "maybe")
    with pytest.raises(ValueError, match=ALLOW):
        release.check_release("5.99.1")


@pytest.fixture(scope="module")
def qwen_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen-ckpt")
    build(tiny_config([1, 2], 3)).save_pretrained(path)
    return path


def test_load_and_offload_refuse_an_untested_release_before_anything(
    qwen_checkpoint, tmp_path, monkeypatch
):
    monkeypatch.delenv(ALLOW, raising=False)
    monkeypatch.setattr(release, "installed", lambda: "5.26.0")  # as 5.26 would report
    model = build(tiny_config([1, 2], 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = [
        lambda: load(qwen_checkpoint, tier="mapped", table_dir=tmp_path / "a"),
        lambda: load_gemma(qwen_checkpoint, tier="mapped", table_dir=tmp_path / "b"),
        lambda: offload_per_layer_embeddings(model, tmp_path / "c", tier="mapped"),
    ]
    for call in calls:
        with pytest.raises(UntestedTransformersError, match=r"transformers 5\.26\.0 .*5\.17\.0"):
            call()
    assert not any(tmp_path.iterdir())  # nothing packed
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    monkeypatch.setenv(ALLOW, "1")  # the one setting: runs it anyway
    report = offload_per_layer_embeddings(model, tmp_path / "c", tier="mapped")
    assert report.format == "fp32"


# ----------------------------------------------------------------------------------------------
# Every call the stock module takes, with the same rows
# ----------------------------------------------------------------------------------------------


#: the keyword arguments a 5.25 PLE layer passes on (its TransformersKwargs)
LAYER_KWARGS = dict(output_router_logits=False, output_attentions=False, use_cache=True)
CALL_FORMS = {
    "positional": lambda ids, cache: ((ids, cache), {}),
    "cache=": lambda ids, cache: ((ids,), {"cache": cache}),
    "past_key_values=": lambda ids, cache: ((ids,), {"past_key_values": cache}),
    "layer kwargs": lambda ids, cache: ((ids, cache), LAYER_KWARGS),
}


def test_ngram_embedding_takes_every_call_the_stock_module_takes(tmp_path):
    """Each call form the installed stock module accepts (a TypeError from it: not a form of
    this release), over a prefill and a decode step on fresh caches: our module accepts it
    and gives the stock rows."""
    config = tiny_config([1, 2], 3)
    stock = build(config)
    model = copy.deepcopy(stock)
    offload_per_layer_embeddings(model, tmp_path, tier="mapped")
    theirs = stock.model.layers[0].ple.ple_embedding
    mine = model.model.layers[0].ple.ple_embedding
    steps = [torch.tensor([[7, EOS, 9, 11], [3, 4, 5, 6]]), torch.tensor([[12], [EOS]])]
    accepted = []
    for form, call in CALL_FORMS.items():
        caches = [transformers.DynamicCache(config=config) for _ in range(2)]
        for step, ids in enumerate(steps):
            args, kwargs = call(ids, caches[0])
            try:
                with torch.no_grad():
                    want = theirs(*args, **kwargs)
            except TypeError:
                assert step == 0
                break
            args, kwargs = call(ids, caches[1])
            with torch.no_grad():
                got = mine(*args, **kwargs)
            assert torch.equal(got, want), form
        else:
            accepted.append(form)
    # every release takes the cache positionally and by its name
    assert "positional" in accepted and len(accepted) >= 2, accepted
    if transformers.__version__.startswith("5.25"):
        assert "layer kwargs" in accepted


def test_an_unknown_cache_api_is_refused_naming_the_release(tmp_path):
    model = build(tiny_config([1, 2], 3))
    offload_per_layer_embeddings(model, tmp_path, tier="mapped")
    mine = model.model.layers[0].ple.ple_embedding
    unknown = SimpleNamespace(layers=[])  # a cache of an API plestore does not know
    with pytest.raises(UntestedTransformersError, match=transformers.__version__):
        mine(torch.tensor([[1, 2]]), unknown)


# ----------------------------------------------------------------------------------------------
# load()'s device-map key: a module of every model class
# ----------------------------------------------------------------------------------------------


def test_device_map_keys_are_module_paths_of_every_model_class():
    text = tiny_config([1, 2], 3)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
    mm = transformers.Qwen4ExpForConditionalGeneration(
        transformers.Qwen4ExpConfig(text_config=text.to_dict(), vision_config=vision)
    )
    qwen = [transformers.Qwen4ExpForCausalLM(text), mm, mm.model, mm.model.language_model]
    for model in qwen:
        key = text_model_key(type(model), "layers.1.ple.ple_embedding.ngram_embedding.weight")
        assert key in dict(model.named_parameters()), (type(model).__name__, key)
    for kind in ("gemma3n-text", "gemma3n-mm", "gemma4-text", "gemma4-mm"):
        model = build_gemma(kind)
        for m in (model, model.model):
            key = text_model_key(type(m), "embed_tokens_per_layer.weight")
            assert key in dict(m.named_parameters()), (type(m).__name__, key)


def test_the_tests_run_offline_without_hub_kernels():
    """transformers with the `kernels` package looks layers' kernels up on the hub (and fails
    offline, as on the GPU machine): conftest turns both off before transformers is imported,
    and docs/transformers.md tells an offline user the same two variables."""
    import os

    from conftest import OFFLINE

    assert {k: os.environ.get(k) for k in OFFLINE} == {
        "HF_HUB_OFFLINE": "1",
        "USE_HUB_KERNELS": "0",
    }
    hub_kernels = pytest.importorskip("transformers.integrations.hub_kernels")
    enabled = hub_kernels._kernels_enabled  # a function in 5.25, a flag read at import before
    assert not (enabled() if callable(enabled) else enabled)
    doc = (Path(__file__).parents[1] / "docs" / "transformers.md").read_text()
    assert all(f"export {k}={v}" in doc for k, v in OFFLINE.items())
