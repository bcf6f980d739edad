"""The SGLang contract job's fixtures (.ci/sglang runs tests/sglang_contract in SGLang's venv):
SGLang's published topology on the CPU (what its modules' constructors read), the plugin
loaded through SGLang's own `load_plugins()`, and small checkpoints.

The plugin's hooks patch SGLang's classes for the rest of the process (SGLang has no way to
take a hook back), so SGLang's own modules are built first (`stock`, session-scoped) and the
plugin is loaded once after them (`plugin`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="the SGLang job's venv has SGLang (.ci/sglang)")
os.environ.setdefault("TRITON_INTERPRET", "1")  # (SGLang's gather kernel on the CPU)
import torch

QWEN = "qwen3.8-flash-next"
PREFIX = "model.language_model.layers.1.ple.ple_embedding"  # the preset's one PLE layer
FORMATS = {"bf16": None, "fp8_e4m3": "float8_e4m3fn"}  # ple_embedding_dtype SGLang reads


@pytest.fixture(scope="session")
def sglang_world():
    """SGLang's runtime context for one CPU process (TP 1)."""
    from sglang.test.test_utils import published_topology

    with published_topology(device="cpu") as server_args:
        yield server_args


def text_config(model_dir: Path, fmt: str, **overrides):
    from sglang.srt.configs.qwen4_exp import Qwen4ExpTextConfig

    text = json.loads((model_dir / "config.json").read_text())["text_config"]
    text.pop("ple_embedding_dtype", None)
    if FORMATS[fmt]:
        text["ple_embedding_dtype"] = FORMATS[fmt]
    return Qwen4ExpTextConfig(**{**text, **overrides})


def build_ngram(cfg):
    """SGLang's n-gram module of the PLE layer, as its model builds it."""
    from sglang.srt.models.qwen4_exp import Qwen4ExpNGramEmbedding

    return Qwen4ExpNGramEmbedding(cfg, int(cfg.ple_embed_dim), 0, None, PREFIX)


def checkpoint_rows(model_dir: Path) -> torch.Tensor:
    """The layer's table as SGLang's load_weights places it: shard i at rows
    [i * ceil(rows / shards), ...) of the full table (the checkpoint's own layout)."""
    from safetensors import safe_open

    shards = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for k in st.keys():  # noqa: SIM118 (not a dict)
                if f"{PREFIX}.ngram_embedding.shard_" in k:
                    shards[int(k.rsplit("shard_", 1)[1].split(".")[0])] = st.get_tensor(k)
    return torch.cat([shards[i] for i in sorted(shards)])


@pytest.fixture(scope="session")
def stock(sglang_world, small_checkpoint, tmp_path_factory):
    """{format: (checkpoint dir, text config, SGLang's own n-gram module over its file
    backend, loaded with the checkpoint's rows)} — built before the plugin is loaded."""
    made = {}
    for fmt in FORMATS:
        model_dir = Path(small_checkpoint(QWEN, fmt))
        file_dir = tmp_path_factory.mktemp(f"sglang-file-{fmt}")
        cfg = text_config(model_dir, fmt, ple_offload_embedding=True, ple_offload_backend="file")
        cfg.ple_offload_dir = str(file_dir)
        module = build_ngram(cfg)
        rows = checkpoint_rows(model_dir)
        emb = module.ngram_embedding
        assert emb.weight.dtype == rows.dtype, (emb.weight.dtype, rows.dtype)
        emb.weight.data[: rows.shape[0]].copy_(rows)
        scale = _checkpoint_scale(model_dir)
        if scale is not None:
            emb.weight_scale.copy_(scale)
        made[fmt] = model_dir, cfg, module
    return made


def _checkpoint_scale(model_dir: Path):
    from safetensors import safe_open

    name = f"{PREFIX}.ngram_embedding.weight_scale"
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            if name in st.keys():  # noqa: SIM118 (not a dict)
                return st.get_tensor(name).to(torch.bfloat16).reshape(1)
    return None


@pytest.fixture(scope="session")
def plugin(stock):
    """The plugin loaded through SGLang's own load_plugins() with PLESTORE_SGLANG set (after
    the stock modules exist); yields the plugin's embedding class."""
    import sglang.srt.plugins as plugins
    from sglang.srt.models import qwen4_exp

    os.environ["PLESTORE_SGLANG"] = json.dumps({"tier": "mapped"})
    plugins._plugins_loaded = False
    plugins.load_plugins()
    from plestore.integrations.sglang.embedding import PlestorePinnedHostEmbedding

    assert qwen4_exp.Qwen4ExpPinnedHostEmbedding is PlestorePinnedHostEmbedding
    yield PlestorePinnedHostEmbedding
    del os.environ["PLESTORE_SGLANG"]
