"""plestore inside a real vLLM engine (vLLM's CPU build; the vLLM job of .ci/run): tokens of
engines serving the PLE tables from plestore equal the same engine without it, on every host
tier, for bf16 and FP8 checkpoints; stock vLLM equals transformers' float32 greedy loop; Gemma 3n
through the plugin equals transformers; tables are packed once and reused; bad input is a clear
error at engine start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm", reason="the vLLM job's venv has vLLM (.ci/vllm); this one has not")

from vllm_models import PROMPTS  # noqa: E402

from conftest import run_engine, tokens_of  # noqa: E402

HOST_TIERS = ["pinned", "mapped", "direct"]
NEW_TOKENS = 16


def _job(model, plestore=None, **kw) -> dict:
    return {"model": str(model), "plestore": plestore, "prompts": PROMPTS, **kw}


@pytest.fixture(scope="module")
def stock(checkpoints):
    """Tokens of vLLM without plestore, per Qwen checkpoint (one engine each)."""
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = tokens_of(_job(checkpoints(kind), max_tokens=NEW_TOKENS))
        return cache[kind]

    return get


#: a token vLLM (bf16) picks where float32 transformers ranks another first must be within this
#: of its logit (a near-tie; the tiny random models' logits lie within ~0.3 of each other)
NEAR_TIE = 5e-3


def _near_ties(model_dir, prompts, tokens, dtype) -> tuple[int, list]:
    """Teacher-force vLLM's tokens through transformers (no cache: its generate() cannot run an
    all-linear-attention Qwen4Exp): (tokens checked, the steps where transformers' argmax is
    another token, with the logit gap)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    checked, ties = 0, []
    with torch.no_grad():
        for p, gen in zip(prompts, tokens, strict=True):
            for k, tok in enumerate(gen):
                logits = model(torch.tensor([list(p) + gen[:k]]), use_cache=False).logits[0, -1]
                best = int(logits.argmax())
                checked += 1
                if best != tok:
                    ties.append((k, tok, best, float(logits[best] - logits[tok])))
    return checked, ties


def test_stock_vllm_equals_transformers_float32(checkpoints, stock):
    """Every token vLLM picks is float32 transformers' argmax, or within NEAR_TIE of it."""
    import torch

    tokens = stock("qwen-bf16")
    checked, ties = _near_ties(checkpoints("qwen-bf16"), PROMPTS, tokens, torch.float32)
    assert checked == len(PROMPTS) * NEW_TOKENS
    assert all(gap < NEAR_TIE for *_, gap in ties), ties
    assert len(ties) <= checked // 16, ties  # rare: the others are equal


def _killed_pack(model_dir, table_dir):
    """Leave table_dir as a pack killed half-way leaves it: temporary files, nothing that opens."""
    env = {**os.environ, "PLESTORE_PACK_BATCH_DELAY_S": "0.2"}
    cmd = [sys.executable, "-m", "plestore", "pack", str(model_dir), str(table_dir)]
    cmd += ["--batch-mib", "0.001", "--threads", "1", "--no-progress"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 60
        while not list(table_dir.glob(".*.tmp-*")):
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert not list(table_dir.glob("*.json"))


def _table_files(table_dir):
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in table_dir.glob("ple.*")}


@pytest.mark.parametrize("kind", ["qwen-bf16", "qwen-fp8"])
def test_every_host_tier_serves_the_stock_engines_tokens(kind, checkpoints, stock, tmp_path):
    """The first start packs (over a killed pack's leftovers), the others reuse the tables."""
    model, tables = checkpoints(kind), tmp_path / "tables"
    tables.mkdir()
    _killed_pack(model, tables)
    packed = None
    for tier in HOST_TIERS:
        conf = {"tier": tier, "table_dir": str(tables)}
        result, out = run_engine(_job(model, conf, max_tokens=NEW_TOKENS))
        assert result["error"] is None, out[-6000:]
        assert result["tokens"] == stock(kind), tier
        for layer in (0, 1):
            assert f"model.layers.{layer}.ple.ple_embedding.ngram_embedding" in out
        assert f"tier {tier}" in out
        if packed is None:  # the first start packed both layers' tables, and nothing is left
            assert out.count("(packed)") == 2 and not list(tables.glob(".*.tmp-*"))
            packed = _table_files(tables)
        else:
            assert out.count("(reused)") == 2 and _table_files(tables) == packed
