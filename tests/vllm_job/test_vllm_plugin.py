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
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM job's venv has vLLM (.ci/vllm); this one has not")

from engines import run_engine, run_engines  # noqa: E402
from slow_pack import slow_pack  # noqa: E402
from vllm_models import GEMMA_PROMPTS, PROMPTS  # noqa: E402

HOST_TIERS = ["pinned", "mapped", "direct"]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Directories of the tiny checkpoints, made once (lazily, per kind)."""
    from vllm_models import save_gemma, save_qwen

    made: dict[str, Path] = {}
    makers = {
        "qwen-bf16": lambda d: save_qwen(d),
        "qwen-fp8": lambda d: save_qwen(d, fp8=True),
        "gemma3n": save_gemma,
    }

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = makers[kind](tmp_path_factory.mktemp(kind))
        return made[kind]

    return get


def _job(model, plestore=None, **kw) -> dict:
    return {"model": str(model), "plestore": plestore, "prompts": PROMPTS, **kw}


@pytest.fixture(scope="module")
def served(checkpoints, tmp_path_factory):
    """Every TP1 engine of this module, run once, one after another in one process (their
    order matters: the first start on a table directory packs, the later ones reuse):
    {name: (RESULT, log)}. Table directories start as a killed pack leaves them."""
    tables = {k: tmp_path_factory.mktemp(f"tables-{k}") for k in ("qwen-bf16", "qwen-fp8")}
    for kind, directory in tables.items():
        _killed_pack(checkpoints(kind), directory)
    jobs = {}
    for kind in ("qwen-bf16", "qwen-fp8"):
        jobs[f"stock-{kind}"] = _job(checkpoints(kind))
        for tier in HOST_TIERS:
            conf = {"tier": tier, "table_dir": str(tables[kind])}
            jobs[f"{tier}-{kind}"] = _job(checkpoints(kind), conf)
    gemma = {"tier": "mapped", "table_dir": str(tmp_path_factory.mktemp("tables-gemma"))}
    jobs["gemma3n"] = {**_job(checkpoints("gemma3n"), gemma, dtype="float32")}
    jobs["gemma3n"]["prompts"] = GEMMA_PROMPTS
    # bad input that only the worker can see: another checkpoint's tables in table_dir
    jobs["foreign"] = _job(checkpoints("qwen-bf16"), {"table_dir": str(tables["qwen-fp8"])})
    runs = run_engines([{**j, "max_tokens": NEW_TOKENS} for j in jobs.values()])
    return dict(zip(jobs, runs, strict=True)), tables


def tokens(served, name):
    result, log = served[0][name]
    assert result["error"] is None, log[-6000:]
    return result["tokens"]


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


def test_stock_vllm_equals_transformers_float32(checkpoints, served):
    """Every token vLLM picks is float32 transformers' argmax, or within NEAR_TIE of it."""
    import torch

    got = tokens(served, "stock-qwen-bf16")
    checked, ties = _near_ties(checkpoints("qwen-bf16"), PROMPTS, got, torch.float32)
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
def test_every_host_tier_serves_the_stock_engines_tokens(kind, served):
    """The first start packs (over a killed pack's leftovers), the others reuse the tables."""
    runs, tables = served
    packed = None
    for tier in HOST_TIERS:
        result, log = runs[f"{tier}-{kind}"]
        assert tokens(served, f"{tier}-{kind}") == tokens(served, f"stock-{kind}"), tier
        for layer in (0, 1):
            assert f"model.layers.{layer}.ple.ple_embedding.ngram_embedding rows [0, " in log
        assert f"tier {tier}" in log
        if packed is None:  # the first start packed both layers' tables, and nothing is left
            assert log.count("(packed)") == 2 and not list(tables[kind].glob(".*.tmp-*"))
            packed = _table_files(tables[kind])
        else:
            assert log.count("(reused)") == 2 and _table_files(tables[kind]) == packed


def test_a_killed_host_side_fails_the_request_at_that_step(checkpoints, served):
    """The tables' host threads ended between two requests: the next step's rows never come
    (timeout_s), and the request fails at that step with FeedError naming the table and the
    cause — no token sampled from its NaN rows is returned. (On the CPU build the error comes
    from the lookup's own eager finish; the runner hooks that check a captured GPU step after
    the sampled tokens' sync are tested by tests/vllm_contract/test_steps.py.)"""
    _, tables = served
    conf = {"tier": "direct", "table_dir": str(tables["qwen-bf16"]), "timeout_s": 1}
    job = {**_job(checkpoints("qwen-bf16"), conf), "max_tokens": 4, "stop_feeds_after": 2}
    result, log = run_engine(job)
    assert result["tokens"] is None, log[-4000:]
    want = (
        r"FeedError: table ple\.layers\.\d+: step \d+'s rows did not reach the GPU within 1 s "
        r"\(the host side is dead\)"
    )
    assert re.search(want, result["error"]), result["error"]


