"""The Gemma 3n / Gemma 4 integration against the real transformers classes: every tier, batch 1
and left-padded batch 3 — logits and greedy generation bit-identical to the untouched model;
out-of-range ids as transformers maps them; float32 models exact; lossy formats opt-in with their
divergence reported."""

from __future__ import annotations

import copy
import inspect
import json
from pathlib import Path

import pytest
import torch

from conftest import assert_bit_identical, devices

transformers = pytest.importorskip("transformers")

import gemma_models  # noqa: E402
from gemma_models import (  # noqa: E402
    KINDS,
    MM_IDS,
    PER_LAYER_ROWS,
    TIERS,
    VOCAB,
    _assert_same_outputs,
    _assert_untouched,
    _inputs,
    _ple,
    _snapshot,
    _stock_text_masks,
    build,
)

from plestore.integrations.transformers import (  # noqa: E402
    PerLayerEmbedding,
    measure_divergence,
    offload_per_layer_embeddings,
)

table_dirs = gemma_models.table_dirs  # a fixture

# ----------------------------------------------------------------------------------------------
# Bit-identical through every tier
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_models_use_their_per_layer_table(kind):
    """Guard for everything below: the per-layer rows really reach the logits."""
    model = build(kind)
    ids, mask = _inputs(kind, 3, "cpu")
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
        _ple(model).weight.mul_(1.5)
        after = model(input_ids=ids, attention_mask=mask).logits
    assert (before - after).abs().max() > 1e-3


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("kind", KINDS)
def test_offload_is_bit_identical(kind, tier, device, table_dirs):
    model = build(kind, device)
    weight = _ple(model).weight
    nbytes = weight.numel() * weight.element_size()
    del weight
    report = offload_per_layer_embeddings(model, table_dirs(kind, device), tier=tier)
    assert report.tier == tier and report.tier_reason == "requested"
    assert report.module.endswith("embed_tokens_per_layer")
    assert (report.rows, report.dim) == (PER_LAYER_ROWS, 4 * 16)
    assert report.format == "bf16" and report.exact
    assert report.freed_bytes == report.weight_bytes == nbytes
    assert report.freed_from == str(torch.device(device)) or report.freed_from.startswith(device)
    assert ("multimodal" in report.model) == kind.endswith("-mm")
    assert isinstance(_ple(model), PerLayerEmbedding)
    assert not [k for k in model.state_dict() if k.endswith("embed_tokens_per_layer.weight")]
    _assert_same_outputs(model, kind, device)
    _ple(model).close()


@pytest.mark.parametrize("device", devices())
def test_auto_tier_says_which_and_why(device, tmp_path):
    model = build("gemma3n-text", device)
    report = offload_per_layer_embeddings(model, tmp_path)
    assert report.tier in TIERS and report.tier_reason and report.tier_reason != "requested"
    assert report.tier in str(_ple(model))
    _assert_same_outputs(model, "gemma3n-text", device)
    _ple(model).close()


@pytest.mark.parametrize("device", devices())
def test_device_memory_is_released(device, tmp_path):
    model = build("gemma4-text", device)
    report = offload_per_layer_embeddings(model, tmp_path, tier="pinned")
    assert report.table_device_bytes == 0 and report.bytes_off_device == report.weight_bytes
    if device == "cuda":
        released = report.device_allocated_before - report.device_allocated_after
        assert released >= report.weight_bytes
    _ple(model).close()


# ----------------------------------------------------------------------------------------------
# Out-of-range ids, dtypes
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("kind", ["gemma3n-text", "gemma3n-mm"])
def test_gemma3n_out_of_range_ids_read_row_zero(kind, device, tmp_path):
    """Ids >= vocab_size_per_layer_input (text ids, image/audio soft tokens) -> row 0."""
    stock = build(kind, device, vocab_size=VOCAB["gemma3n"])
    model = copy.deepcopy(stock)
    offload_per_layer_embeddings(model, tmp_path, tier="pinned")
    ids = torch.tensor([[5, 256, 300, 390, 398, 0, 399, 17]], device=device)
    oor = ids >= PER_LAYER_ROWS
    lm = lambda m: m.model.language_model if kind.endswith("-mm") else m.model  # noqa: E731
    masks = _stock_text_masks()  # else the stock text model raises on them: ask it for row 0
    with torch.no_grad():
        want = lm(stock).get_per_layer_inputs(ids if masks else ids.masked_fill(oor, 0))
        got = lm(model).get_per_layer_inputs(ids)  # [1, 8, L, 16]
        assert_bit_identical(got, want)
        row0 = lm(model).get_per_layer_inputs(torch.zeros_like(ids))
        assert_bit_identical(got[oor], row0[oor])
        if masks or kind.endswith("-mm"):  # the multimodal model masks in every version
            assert_bit_identical(model(input_ids=ids).logits, stock(input_ids=ids).logits)
    _ple(model).close()


