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
