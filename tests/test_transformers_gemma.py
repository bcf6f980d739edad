"""The transformers integration against the real transformers classes: tiny random-config
Gemma 3n / Gemma 4 models (text-only and multimodal), every tier, batch 1 and left-padded batch
3 — logits and greedy generation bit-identical to the untouched model; out-of-range ids as
transformers maps them; lossy formats opt-in with their divergence reported; reuse, mismatch
and unsupported models leave the model untouched; load_gemma never materialises the table."""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import subprocess
import sys
from functools import cache
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import assert_bit_identical, devices

transformers = pytest.importorskip("transformers")

from plestore.integrations.transformers import (  # noqa: E402
    PerLayerEmbedding,
    TableMismatchError,
    UnsupportedModelError,
    load_gemma,
    measure_divergence,
    offload_per_layer_embeddings,
)

ROOT = Path(__file__).resolve().parents[1]
TIERS = ["device", "pinned", "mapped", "direct"]
KINDS = ["gemma3n-text", "gemma3n-mm", "gemma4-text", "gemma4-mm"]
PER_LAYER_ROWS = 256
# Gemma 3n: a text vocabulary larger than the per-layer one, so prompts and generated tokens
# include ids >= 256 that transformers maps to row 0. Gemma 4 would raise IndexError on those
# (it maps nothing), so its tiny vocabulary equals the per-layer one, as in the real configs.
VOCAB = {"gemma3n": 400, "gemma4": PER_LAYER_ROWS}


@cache
def _stock_text_masks() -> bool:
    """Does this transformers' Gemma 3n text model map per-layer ids >= vocab_size_per_layer_input
    to row 0 itself? (5.24 does; 5.17 left it to the multimodal model, and its text-only model
    raised IndexError.) plestore maps them to 0 in both: the stock result where it has one."""
    model = build("gemma3n-text", vocab_size=VOCAB["gemma3n"])
    try:
        with torch.no_grad():
            model.model.get_per_layer_inputs(torch.tensor([[PER_LAYER_ROWS + 1]]))
    except IndexError:
        return False
    return True


def _vocab(kind: str) -> int:
    """Text vocabulary of the tiny model: where the stock text-only model cannot take ids past
    the per-layer table, prompts and generated tokens must stay inside it."""
    family = kind.partition("-")[0]
    if kind == "gemma3n-text" and not _stock_text_masks():
        return PER_LAYER_ROWS
    return VOCAB[family]


MM_IDS = dict(image_token_id=250, video_token_id=251, audio_token_id=252)


def _text_kwargs(family: str, vocab: int, **over) -> dict:
    kw = dict(
        vocab_size=vocab,
        vocab_size_per_layer_input=PER_LAYER_ROWS,
        hidden_size=96,  # != 4 layers x 16: no other weight has the per-layer table's shape
        hidden_size_per_layer_input=16,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=128,
        num_kv_shared_layers=2,
        sliding_window=16,
        max_position_embeddings=128,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )
    if family == "gemma3n":
        kw.update(laurel_rank=8, activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0])
    else:
        kw.update(global_head_dim=32)
    kw.update(over)
    return kw


@contextlib.contextmanager
def _gemma3n_vision_stub():
    """Gemma 3n's vision tower is a timm MobileNet (timm + Pillow are not test dependencies);
    the text path never calls it, so a stub stands in unless timm is installed."""
    from transformers.models.gemma3n import modeling_gemma3n as m3

    try:
        import timm  # noqa: F401

        yield
        return
    except ImportError:
        pass
    real = m3.AutoModel.from_config

    def from_config(config, *args, **kwargs):
        if config.model_type == "gemma3n_vision":
            stub = nn.Module()
            stub.config = config
            return stub
        return real(config, *args, **kwargs)

    with mock.patch.object(m3.AutoModel, "from_config", side_effect=from_config):
        yield


