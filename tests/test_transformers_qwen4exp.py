"""The Qwen4Exp integration against the real transformers classes: tiny models with one and two
PLE layers, trigram and 4-gram hashes — the ids bit for bit as transformers hashes them; greedy
generation of a left-padded batch of 3 with EOS inside the prompts, 20 tokens, then a second
generate continuing from the returned cache: logits and tokens bit-identical to the stock model
on every tier, for bf16 and float32 models and an FP8 checkpoint (load); bad input refused with
the model untouched."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors_spy import spy_reads

from conftest import devices

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen4_exp", reason="Qwen4Exp needs transformers >= 5.17")

from qwen4exp_models import (  # noqa: E402
    CONFIGS,
    EOS,
    build,
    prompts,
    run,
    tiny_config,
    write_fp8_checkpoint,
)

from plestore.hashing import Qwen4ExpHash  # noqa: E402
from plestore.integrations.transformers import (  # noqa: E402
    NGramEmbedding,
    TableMismatchError,
    UnsupportedModelError,
    load,
    offload_per_layer_embeddings,
)
from plestore.integrations.transformers.qwen.site import find_qwen_sites  # noqa: E402

TIERS = ["device", "pinned", "mapped", "direct"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny bf16 matmuls on 2 shared cores run 10x faster on one thread (same results for the
    stock and the plestore model: both run under it)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _ngram_modules(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if n.endswith("ple.ple_embedding")}


def _snapshot(model) -> dict:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return {"state": state, "types": {n: type(m) for n, m in model.named_modules()}}


def _assert_untouched(model, before: dict) -> None:
    assert {n: type(m) for n, m in model.named_modules()} == before["types"]
    state = model.state_dict()
    assert state.keys() == before["state"].keys()
    assert all(torch.equal(state[k], v) for k, v in before["state"].items())


def _assert_same(a, b) -> None:
    (sa, la), (sb, lb) = a, b
    assert torch.equal(sa, sb), (sa, sb)
    assert len(la) == len(lb)
    for i, (x, y) in enumerate(zip(la, lb, strict=True)):
        assert torch.equal(x, y), f"logits of step {i} differ"


# ----------------------------------------------------------------------------------------------
# The hash, bit for bit
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_row_ids_are_transformers_ids(name):
    """Row-coded tables (row i holds i): the stock module's output spells the ids it hashed —
    every PLE layer (its own ple_layer_index), EOS segments, a carried context."""
    layer_ids, n = CONFIGS[name]
    model = build(tiny_config(layer_ids, n))
    ids = torch.tensor([[1, 2, EOS, 7, 8, 9, 3], [EOS, EOS, 4, 6, 299, EOS, 2]])
    ctx = torch.tensor([[11, 12, 13][: n - 1], [EOS, 40, 41][: n - 1]])
    for site in find_qwen_sites(model):
        stock = site.module
        rows, dim = stock.ngram_embedding.weight.shape
        with torch.no_grad():
            coded = torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, dim)
            stock.ngram_embedding.weight.copy_(coded)
        cache = transformers.DynamicCache(config=model.config)
        cache.update_conv_state(ctx, site.layer_idx, state_idx=2, conv_kernel_size=n - 1)
        with torch.no_grad():
            want = stock(ids, cache)[..., ::dim].long()  # [B, S, heads]
        got = Qwen4ExpHash.from_spec(site.hash).padded_row_ids(ids, ctx)
        assert site.hash.layer_index == stock.ple_layer_index
        assert torch.equal(got, want)


# ----------------------------------------------------------------------------------------------
# Generation, bit-identical on every tier
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_generate_bit_identical_on_every_tier(name, dtype, device, tmp_path, monkeypatch):
    stock = build(tiny_config(*CONFIGS[name]), dtype).to(device)
    want = run(stock)
    prefetched = []
    real = NGramEmbedding.prefetch
    monkeypatch.setattr(
        NGramEmbedding, "prefetch", lambda m, ids, c: (prefetched.append(m), real(m, ids, c))
    )
    for i, tier in enumerate(TIERS):
        model = copy.deepcopy(stock)
        report = offload_per_layer_embeddings(model, tmp_path, tier=tier)
        fmt = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
        assert report.format == fmt and report.exact and report.tier == tier
        assert report.reused == (i > 0)  # the first tier packs, the others reuse by fingerprint
        assert len(report.layers) == len(CONFIGS[name][0])
        assert report.freed_bytes == report.weight_bytes > 0
        mods = _ngram_modules(model)
        assert all(isinstance(m, NGramEmbedding) for m in mods.values())
        assert not any("ngram_embedding" in k for k in model.state_dict())
        prefetched.clear()
        _assert_same(run(model), want)
        assert prefetched  # rows were started before layer 0, not only where they are used
        for m in mods.values():
            m.close()


def test_the_rows_reach_the_logits(tmp_path):
    """Guard for the tests above: the same model with its PLE rows negated, offloaded too,
    gives other logits."""
    stock = build(tiny_config([1, 2], 3))
    other = copy.deepcopy(stock)
    with torch.no_grad():
        for m in _ngram_modules(other).values():
            m.ngram_embedding.weight.neg_()
    offload_per_layer_embeddings(other, tmp_path / "other", tier="mapped")
    ids, mask = prompts()
    with torch.no_grad():
        a = stock(input_ids=ids, attention_mask=mask).logits
        b = other(input_ids=ids, attention_mask=mask).logits
    assert not torch.equal(a, b)


@pytest.mark.parametrize("kind", ["multimodal", "model", "text-model"])
def test_multimodal_and_bare_models(kind, tmp_path):
    """Qwen4ExpForConditionalGeneration (model.language_model.layers.L), the bare
    Qwen4ExpModel and Qwen4ExpTextModel: every PLE table found and served exactly."""
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
    text = tiny_config([1, 2], 3)
    cfg = transformers.Qwen4ExpConfig(text_config=text.to_dict(), vision_config=vision)
    torch.manual_seed(0)
    stock = transformers.Qwen4ExpForConditionalGeneration(cfg).eval()
    stock = {"multimodal": stock, "model": stock.model, "text-model": stock.model.language_model}
    stock = stock[kind]
    model = copy.deepcopy(stock)
    report = offload_per_layer_embeddings(model, tmp_path, tier="mapped")
    prefix = {"multimodal": "model.language_model.", "model": "language_model.", "text-model": ""}
    assert report.module.split(", ") == [
        f"{prefix[kind]}layers.{i}.ple.ple_embedding" for i in (0, 1)
    ]
    ids, mask = prompts()
    with torch.no_grad():
        a, b = (m(input_ids=ids, attention_mask=mask) for m in (stock, model))
    key = "logits" if kind == "multimodal" else "last_hidden_state"
    assert torch.equal(getattr(a, key), getattr(b, key))


# ----------------------------------------------------------------------------------------------
# Checkpoints: load() never materialises the shards; FP8 as transformers computes it
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A float32 save_pretrained (model.layers.* names) and its FP8 rewrite."""
    model = build(tiny_config([1, 2], 3))
    f32 = tmp_path_factory.mktemp("ckpt-f32")
    model.save_pretrained(f32)
    fp8 = write_fp8_checkpoint(model, tmp_path_factory.mktemp("ckpt-fp8"))
    return {"f32": f32, "fp8": fp8}