# -- one table set per model directory, whichever engine starts ----------------------------------

#: tokens each vLLM start of the alternation generates (a prefix of the stock engines' ones)
ALTERNATE_TOKENS = 8


def _every_file(table_dir):
    """Every file of a table directory, the pack lock included: (inode, size, mtime)."""
    return {
        p.name: (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns)
        for p in table_dir.iterdir()
    }


def _fingerprint(model_dir, name="ple.layers.0"):
    from plestore.checkpoint import Checkpoint, detect_tables

    with Checkpoint.open(model_dir) as ck:
        return next(s.fingerprint for s in detect_tables(ck) if s.name == name)


def _transformers_start(model_dir, table_dir, stock, sequences, caplog):
    """transformers load() on table_dir: (whether it reused the tables, what it logged); its
    logits on `sequences` (teacher-forced, no cache) bit-identical to stock transformers'."""
    import logging

    import torch

    from plestore.integrations.transformers import NGramEmbedding, load

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="plestore"):
        model, report = load(model_dir, tier="mapped", table_dir=table_dir, dtype=torch.bfloat16)
    try:
        with torch.no_grad():
            for seq in sequences:
                ids = torch.tensor([seq])
                got = model.eval()(ids, use_cache=False).logits
                assert torch.equal(got, stock(ids, use_cache=False).logits), seq
    finally:
        for m in model.modules():
            if isinstance(m, NGramEmbedding):
                m.close()
    return report.reused, caplog.text


def test_transformers_and_vllm_alternate_on_one_table_set(checkpoints, served, tmp_path, caplog):
    """transformers load(), a vLLM engine, load(), an engine, on one table directory per
    checkpoint (bf16, FP8): the first packs, every later start logs reuse and writes nothing
    (the lock file included); each serves its stock engine's tokens; the other checkpoint's
    directory is refused by both, naming both fingerprints."""
    import torch
    from transformers import AutoModelForCausalLM

    from plestore.integrations.tables import TableMismatchError
    from plestore.integrations.transformers import load

    kinds = ("qwen-bf16", "qwen-fp8")
    tables = {k: tmp_path / k for k in kinds}
    want = {k: [t[:ALTERNATE_TOKENS] for t in tokens(served, f"stock-{k}")] for k in kinds}
    packed = {}
    for start in range(4):  # transformers, vLLM, transformers, vLLM
        if start % 2 == 0:
            for k in kinds:
                stock = AutoModelForCausalLM.from_pretrained(checkpoints(k), dtype=torch.bfloat16)
                sequences = [p + t for p, t in zip(PROMPTS, want[k], strict=True)]
                reused, log = _transformers_start(
                    checkpoints(k), tables[k], stock.eval(), sequences, caplog
                )
                assert reused == (start > 0) and ("reused" in log) == (start > 0), log
            if start == 0:  # packed: the tables, and no pack lock left behind
                packed = {k: _every_file(tables[k]) for k in kinds}
                assert not any(".plestore-pack.lock" in f for f in packed.values()), packed
        else:
            conf = {k: {"tier": "mapped", "table_dir": str(tables[k])} for k in kinds}
            jobs = [_job(checkpoints(k), conf[k], max_tokens=ALTERNATE_TOKENS) for k in kinds]
            if start == 3:  # the bf16 checkpoint on the FP8 one's tables
                jobs.append(_job(checkpoints("qwen-bf16"), conf["qwen-fp8"], max_tokens=1))
            runs = run_engines(jobs)
            for k, (result, log) in zip(kinds, runs, strict=False):
                assert result["error"] is None, log[-6000:]
                assert result["tokens"] == want[k], (start, k)
                assert log.count("(reused)") == 2 and "(packed)" not in log, log[-6000:]
        for k in kinds:  # the second and later starts wrote nothing
            assert _every_file(tables[k]) == packed[k], (start, k)
    mine, theirs = _fingerprint(checkpoints("qwen-bf16")), _fingerprint(checkpoints("qwen-fp8"))
    assert mine != theirs
    refused = runs[2][0]["error"]
    assert refused is not None and mine in refused and theirs in refused, refused
    with pytest.raises(TableMismatchError) as e:
        load(
            checkpoints("qwen-bf16"),
            tier="mapped",
            table_dir=tables["qwen-fp8"],
            dtype=torch.bfloat16,
        )
    assert mine in str(e.value) and theirs in str(e.value)
    assert _every_file(tables["qwen-fp8"]) == packed["qwen-fp8"]


