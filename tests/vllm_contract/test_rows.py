"""The plugin's PLE embedding inside this release's own `Qwen4ExpNGramEmbedding` (vLLM's module,
built on CPU tensors) against the release's resident embedding loaded by vLLM's own loader from
the same checkpoint: every row of the table, and a ragged batch's n-gram rows through the
module's forward, bit-identical (after vLLM's dequantize) — bf16, FP8 and, where the release has
it, NVFP4 (its decode on CPU tensors), on the tiers a CPU serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the contract job's venvs have vLLM (.ci/vllm-contract)")
import torch

QWEN = "qwen3.8-flash-next"
PREFIX = "model.language_model.layers.1.ple.ple_embedding"  # the preset's one PLE layer
#: ple_embedding_dtype, as the released checkpoints declare each format to vLLM
DECLARED = {"bf16": None, "fp8_e4m3": "float8_e4m3fn", "nvfp4": "nvfp4"}
METHODS = {
    "bf16": "Qwen4ExpPLEUnquantizedEmbeddingMethod",
    "fp8_e4m3": "Qwen4ExpPLEFp8EmbeddingMethod",
    "nvfp4": "Qwen4ExpPLENvFp4EmbeddingMethod",
}


def _formats():
    from plestore.integrations.vllm import current_release

    return [f for f in DECLARED if f != "nvfp4" or current_release().nvfp4]


def _text_config(model_dir: Path, fmt: str):
    from transformers import Qwen4ExpTextConfig

    text = json.loads((model_dir / "config.json").read_text())["text_config"]
    text.pop("ple_embedding_dtype", None)  # (0.34 refuses any but nvfp4 and float8_e4m3fn)
    if DECLARED[fmt]:
        text["ple_embedding_dtype"] = DECLARED[fmt]
    return Qwen4ExpTextConfig(**text)


def _build(vllm_config, cfg, settings, max_tokens: int):
    """vLLM's n-gram module of layer 1, its embedding vLLM's (settings None) or plestore's."""
    from vllm.config import set_current_vllm_config
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

    from plestore.integrations.vllm.qwen import _embedding_classes

    with set_current_vllm_config(vllm_config()), _embedding_classes(settings, None):
        return Qwen4ExpNGramEmbedding(
            cfg,
            int(cfg.ple_embed_dim),
            0,  # the dense index of layer 1 (ple_layer_ids [2])
            max_tokens,
            data_parallel_rank=0,
            prefix=PREFIX,
            params_dtype=torch.bfloat16,
        )


def _load_stock(module, model_dir: Path) -> None:
    """The layer's tensors through vLLM's own load_weights (weight_scale_2, one scalar equal
    in every shard, through its parameter's loader), then its post-load checks."""
    from safetensors import safe_open

    weights = []
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            names = [k for k in st.keys() if PREFIX in k]  # noqa: SIM118 (not a dict)
            weights += [(k[len(PREFIX) + 1 :], st.get_tensor(k)) for k in names]
    global_scales = [w for n, w in weights if n.endswith(".weight_scale_2")]
    module.load_weights([(n, w) for n, w in weights if not n.endswith(".weight_scale_2")])
    embedding = module.ngram_embedding
    if global_scales:
        embedding.weight_scale_2.weight_loader(embedding.weight_scale_2, global_scales[0])
    embedding.quant_method.process_weights_after_loading(embedding)


def _bits(rows: torch.Tensor) -> torch.Tensor:
    return rows.contiguous().view(torch.int16)


@pytest.fixture(scope="module")
def stock(vllm_world, small_checkpoint):
    """{format: (checkpoint dir, its text config, vLLM's resident module loaded)}."""
    made = {}
    for fmt in _formats():
        model_dir = Path(small_checkpoint(QWEN, fmt))
        cfg = _text_config(model_dir, fmt)
        module = _build(vllm_world, cfg, None, 4096)
        method = type(module.ngram_embedding.embedding_method).__name__
        assert method == METHODS[fmt], method  # vLLM's own decode of this format
        _load_stock(module, model_dir)
        made[fmt] = model_dir, cfg, module
    made["config"] = vllm_world
    return made


def _ours(stock, fmt, tier, tmp_path):
    from plestore.integrations.vllm import PlestoreSettings
    from plestore.integrations.vllm.qwen import PlestorePLEEmbedding

    model_dir, cfg, module = stock[fmt]
    settings = PlestoreSettings.from_additional_config(
        {"plestore": {"tier": tier, "table_dir": str(tmp_path / "tables")}}
    )
    ours = _build(stock["config"], cfg, settings, 4096)
    assert isinstance(ours.ngram_embedding, PlestorePLEEmbedding)
    assert ours.ngram_embedding.quantized == (None if fmt == "bf16" else fmt)
    assert ours.ngram_embedding.weight.numel() == 0  # no copy of the table in vLLM
    ours.ngram_embedding.open(str(model_dir), settings)
    return ours