def _get_per_layer_inputs(lm, ids):
    """Gemma 4's get_per_layer_inputs takes inputs_embeds too in some transformers versions."""
    params = inspect.signature(lm.get_per_layer_inputs).parameters
    extra = {"inputs_embeds": lm.embed_tokens(ids)} if "inputs_embeds" in params else {}
    return lm.get_per_layer_inputs(ids, **extra)


@pytest.mark.parametrize("device", devices())
def test_gemma4_ids_as_transformers_maps_them(device, tmp_path):
    """Gemma 4 swaps multimodal placeholders for pad before the lookup and refuses other
    out-of-range ids (IndexError) — with and without plestore."""
    stock = build("gemma4-mm", device, vocab_size=400)
    model = copy.deepcopy(stock)
    offload_per_layer_embeddings(model, tmp_path, tier="mapped")
    ids = torch.tensor([[7, MM_IDS["image_token_id"], MM_IDS["audio_token_id"], 9]], device=device)
    with torch.no_grad():
        assert_bit_identical(model(input_ids=ids).logits, stock(input_ids=ids).logits)
        bad = torch.tensor([[7, 300]], device=device)
        lm_stock, lm = stock.model.language_model, model.model.language_model
        if device == "cpu":  # on CUDA the stock gather fails with a device-side assert instead
            with pytest.raises(IndexError):
                _get_per_layer_inputs(lm_stock, bad)
        with pytest.raises(IndexError):
            _get_per_layer_inputs(lm, bad)
    _ple(model).close()


@pytest.mark.parametrize("device", devices())
def test_float32_model_with_bf16_values_is_exact(device, tmp_path):
    """A bf16 model cast to float32: the rows are bf16 numbers, so a bf16 table is exact and
    the module returns float32 like the weight it replaces."""
    stock = build("gemma4-text", device).to(torch.float32)
    model = copy.deepcopy(stock)
    report = offload_per_layer_embeddings(model, tmp_path, tier="device", format="bf16")
    assert report.exact and report.source_dtype == "float32"
    ids, mask = _inputs("gemma4-text", 3, device)
    with torch.no_grad():
        a = stock(input_ids=ids, attention_mask=mask).logits
        b = model(input_ids=ids, attention_mask=mask).logits
    assert b.dtype == torch.float32 and torch.equal(a, b)
    _ple(model).close()


def test_float32_values_refused_in_bf16(tmp_path):
    model = build("gemma3n-text", dtype=torch.float32)
    before = _snapshot(model)
    with pytest.raises(ValueError, match="not bfloat16 numbers"):
        offload_per_layer_embeddings(model, tmp_path, format="bf16")
    _assert_untouched(model, before)
    assert not list(tmp_path.iterdir())  # the aborted pack left nothing behind


def test_float32_values_served_exactly_by_default(tmp_path):
    """A float32 model with values no bf16 table holds: an fp32 table, outputs bit-identical."""
    stock = build("gemma3n-text", dtype=torch.float32)
    with torch.no_grad():
        _ple(stock).weight.add_(1e-5)  # values past bf16's mantissa
    model = copy.deepcopy(stock)
    report = offload_per_layer_embeddings(model, tmp_path, tier="mapped")
    assert report.format == "fp32" and report.exact
    ids, mask = _inputs("gemma3n-text", 3, "cpu")
    with torch.no_grad():
        want = stock(input_ids=ids, attention_mask=mask).logits
        assert_bit_identical(model(input_ids=ids, attention_mask=mask).logits, want)