def test_gemma3n_through_plestore_equals_transformers_float32(checkpoints, served):
    """Stock vLLM's text-only Gemma 3n never reads its per-layer table; through the plugin it
    does, from a plestore table, and its float32 tokens equal transformers' greedy ones."""
    import torch
    from transformers import AutoModelForCausalLM

    got = tokens(served, "gemma3n")
    assert "embed_tokens_per_layer from" in served[0]["gemma3n"][1]
    ref = AutoModelForCausalLM.from_pretrained(checkpoints("gemma3n"), dtype=torch.float32)
    for prompt, row in zip(GEMMA_PROMPTS, got, strict=True):
        ids = torch.tensor([prompt])
        want = ref.eval().generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert row == want[0, len(prompt) :].tolist()


def test_tensor_parallel_ranks_read_their_vocab_range_and_combine_exactly(
    checkpoints, served, tmp_path
):
    """TP2 (vLLM's worker processes, one core each): every rank opens only its vLLM vocab
    range, one packs while the other waits, and vLLM's all-reduce of the parts gives the TP1
    engine's tokens. With share="node" each range is one pinned copy, removed when the engine
    ends."""
    model, shm = checkpoints("qwen-bf16"), tmp_path / "shm"
    shm.mkdir()
    conf = {"tier": "pinned", "share": "node", "table_dir": str(tmp_path / "tables")}
    job = _job(model, conf, tp=2, max_tokens=8, env={"PLESTORE_SHM_DIR": str(shm)})
    result, log = run_engine(job)
    assert result["error"] is None, log[-6000:]
    assert result["tokens"] == [t[:8] for t in tokens(served, "stock-qwen-bf16")]
    for rows in ("[0, 1032)", "[1032, 2064)"):  # layer 0's 2064 rows, split as vLLM splits
        assert f"model.layers.0.ple.ple_embedding.ngram_embedding rows {rows}" in log
    assert log.count("(packed)") == 2 and log.count("(reused)") == 2
    assert not list(shm.glob("*.seg*"))  # the copies went with the engine


# -- bad input: a clear error at engine start, never a hang, never wrong rows ---------------------


def test_another_checkpoints_tables_are_refused_naming_both(served):
    """An error only the model's build can see: raised from LLM() (in-process engine) with
    the layer and both fingerprints."""
    (result, _), tables = served[0]["foreign"], served[1]["qwen-fp8"]
    source = json.loads((tables / "ple.layers.0.json").read_text())["source"]
    assert result["tokens"] is None
    assert "TableServeError: model.layers.0.ple.ple_embedding.ngram_embedding: " in result["error"]
    theirs = (
        f"another checkpoint ({source['checkpoint']}, source fingerprint {source['fingerprint']})"
    )
    assert f"{theirs}; this engine's checkpoint" in result["error"]


def test_an_unknown_key_fails_before_the_engine_starts(checkpoints):
    result, log = run_engine(_job(checkpoints("qwen-bf16"), {"tierr": "mapped"}))
    assert "unknown key 'tierr'; known keys: cache_bytes" in result["error"]
    assert "Loading weights" not in log  # raised by LLM() before anything is built


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
        ({"pack_timeout_s": -1}, "pack_timeout_s must be a finite number > 0"),
    ],
)
def test_bad_settings_are_named(checkpoints, conf, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _engine_config(checkpoints("qwen-bf16"), conf)


def test_an_unsupported_vllm_release_is_named(checkpoints, monkeypatch):
    """Refused at engine start naming the tested range and the one setting that runs it anyway;
    with that setting, the contract check still runs (here it passes: these are 0.32's names)."""
    import vllm

    from plestore.integrations.vllm import ALLOW_UNTESTED

    monkeypatch.delenv(ALLOW_UNTESTED, raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    with pytest.raises(
        RuntimeError,
        match=rf"tested with vLLM 0\.32\.x to 0\.34\.x; this is vLLM 0\.31\.2\. .*"
        rf"{ALLOW_UNTESTED}=1 to run it anyway at your own risk",
    ):
        _engine_config(checkpoints("qwen-bf16"), {})
    monkeypatch.setenv(ALLOW_UNTESTED, "1")
    assert _engine_config(checkpoints("qwen-bf16"), {}).additional_config["plestore"] == {}


def test_a_model_without_ple_layers_is_refused(tmp_path):
    from vllm_models import save_qwen

    model = save_qwen(tmp_path / "no-ple", ple_layer_ids=[])
    with pytest.raises(RuntimeError, match=r"has no PLE layers \(ple_layer_ids is empty\)"):
        _engine_config(model, {"tier": "mapped"})