@pytest.mark.parametrize(
    "kind,dtype,fmt",
    [("fp8", torch.bfloat16, "fp8_e4m3"), ("f32", torch.bfloat16, "bf16")],
    ids=["fp8-ckpt", "f32-ckpt-as-bf16"],
)
def test_load_is_bit_identical_on_every_tier(kind, dtype, fmt, checkpoints, tmp_path, monkeypatch):
    path = checkpoints[kind]
    read = spy_reads(
        monkeypatch, lambda key: ".ngram_embedding.shard_" in key
    )  # the spy sees a stock load read the shards
    stock = transformers.Qwen4ExpForCausalLM.from_pretrained(path, dtype=dtype).eval()
    assert read and all(".ngram_embedding.shard_" in k for k in read)
    want = run(stock)
    for i, tier in enumerate(TIERS):
        table_dir = tmp_path / "tables"
        read.clear()
        model, report = load(path, tier=tier, table_dir=table_dir, dtype=dtype)
        assert read == []  # transformers never read a shard (plestore packed them itself)
        assert report.format == fmt and report.exact and report.reused == (i > 0)
        assert report.freed_bytes == 0 and type(model) is transformers.Qwen4ExpForCausalLM
        assert all(isinstance(m, NGramEmbedding) for m in _ngram_modules(model).values())
        _assert_same(run(model.eval()), want)
        for m in _ngram_modules(model).values():
            m.close()
    if kind == "fp8":  # the stock model's e4m3 values, offloaded at 1 byte each, exactly
        model = copy.deepcopy(stock)
        report = offload_per_layer_embeddings(model, tmp_path / "o", tier="mapped", format="fp8")
        assert report.format == "fp8_e4m3" and report.exact
        ids, mask = prompts()
        with torch.no_grad():
            a = stock(input_ids=ids, attention_mask=mask).logits
            assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, a)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only torch's refusal")
def test_load_without_cuda_refuses_a_cuda_device_map_and_writes_the_tables_the_doc_names(
    checkpoints, tmp_path
):
    from pathlib import Path

    for kw in ({"device_map": "cuda"}, {"device_map": "cuda", "device": "cpu"}, {"device_map": 0}):
        with pytest.raises(ValueError, match="leave device_map out"):
            load(checkpoints["f32"], tier="mapped", table_dir=tmp_path, **kw)
    model, report = load(checkpoints["f32"], tier="mapped", table_dir=tmp_path)  # the CPU
    for m in _ngram_modules(model).values():
        m.close()
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))  # (lock)
    assert names == [f"ple.layers.{n}.{ext}" for n in (0, 1) for ext in ("crc", "json", "rows")]
    doc = (Path(__file__).parents[1] / "docs" / "transformers.md").read_text()
    assert "`table_dir/ple.layers.<L>.{json,rows,crc}`" in doc
    assert 'load("Qwen3.8-Flash-Next/", tier="auto")\n' in doc  # the first example runs here