# ----------------------------------------------------------------------------------------------
# Lossy formats: opt-in, divergence reported
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("kind", ["gemma3n-text", "gemma4-text"])
def test_lossy_formats_report_divergence(kind, fmt, tmp_path, record_property):
    stock = build(kind)
    model = copy.deepcopy(stock)
    report = offload_per_layer_embeddings(model, tmp_path, tier="pinned", format=fmt)
    assert report.format == fmt and not report.exact
    assert Path(report.table_path).name == f"embed_tokens_per_layer.{fmt}.json"
    prompts = [_inputs(kind, 1, "cpu", seed=s)[0][0] for s in range(4)]
    div = measure_divergence(stock, model, prompts, max_new_tokens=8)
    record_property("divergence", json.dumps(div))
    print(f"\n{kind} {fmt}: {json.dumps(div)}")
    assert div["prompts"] == 4 and div["positions"] == 28
    assert 0 < div["max_abs_logit_error"] < 1.0  # the tiny models' logits are ~0.1-1
    assert div["relative_mean_logit_error"] < 0.25
    assert div["argmax_agreement"] >= 0.75
    assert 0.0 <= div["greedy_token_agreement"] <= 1.0
    _ple(model).close()


def test_measure_divergence_of_identical_models_is_zero(tmp_path):
    stock = build("gemma4-text")
    model = copy.deepcopy(stock)
    offload_per_layer_embeddings(model, tmp_path)
    div = measure_divergence(stock, model, torch.tensor([[5, 6, 7], [8, 9, 10]]), 4)
    assert div["max_abs_logit_error"] == 0.0 and div["greedy_exact_fraction"] == 1.0
    assert div["argmax_agreement"] == 1.0 and div["greedy_first_divergence"] == [None, None]
    _ple(model).close()


def test_use_table_switches_tiers_and_closes_or_hands_back(tmp_path):
    """use_table: another tier's table serves the same rows; the old one is closed, or with
    close=False handed back open; a table of another shape is refused and changes nothing."""
    import plestore
    from tier_tables import make_table

    model = build("gemma3n-text")
    offload_per_layer_embeddings(model, tmp_path, tier="device")
    m = _ple(model)
    first = m.table
    mapped = plestore.open_table(str(first.file.meta_path), tier="mapped")
    assert m.use_table(mapped, close=False) is first
    first.lookup([[1]])  # still open: the caller's to close
    _assert_same_outputs(model, "gemma3n-text", "cpu")
    assert m.use_table(first) is mapped
    with pytest.raises(RuntimeError, match="closed"):
        mapped.lookup([[1]])
    other = plestore.open_table(make_table(tmp_path / "other", "bf16", 64)[0], tier="device")
    with pytest.raises(ValueError, match="this module serves"):
        m.use_table(other)
    assert m.table is first
    other.close()
    m.close()


def test_bench_variants_swap_stock_and_every_tier(tmp_path):
    """The transformers benchmark's swapping: stock (weight back in place) and each tier in
    turn, each generating the stock tokens; every tier's table closed at the end."""
    from plestore.bench.transformers_variants import PleClock, Variants

    model = build("gemma3n-text")
    ids, mask = _inputs("gemma3n-text", 1, "cpu")
    stock_module = _ple(model)

    def generate():
        return model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)

    want = generate()
    variants = Variants(model)
    variants.offload(str(tmp_path), ["pinned", "mapped", "device"], torch.device("cpu"))
    assert variants.names == ["stock", "pinned", "mapped", "device"]
    for v in ["device", "stock", "mapped", "pinned", "stock"]:
        variants.use(v)
        served = _ple(model)
        assert (served is stock_module) == (v == "stock")
        assert v == "stock" or served.table.tier.name == v
        clock = PleClock(variants.ple_modules())
        assert torch.equal(generate(), want)
        clock.close()
        assert clock.calls >= 4 and clock.seconds > 0
    tables = [t for ts in variants.tables.values() for t in ts]
    variants.close()
    for t in tables:
        with pytest.raises(RuntimeError, match="closed"):
            t.lookup([[1]])