def _config(kind: str, **text_over):
    family, _, variant = kind.partition("-")
    vocab = text_over.pop("vocab_size") if "vocab_size" in text_over else _vocab(kind)
    text = _text_kwargs(family, vocab, **text_over)
    if family == "gemma3n":
        if variant == "text":
            return transformers.Gemma3nTextConfig(**text)
        return transformers.Gemma3nConfig(
            text_config=text,
            vision_config=dict(hidden_size=32, vocab_size=8, vocab_offset=384),
            audio_config=dict(
                hidden_size=32,
                conf_num_hidden_layers=1,
                conf_num_attention_heads=2,
                sscp_conv_channel_size=[8, 8],
                input_feat_size=16,
                vocab_size=8,
                vocab_offset=392,
            ),
            image_token_id=390,  # above vocab_size_per_layer_input, as in the real model
            audio_token_id=398,
            boi_token_id=380,
            eoi_token_id=384,
            boa_token_id=381,
            eoa_token_id=392,
        )
    if variant == "text":
        return transformers.Gemma4TextConfig(**text)
    return transformers.Gemma4Config(
        text_config=text,
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
            position_embedding_size=64,
        ),
        audio_config=dict(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            subsampling_conv_channels=[8, 8],
            output_proj_dims=32,
        ),
        boi_token_id=253,
        eoi_token_id=254,
        boa_token_id=255,
        eoa_token_index=249,
        **MM_IDS,
    )


def _model_class(kind: str):
    family, _, variant = kind.partition("-")
    name = {"gemma3n": "Gemma3n", "gemma4": "Gemma4"}[family]
    suffix = "ForCausalLM" if variant == "text" else "ForConditionalGeneration"
    return getattr(transformers, name + suffix)


def build(kind: str, device: str = "cpu", seed: int = 0, dtype=torch.bfloat16, **text_over):
    """A tiny random-weight model, deterministic in `seed`, in eval mode."""
    config = _config(kind, **text_over)  # first: it may build a probe model (_vocab)
    torch.manual_seed(seed)
    with _gemma3n_vision_stub():
        model = _model_class(kind)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Gemma 3n initialises AltUp's output scale to 0, which multiplies the per-layer
            # path away entirely (test_tiny_models_use_their_per_layer_table guards this)
            if name.endswith("correct_output_scale"):
                p.normal_(1.0, 0.1)
    return model.to(device=device, dtype=dtype).eval()


def _inputs(kind: str, batch: int, device: str, seed: int = 1):
    """Batch 1: one prompt. Batch 3: left-padded prompts of 9, 6 and 4 tokens + a mask."""
    g = torch.Generator().manual_seed(seed)
    lengths = [7] if batch == 1 else [9, 6, 4]
    width = max(lengths)
    ids = torch.zeros((batch, width), dtype=torch.long)  # pad_token_id = 0
    mask = torch.zeros((batch, width), dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, width - n :] = torch.randint(3, _vocab(kind), (n,), generator=g)
        mask[b, width - n :] = 1
    return ids.to(device), mask.to(device)


GEN = dict(max_new_tokens=6, do_sample=False, min_new_tokens=6)


@torch.no_grad()
def _outputs(model, ids, mask):
    logits = model(input_ids=ids, attention_mask=mask).logits
    gen = model.generate(
        ids, attention_mask=mask, output_logits=True, return_dict_in_generate=True, **GEN
    )
    return logits, gen.sequences, torch.stack(gen.logits)


@cache
def _stock(kind: str, device: str):
    """The untouched model's outputs for batch 1 and 3 (computed once per kind and device)."""
    model = build(kind, device)
    return {b: _outputs(model, *_inputs(kind, b, device)) for b in (1, 3)}


def _assert_same_outputs(model, kind: str, device: str) -> None:
    for batch, (logits, seqs, step_logits) in _stock(kind, device).items():
        got_logits, got_seqs, got_steps = _outputs(model, *_inputs(kind, batch, device))
        assert torch.equal(got_seqs, seqs), f"batch {batch}: greedy tokens differ"
        assert_bit_identical(got_logits, logits)
        assert_bit_identical(got_steps, step_logits)


