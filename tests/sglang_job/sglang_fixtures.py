"""Fixtures of the SGLang job (.ci/sglang): the tiny checkpoints, made once per session. Imported
by the job's test modules (`from sglang_fixtures import checkpoints`): a conftest.py here would
take the suite's `conftest` module name. Nothing here imports SGLang."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """checkpoints(kind) -> the directory of a tiny Qwen4-Exp checkpoint in SGLang's form
    (sglang_models.save_qwen), made on first use: "bf16" or "fp8" (e4m3 PLE shards + scale)."""
    from sglang_models import save_qwen

    made: dict[str, Path] = {}
    makers = {"bf16": lambda d: save_qwen(d), "fp8": lambda d: save_qwen(d, fp8=True)}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = makers[kind](tmp_path_factory.mktemp(f"qwen4exp-{kind}"))
        return made[kind]

    return get


KINDS = ["bf16", "fp8"]


def offload_args(directory) -> dict:
    """SGLang's own PLE offload (Qwen4ExpPinnedHostEmbedding and its Triton gather, the
    prefetch a layer ahead): its `file` backend (the `pinned` one needs CUDA's pinned memory)."""
    return {
        "ple_offload_embedding": True,
        "ple_offload_backend": "file",
        "ple_offload_dir": str(directory),
    }


@pytest.fixture(scope="session")
def stock(checkpoints, tmp_path_factory):
    """{name: EngineRun} of stock SGLang (PLESTORE_SGLANG unset): each checkpoint on one rank;
    the bf16 one on two ("bf16-tp2": tensor parallel over gloo) and with SGLang's PLE offload
    ("bf16-offload")."""
    from sglang_engines import run_engines

    off = {"PLESTORE_SGLANG": None}
    jobs = {k: {"model": checkpoints(k), "env": off} for k in KINDS}
    jobs["bf16-tp2"] = {"model": checkpoints("bf16"), "env": off, "engine_args": {"tp_size": 2}}
    jobs["bf16-offload"] = {
        "model": checkpoints("bf16"),
        "env": off,
        "engine_args": offload_args(tmp_path_factory.mktemp("ple-offload")),
    }
    return dict(zip(jobs, run_engines(list(jobs.values()), parallel=2), strict=True))