def test_load_refuses_missing_and_extra_shards(checkpoints, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    for change, match in (("drop", "shard_3.weight is missing"), ("add", "extra shard")):
        path = tmp_path / change
        shutil.copytree(checkpoints["f32"], path)
        (f,) = path.glob("*.safetensors")
        tensors = load_file(f)
        key = "model.layers.1.ple.ple_embedding.ngram_embedding.shard_3.weight"
        if change == "drop":
            del tensors[key]
        else:
            tensors[key.replace("shard_3", "shard_4")] = tensors[key].clone()
        save_file(tensors, f, metadata={"format": "pt"})
        with pytest.raises(ValueError, match=match):
            load(path, tier="mapped")
        assert not (path / "plestore").exists() or not list((path / "plestore").glob("*.json"))


# ----------------------------------------------------------------------------------------------
# Bad input: a clear error naming the layer, the model untouched
# ----------------------------------------------------------------------------------------------


def test_model_without_ple_layers_is_refused(tmp_path):
    model = build(tiny_config([], 3))
    before = _snapshot(model)
    with pytest.raises(UnsupportedModelError, match="no PLE layers"):
        offload_per_layer_embeddings(model, tmp_path)
    _assert_untouched(model, before)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"seed": 99}, "seed"),
        ({"eos_token_id": 6}, "eos_token_id"),
        ({"ngram_vocab_size_base": 400}, "ple.layers.0"),
        ({"ngram_size": 4}, "ple.layers.0"),
    ],
)
def test_table_of_another_config_is_refused(change, match, tmp_path):
    offload_per_layer_embeddings(build(tiny_config([1, 2], 3)), tmp_path, tier="mapped")
    other = build(tiny_config([1, 2], **{"ngram_size": 3, **change}))
    before = _snapshot(other)
    with pytest.raises(TableMismatchError, match=match):
        offload_per_layer_embeddings(other, tmp_path, tier="mapped")
    _assert_untouched(other, before)


def test_table_of_another_layer_or_weights_is_refused(tmp_path):
    model = build(tiny_config([1, 2], 3))  # float32: fp32 tables
    offload_per_layer_embeddings(copy.deepcopy(model), tmp_path, tier="mapped")
    before = _snapshot(model)
    fresh = build(tiny_config([1, 2], 3), seed=1)  # same config, other weights
    with pytest.raises(TableMismatchError, match="another model's weights"):
        offload_per_layer_embeddings(fresh, tmp_path, tier="mapped")
    meta = tmp_path / "ple.layers.1.fp32.json"
    doc = json.loads(meta.read_text())
    doc["source"]["identity"]["hash"]["layer_index"] = 0  # as if packed for PLE layer 0's hash
    meta.write_text(json.dumps(doc))
    with pytest.raises(TableMismatchError, match=r"layers\.1\.ple.*layer_index"):
        offload_per_layer_embeddings(model, tmp_path, tier="mapped")
    _assert_untouched(model, before)


def test_hash_buffers_other_than_the_config_are_refused(tmp_path):
    model = build(tiny_config([1, 2], 3))
    with torch.no_grad():
        model.model.layers[1].ple.ple_embedding.layer_multipliers[0] += 2
    before = _snapshot(model)
    with pytest.raises(UnsupportedModelError, match=r"layers\.1\.ple\.ple_embedding\.layer_mult"):
        offload_per_layer_embeddings(model, tmp_path)
    _assert_untouched(model, before)
    assert not list(tmp_path.iterdir())


def test_values_a_format_would_round_are_refused(tmp_path):
    model = build(tiny_config([2], 4))  # float32, N(0, 1) rows: not float16 numbers
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"layers\.1\.ple\.ple_embedding.*not float16 numbers"):
        offload_per_layer_embeddings(model, tmp_path, format="fp16")
    _assert_untouched(model, before)
    offload_per_layer_embeddings(model, tmp_path / "b", tier="mapped")
    with pytest.raises(UnsupportedModelError, match="already served by plestore"):
        offload_per_layer_embeddings(model, tmp_path / "c", tier="mapped")


def test_load_of_a_synth_checkpoint_says_what_it_lacks_in_one_line(small_checkpoint):
    # the Quickstart's `plestore synth` checkpoint holds tables, not a model transformers builds
    ck = small_checkpoint("qwen3.8-flash-next", "fp8")
    with pytest.raises(UnsupportedModelError) as e:
        load(ck, tier="mapped")
    msg = str(e.value)
    assert "\n" not in msg and str(ck) in msg and "plestore synth" in msg
    assert "indexer_budget" in msg and "plestore pack" in msg
    assert not (ck / "plestore").exists()  # refused before anything was packed