def _snapshot(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_untouched(model, before: dict) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    modules = [m for n, m in model.named_modules() if n.endswith("embed_tokens_per_layer")]
    assert modules and not isinstance(modules[0], PerLayerEmbedding)


def _ple(model) -> nn.Module:
    return next(m for n, m in model.named_modules() if n.endswith("embed_tokens_per_layer"))


@pytest.fixture(scope="module")
def table_dirs(tmp_path_factory):
    """One table directory per (model kind, device): the first tier packs, the others reuse."""
    return cache(lambda kind, device: tmp_path_factory.mktemp(f"{kind}-{device}"))


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
    report = offload_per_layer_embeddings(model, tmp_path, tier="device")
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
    with pytest.raises(ValueError, match="not bf16 numbers"):
        offload_per_layer_embeddings(model, tmp_path)
    _assert_untouched(model, before)
    assert not list(tmp_path.iterdir())  # the aborted pack left nothing behind


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


# ----------------------------------------------------------------------------------------------
# Reuse, mismatch, unsupported models: clear errors, model untouched
# ----------------------------------------------------------------------------------------------


def test_matching_table_is_reused(tmp_path):
    first = build("gemma3n-text")
    r1 = offload_per_layer_embeddings(first, tmp_path)
    data = Path(r1.table_path).with_suffix(".rows")
    stamp = data.stat().st_mtime_ns
    second = build("gemma3n-text")  # same seed: same weights
    r2 = offload_per_layer_embeddings(second, tmp_path, tier="mapped")
    assert not r1.reused and r2.reused and r2.fingerprint == r1.fingerprint
    assert data.stat().st_mtime_ns == stamp
    _assert_same_outputs(second, "gemma3n-text", "cpu")
    for m in (first, second):
        _ple(m).close()


def test_fingerprint_mismatch_leaves_model_untouched(tmp_path):
    _ple_close_after = build("gemma3n-text", seed=0)
    offload_per_layer_embeddings(_ple_close_after, tmp_path)
    _ple(_ple_close_after).close()
    other = build("gemma3n-text", seed=1)  # same architecture, other weights
    before = _snapshot(other)
    with pytest.raises(TableMismatchError, match="another model"):
        offload_per_layer_embeddings(other, tmp_path)
    _assert_untouched(other, before)
    shape = build(
        "gemma3n-text",
        seed=0,
        num_hidden_layers=2,
        layer_types=None,
        activation_sparsity_pattern=None,
        num_kv_shared_layers=0,
    )
    before = _snapshot(shape)
    with pytest.raises(TableMismatchError, match="different model"):
        offload_per_layer_embeddings(shape, tmp_path)
    _assert_untouched(shape, before)


def test_weight_changed_after_packing_is_a_mismatch(tmp_path):
    model = build("gemma4-text")
    offload_per_layer_embeddings(copy.deepcopy(model), tmp_path)
    with torch.no_grad():
        _ple(model).weight[17, 3] += 1.0
    before = _snapshot(model)
    with pytest.raises(TableMismatchError):
        offload_per_layer_embeddings(model, tmp_path)
    _assert_untouched(model, before)


def test_unsupported_models_raise_and_stay_untouched(tmp_path):
    torch.manual_seed(0)
    gemma3 = transformers.Gemma3ForCausalLM(
        transformers.Gemma3TextConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        )
    )
    no_ple = build("gemma4-text", hidden_size_per_layer_input=0)
    cases = [
        (gemma3, "model_type 'gemma3_text'"),
        (no_ple, "no per-layer embedding"),
        (nn.Linear(4, 4), "no transformers config"),
    ]
    for model, message in cases:
        before = _snapshot(model)
        with pytest.raises(UnsupportedModelError, match=message):
            offload_per_layer_embeddings(model, tmp_path)
        assert _snapshot(model).keys() == before.keys()
        for k, v in before.items():
            assert torch.equal(model.state_dict()[k], v)
    done = build("gemma3n-text")
    offload_per_layer_embeddings(done, tmp_path / "t")
    with pytest.raises(UnsupportedModelError, match="already served by plestore"):
        offload_per_layer_embeddings(done, tmp_path / "t")
    _ple(done).close()
    assert not list(tmp_path.glob("*.json"))


def test_bad_arguments_leave_model_untouched(tmp_path):
    model = build("gemma4-text")
    before = _snapshot(model)
    not_dir = tmp_path / "file"
    not_dir.write_text("x")
    with pytest.raises(NotADirectoryError):
        offload_per_layer_embeddings(model, not_dir)
    with pytest.raises(ValueError, match="unknown row format"):
        offload_per_layer_embeddings(model, tmp_path, format="int3")
    with pytest.raises(ValueError, match="tier must be one of"):
        offload_per_layer_embeddings(model, tmp_path, tier="nvme")
    with pytest.raises(TypeError, match="unknown table options"):
        offload_per_layer_embeddings(model, tmp_path, cache_size=3)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            offload_per_layer_embeddings(model, tmp_path, device="cuda")
    _assert_untouched(model, before)
    assert list(tmp_path.iterdir()) == [not_dir]


