"""The Gemma 3n / Gemma 4 integration: reuse, mismatch and unsupported models leave the model
untouched; load_gemma never materialises the table; the lazy import; the benchmark at tiny
size."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors_spy import spy_reads
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import assert_bit_identical, devices

transformers = pytest.importorskip("transformers")

import gemma_models  # noqa: E402
from gemma_models import (  # noqa: E402
    PER_LAYER_ROWS,
    _assert_same_outputs,
    _assert_untouched,
    _gemma3n_vision_stub,
    _inputs,
    _model_class,
    _outputs,
    _ple,
    _snapshot,
    build,
)

from plestore.integrations.transformers import (  # noqa: E402
    PerLayerEmbedding,
    TableMismatchError,
    UnsupportedModelError,
    load_gemma,
    offload_per_layer_embeddings,
)

table_dirs = gemma_models.table_dirs  # a fixture

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


def _gemma3() -> nn.Module:
    """A tiny Gemma 3 (no per-layer embeddings: a model plestore refuses)."""
    return transformers.Gemma3ForCausalLM(
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


def test_unsupported_models_raise_and_stay_untouched(tmp_path):
    torch.manual_seed(0)
    gemma3 = _gemma3()
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
    which is what _per_layer_reads watches)."""

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


def _per_layer_reads(monkeypatch) -> list[str]:
    """The per-layer tensor's reads through transformers' safetensors handles."""
    return spy_reads(monkeypatch, lambda key: key.endswith("embed_tokens_per_layer.weight"))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("kind", ["gemma3n-text", "gemma4-mm"])
def test_load_gemma_never_materialises_the_table(kind, device, checkpoints, tmp_path, monkeypatch):
    path = checkpoints(kind)
    reads = _per_layer_reads(monkeypatch)  # the spy sees a stock load read the tensor
    stock = _from_pretrained(kind, path, **_device_map(device))
    assert reads and reads[0].endswith("embed_tokens_per_layer.weight")
    monkeypatch.undo()
    want = {b: _outputs(stock, *_inputs(kind, b, device)) for b in (1, 3)}
    del stock
    from plestore.integrations.transformers.gemma import load as load_mod

    seen = []
    real_find = load_mod.find_site
    monkeypatch.setattr(
        load_mod, "find_site", lambda m, **kw: seen.append(real_find(m, **kw)) or seen[-1]
    )
    spy = _per_layer_reads(monkeypatch)
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
    assert spy == []
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
    assert spy == []
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
    _gemma3().save_pretrained(gemma3)
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


def _has_accelerate() -> bool:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("model", ["gemma3n-e2b", "qwen4exp"])
def test_bench_transformers_runs_tiny(model):
    """`plestore bench transformers` at a tiny size on the CPU: every variant runs and
    generates the stock tokens (its speed numbers mean nothing here)."""
    cmd = [sys.executable, "-m", "plestore", "bench", "transformers", "--model", model]
    cmd += ["--tiny", "--tiers", "mapped,device", "--batches", "1,2", "--repeats", "1", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    runs = result["runs"]
    want = {"stock", "mapped", "device"}
    if model == "qwen4exp":  # (the disk variant needs accelerate)
        want |= {"accelerate-cpu"} | ({"accelerate-disk"} if _has_accelerate() else set())
    assert {r["variant"] for r in runs} == want
    assert {r["batch"] for r in runs} == {1, 2}
    assert all(r["tokens_per_s"] > 0 and r["greedy_matches_stock"] for r in runs)
    assert result["table"]["exact"] and "tok/s" in proc.stderr
