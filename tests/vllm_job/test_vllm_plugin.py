"""plestore inside a real vLLM engine (vLLM's CPU build; the vLLM job of .ci/run): tokens of
engines serving the PLE tables from plestore equal the same engine without it, on every host
tier, for bf16 and FP8 checkpoints; stock vLLM equals transformers' float32 greedy loop; Gemma 3n
through the plugin equals transformers; tables are packed once and reused; bad input is a clear
error at engine start."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm", reason="the vLLM job's venv has vLLM (.ci/vllm); this one has not")

from slow_pack import slow_pack  # noqa: E402
from vllm_models import GEMMA_PROMPTS, PROMPTS  # noqa: E402

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
    cmd = slow_pack(model_dir, table_dir, 0.2, "--batch-mib", "0.001")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
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


def test_gemma3n_through_plestore_equals_transformers_float32(checkpoints, tmp_path):
    """Stock vLLM's text-only Gemma 3n never reads its per-layer table; through the plugin it
    does, from a plestore table, and its float32 tokens equal transformers' greedy ones."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = checkpoints("gemma3n")
    conf = {"tier": "mapped", "table_dir": str(tmp_path / "tables")}
    job = {"model": str(model_dir), "plestore": conf, "prompts": GEMMA_PROMPTS}
    result, out = run_engine({**job, "dtype": "float32", "max_tokens": NEW_TOKENS})
    assert result["error"] is None, out[-6000:]
    assert "embed_tokens_per_layer from" in out and "(packed)" in out
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, got in zip(GEMMA_PROMPTS, result["tokens"], strict=True):
        ids = torch.tensor([prompt])
        want = ref.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=16)
        assert got == want[0, len(prompt) :].tolist()


def test_tensor_parallel_ranks_read_their_vocab_range_and_combine_exactly(
    checkpoints, stock, tmp_path
):
    """TP2 (each rank one core): every rank opens only its vLLM vocab range, one packs while the
    other waits, and the parts' integer all-reduce gives the TP1 engine's tokens. With
    share="node" each range is one pinned copy, removed when the engine ends."""
    model, shm = checkpoints("qwen-bf16"), tmp_path / "shm"
    shm.mkdir()
    conf = {"tier": "pinned", "share": "node", "table_dir": str(tmp_path / "tables")}
    job = _job(model, conf, tp=2, max_tokens=8, env={"PLESTORE_SHM_DIR": str(shm)})
    result, out = run_engine(job)
    assert result["error"] is None, out[-6000:]
    assert result["tokens"] == tokens_of(_job(model, tp=2, max_tokens=8))
    assert result["tokens"] == [t[:8] for t in stock("qwen-bf16")]
    for rows in ("[0, 1032)", "[1032, 2064)"):  # layer 0's 2064 rows, split as vLLM splits
        assert f"model.layers.0.ple.ple_embedding.ngram_embedding rows {rows}" in out
    assert out.count("(packed)") == 2 and out.count("(reused)") == 2
    assert not list(shm.glob("*.seg*"))  # the copies went with the engine


# -- bad input: a clear error at engine start, never a hang, never wrong rows ---------------------


def _error_of(job) -> tuple[str, str]:
    result, out = run_engine(job)
    assert result["tokens"] is None and result["error"], "the engine started"
    return result["error"], out


def test_an_unknown_key_fails_before_any_worker_starts(checkpoints):
    error, out = _error_of(_job(checkpoints("qwen-bf16"), {"tierr": "mapped"}))
    assert "unknown key 'tierr'; known keys: cache_bytes" in error
    assert "EngineCore" not in out  # raised by LLM() itself, in the process starting the engine


def _engine_config(model, plestore):
    """What LLM() does first: vLLM's config of the engine, with the plugin's checks."""
    from vllm import EngineArgs

    args = EngineArgs(model=str(model), skip_tokenizer_init=True, enforce_eager=True)
    args.additional_config = {"plestore": plestore}
    return args.create_engine_config()


@pytest.mark.parametrize(
    "conf, message",
    [
        ({"tier": "nvme"}, "tier must be one of auto, device, pinned"),
        ({"row_start": 0}, "plestore.row_start is set by vLLM"),
        ({"pack_timeout_s": -1}, "pack_timeout_s must be > 0"),
    ],
)
def test_bad_settings_are_named(checkpoints, conf, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _engine_config(checkpoints("qwen-bf16"), conf)


def test_an_unsupported_vllm_release_is_named(checkpoints, monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.x; this is vLLM 0\.31\.2"):
        _engine_config(checkpoints("qwen-bf16"), {})


def test_a_model_without_ple_layers_is_refused(tmp_path):
    from vllm_models import save_qwen

    model = save_qwen(tmp_path / "no-ple", ple_layer_ids=[])
    with pytest.raises(RuntimeError, match=r"has no PLE layers \(ple_layer_ids is empty\)"):
        _engine_config(model, {"tier": "mapped"})


def test_another_checkpoints_tables_are_refused_naming_both(checkpoints, tmp_path):
    tables = tmp_path / "tables"
    cmd = [sys.executable, "-m", "plestore", "pack", str(checkpoints("qwen-fp8")), str(tables)]
    subprocess.run(cmd + ["--no-progress"], check=True, capture_output=True)
    theirs = json.loads((tables / "ple.layers.0.json").read_text())["source"]["fingerprint"]
    error, out = _error_of(_job(checkpoints("qwen-bf16"), {"table_dir": str(tables)}))
    assert "Engine core initialization failed" in error
    assert "TableServeError: model.layers.0.ple.ple_embedding.ngram_embedding: " in out
    assert f"(source fingerprint {theirs}); this engine's checkpoint" in out


def test_a_tier_that_cannot_serve_is_named_with_its_layer(checkpoints, tmp_path):
    """(A filesystem without O_DIRECT, the other such case, is not to be had here: tmpfs takes
    O_DIRECT on this kernel; the tier's own probe test covers it.)"""
    conf = {"tier": "direct", "share": "node", "table_dir": str(tmp_path / "tables")}
    error, out = _error_of(_job(checkpoints("qwen-bf16"), conf))
    assert "Engine core initialization failed" in error
    assert "TableServeError: model.layers.0.ple.ple_embedding.ngram_embedding: " in out
    assert "the direct tier holds none to share" in out