# ----------------------------------------------------------------------------------------------
# From a checkpoint on disk
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny models saved with save_pretrained (safetensors), one per kind."""

    @cache
    def saved(kind: str) -> Path:
        path = tmp_path_factory.mktemp(f"ckpt-{kind}")
        build(kind).save_pretrained(path)
        return path

    return saved


def _device_map(device: str) -> dict:
    """device_map needs accelerate; without it transformers loads on the CPU by default."""
    try:
        import accelerate  # noqa: F401
    except ImportError:
        if device != "cpu":
            pytest.skip("device_map needs accelerate")
        return {}
    return {"device_map": device}


def _from_pretrained(kind: str, path, **kw):
    with _gemma3n_vision_stub():
        return _model_class(kind).from_pretrained(path, dtype=torch.bfloat16, **kw).eval()


class _Allocations(TorchDispatchMode):
    """Records every op that produces a non-meta tensor of `shape` (allocating, initialising
    or copying the weight to a device would; reading a CPU safetensors slice does not dispatch,
    which is what _NeverReads watches)."""

    def __init__(self, shape: tuple, devices: tuple = ("cpu", "cuda")) -> None:
        super().__init__()
        self.shape, self.devices, self.on_device = shape, devices, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            hit = isinstance(t, torch.Tensor) and tuple(t.shape) == self.shape
            if hit and t.device.type in self.devices:
                self.on_device.append((str(func), str(t.device)))
        return out


class _SliceSpy:
    def __init__(self, sl, key: str, reads: list) -> None:
        self._sl, self._key, self._reads = sl, key, reads

    def __getitem__(self, index):
        self._reads.append(self._key)
        return self._sl[index]

    def __getattr__(self, name):
        return getattr(self._sl, name)


class _NeverReads:
    """Spy on transformers' safetensors handles: records every read of the per-layer tensor."""

    def __init__(self, monkeypatch) -> None:
        self.reads: list[str] = []
        import transformers.modeling_utils as mu

        real = mu.safe_open
        spy = self

        class Handle:
            def __init__(self, *args, **kwargs) -> None:
                self._h = real(*args, **kwargs)

            def __getattr__(self, name):
                return getattr(self._h, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return self._h.__exit__(*exc)

            def get_slice(self, key):
                sl = self._h.get_slice(key)
                if not key.endswith("embed_tokens_per_layer.weight"):
                    return sl
                return _SliceSpy(sl, key, spy.reads)  # holding the lazy slice reads nothing

            def get_tensor(self, key):
                if key.endswith("embed_tokens_per_layer.weight"):
                    spy.reads.append(key)
                return self._h.get_tensor(key)

        monkeypatch.setattr(mu, "safe_open", Handle)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("kind", ["gemma3n-text", "gemma4-mm"])
def test_load_gemma_never_materialises_the_table(kind, device, checkpoints, tmp_path, monkeypatch):
    path = checkpoints(kind)
    control = _NeverReads(monkeypatch)  # the spy sees a stock load read the tensor
    stock = _from_pretrained(kind, path, **_device_map(device))
    assert control.reads and control.reads[0].endswith("embed_tokens_per_layer.weight")
    monkeypatch.undo()
    want = {b: _outputs(stock, *_inputs(kind, b, device)) for b in (1, 3)}
    del stock
    from plestore.integrations.transformers import load as load_mod

    seen = []
    real_find = load_mod.find_site
    monkeypatch.setattr(
        load_mod, "find_site", lambda m, **kw: seen.append(real_find(m, **kw)) or seen[-1]
    )
    spy = _NeverReads(monkeypatch)
    with _Allocations((PER_LAYER_ROWS, 64)) as control:  # the watcher sees a model being built
        build(kind)
    assert control.on_device
    # packing reads host chunks of the rows (here: one chunk of the whole tiny table), so the
    # first load watches the GPU only; the second (reusing the table) watches every device
    watch = ("cuda",)
    with _gemma3n_vision_stub(), _Allocations((PER_LAYER_ROWS, 64), watch) as made:
        model, report = load_gemma(
            path, tier="pinned", table_dir=tmp_path, dtype=torch.bfloat16, **_device_map(device)
        )
    assert made.on_device == [], made.on_device
    assert type(model) is _model_class(kind)
    # the original parameter only ever existed on the meta device, and nobody read its bytes
    (site,) = seen
    assert site.module.weight.device.type == "meta"
    assert spy.reads == []
    assert isinstance(_ple(model), PerLayerEmbedding)
    assert not [k for k in model.state_dict() if k.endswith("embed_tokens_per_layer.weight")]
    assert not [n for n, _ in model.named_parameters() if "embed_tokens_per_layer" in n]
    assert report.freed_from == "" and report.freed_bytes == 0 and not report.reused
    assert report.packed_from["kind"] == "checkpoint" and report.source_dtype == "bfloat16"
    assert report.device == str(torch.device(device)) or report.device.startswith(device)
    for batch, (logits, seqs, steps) in want.items():
        got = _outputs(model, *_inputs(kind, batch, device))
        assert torch.equal(got[1], seqs)
        assert_bit_identical(got[0], logits)
        assert_bit_identical(got[2], steps)
    _ple(model).close()
    # loading again reuses the table: the checkpoint file is unchanged, so nothing is re-hashed
    with _gemma3n_vision_stub(), _Allocations((PER_LAYER_ROWS, 64)) as made:
        again, r2 = load_gemma(path, tier="mapped", table_dir=tmp_path, **_device_map(device))
    assert made.on_device == [], made.on_device  # no tensor of the table's shape, anywhere
    assert spy.reads == []
    assert r2.reused and r2.fingerprint == report.fingerprint and r2.tier == "mapped"
    _ple(again).close()


def test_load_gemma_default_table_dir_and_errors(checkpoints, tmp_path):
    path = checkpoints("gemma4-text")
    model, report = load_gemma(path, dtype=torch.bfloat16)
    assert Path(report.table_path).parent == path / "plestore"
    _ple(model).close()
    with pytest.raises(FileNotFoundError, match="not a local checkpoint"):
        load_gemma(tmp_path)
    gemma3 = tmp_path / "gemma3"
    transformers.Gemma3ForCausalLM(
        transformers.Gemma3TextConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        )
    ).save_pretrained(gemma3)
    with pytest.raises(UnsupportedModelError, match="gemma3_text"):
        load_gemma(gemma3)