@pytest.mark.parametrize("fmt", _formats())
@pytest.mark.parametrize("tier", ["device", "pinned", "mapped", "direct"])
def test_every_row_equals_vllms_resident_embedding(stock, fmt, tier, tmp_path):
    _, _, module = stock[fmt]
    ours = _ours(stock, fmt, tier, tmp_path)
    vllm_rows = module.ngram_embedding
    heads, dim = ours.ngram_heads, vllm_rows.embedding_dim
    rows = vllm_rows.org_vocab_size
    ids = torch.arange(-(-rows // heads) * heads).remainder(rows).view(-1, heads)  # [T, heads]
    for chunk in ids.split(4096):
        want = vllm_rows.dequantize(vllm_rows(chunk), torch.bfloat16).reshape(len(chunk), -1)
        got = ours.ngram_embedding.dequantize(ours.ngram_embedding(chunk), torch.bfloat16)
        assert got.dtype == want.dtype == torch.bfloat16 and got.shape == (len(chunk), heads * dim)
        assert torch.equal(_bits(got), _bits(want)), (fmt, tier)


@pytest.mark.parametrize("fmt", _formats())
def test_a_ragged_batch_through_vllms_module_equals_the_resident_one(stock, fmt, tmp_path):
    """vLLM's hash of a ragged batch (EOS inside, an empty request, decode steps), prefetched
    as vLLM's model prefetches (start, then forward), equals vLLM's resident rows."""
    _, cfg, module = stock[fmt]
    ours = _ours(stock, fmt, "mapped", tmp_path)
    gen = torch.Generator().manual_seed(7)
    eos = int(cfg.eos_token_id)
    input_ids = torch.randint(0, int(cfg.vocab_size), (40,), generator=gen)
    input_ids[[3, 17, 18]] = eos
    qsl = torch.tensor([0, 1, 1, 25, 26, 40], dtype=torch.int32)  # one empty, two decodes
    context = torch.randint(0, int(cfg.vocab_size), (5, cfg.ngram_size - 1), generator=gen)
    context[1, 0] = eos
    hidden = torch.zeros(40, 8, dtype=torch.bfloat16)  # (unused without sequence parallel)
    want = module(hidden, input_ids, qsl, context.int())
    want = module.ngram_embedding.dequantize(want, torch.bfloat16)
    ours.start_prefetch(input_ids, qsl, context.int())
    got = ours(hidden, input_ids, qsl, context.int())
    got = ours.ngram_embedding.dequantize(got, torch.bfloat16)
    assert torch.equal(_bits(got), _bits(want))


def test_the_sequence_parallel_reduce_scatter_is_vllms_own(stock, tmp_path):
    """Where vLLM's n-gram module reduce-scatters (sequence parallel, ETP = TP) it sums the
    ranks' parts with its own method, which the plugin leaves as it is: the parts' -0.0 rows for
    other ranks' ids keep that sum exact; with one rank it gives the rows themselves, -0.0
    included."""
    from vllm.config import set_current_vllm_config

    ours = _ours(stock, "bf16", "mapped", tmp_path)
    ours.use_reduce_scatter = ours.use_sequence_parallel = True
    assert "_sp_shard_embeddings" not in vars(ours)  # (the class's method, vLLM's)
    rows = torch.tensor([[-0.0, 1.5], [0.0, -2.0]], dtype=torch.bfloat16)
    with set_current_vllm_config(stock["config"]()):
        out = ours._sp_shard_embeddings(rows)
    assert torch.equal(_bits(out), _bits(rows))


@pytest.mark.parametrize("flag", ["cpu_offload", "disk_offload"])
def test_plestores_tables_win_over_vllms_own_offload(stock, flag, release, monkeypatch):
    """With engram_config asking for vLLM's pinned copy or (0.34) its disk offload, the module
    gets plestore's embedding, the log says so, and vLLM's other choices stay its own (no
    reduce-scatter where disk offload would have none)."""
    from vllm.config import set_current_vllm_config
    from vllm.config.engram import EngramConfig
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

    from plestore.integrations.vllm import PlestoreSettings, qwen
    from plestore.integrations.vllm.qwen import PlestorePLEEmbedding, _embedding_classes

    if flag not in {f for _, f in release.embedding_classes}:
        pytest.skip(f"vLLM {release.version} has no engram_config.{flag}")
    _, cfg, _ = stock["bf16"]
    settings = PlestoreSettings.from_additional_config({"plestore": {}})
    vllm_config = stock["config"]()
    vllm_config.engram_config = EngramConfig(**{flag: True})
    said = []  # (what the plugin logs; vLLM's logging config may disable other loggers)
    monkeypatch.setattr(qwen.log, "info", lambda msg, *args: said.append(msg % args))
    with (
        set_current_vllm_config(vllm_config),
        _embedding_classes(settings, vllm_config.engram_config),
    ):
        module = Qwen4ExpNGramEmbedding(
            cfg,
            int(cfg.ple_embed_dim),
            0,
            64,
            data_parallel_rank=0,
            prefix=PREFIX,
            params_dtype=torch.bfloat16,
            use_sequence_parallel=True,
        )
    assert isinstance(module.ngram_embedding, PlestorePLEEmbedding)
    assert any(f"vLLM's own offload (engram_config.{flag}) is not used" in m for m in said), said
    assert module.use_reduce_scatter == (flag != "disk_offload")  # what vLLM itself chooses