def test_offload_packs_from_the_checkpoint_it_was_loaded_from(checkpoints, tmp_path):
    path = checkpoints("gemma3n-text")
    model = _from_pretrained("gemma3n-text", path)
    # from_pretrained keeps the rotary buffers in fp32 (build() casts them): its own reference
    want = _outputs(model, *_inputs("gemma3n-text", 3, "cpu"))
    report = offload_per_layer_embeddings(model, tmp_path / "a")
    assert report.packed_from["kind"] == "checkpoint"
    assert report.packed_from["file"] == "model.safetensors"
    got = _outputs(model, *_inputs("gemma3n-text", 3, "cpu"))
    assert torch.equal(got[1], want[1])
    assert_bit_identical(got[0], want[0])
    _ple(model).close()
    changed = _from_pretrained("gemma3n-text", path)
    with torch.no_grad():
        _ple(changed).weight[3] *= 2
    report = offload_per_layer_embeddings(changed, tmp_path / "b")
    assert report.packed_from["kind"] == "weights"  # the checkpoint no longer matches
    _ple(changed).close()


# ----------------------------------------------------------------------------------------------
# Packaging: lazy import, the benchmark at tiny size
# ----------------------------------------------------------------------------------------------


def test_plestore_imports_without_transformers():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import plestore, plestore.integrations.transformers as t\n"
        "assert 'transformers' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "try:\n"
        "    t.load_gemma('.')\n"
        "except ImportError:\n"
        "    print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_benchmark_runs_tiny(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gemma_offload.py"),
            "--tiny",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert {r["variant"] for r in runs} >= {"stock", "pinned", "mapped", "direct"}
    assert {r["batch"] for r in runs} == {1, 8}
    assert all(r["tokens_per_s"] > 0 for r in runs)
    assert all(r["greedy_matches_stock"] for r in runs)
    assert "tok/s" in proc.stdout
