"""`plestore bench vllm`: a decode step's lookups as vLLM runs them through the plugin, on small
layers — Qwen4Exp's PLE layer and DeepSeek-V4.1's two Engram layers — every tier beside vLLM's own
paths, every step's rows checked bit for bit (a wrong row fails the run)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import requires_cuda
from plestore.bench.uva_kernel import persistent_grid_gather
from plestore.bench.vllm_step import main
from plestore.integrations.tables import ple_table_name, prepare_table
from plestore.tablefile import TableFile

SMALL = ["--hidden", "32", "--q-dim", "32", "--kv-dim", "8", "--ffn", "64", "--layers", "1"]
PAUSED = {"after-idle", "after-idle-unwoken"}


@pytest.fixture(scope="module")
def qwen_table(tmp_path_factory, small_checkpoint):
    out = tmp_path_factory.mktemp("tables")
    ck = small_checkpoint("qwen3.8-flash-next", "fp8_e4m3")
    return prepare_table(ck, out, ple_table_name(1))[0]


@pytest.fixture(scope="module")
def engram_dir(tmp_path_factory, small_checkpoint):
    out = tmp_path_factory.mktemp("engram")
    ck = small_checkpoint("deepseek-v4.1-flash", "fp8_ue8m0")
    for layer in (1, 14):
        prepare_table(ck, out, f"engram.layers.{layer}")
    return out


def _bench(capsys, table, tiers, cold, extra=()) -> list[dict]:
    argv = [str(table), "--steps", "3", "--batches", "1,4", "--tiers", ",".join(tiers)]
    argv += ["--idle-s", "0.01", *SMALL, *extra, "--csv", "", "--json"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    want = {(t, "warm", b) for t in tiers for b in (1, 4)}
    want |= {(t, "cold", b) for t in cold for b in (1, 4)}
    assert {(r["tier"], r["cache"], r["batch"]) for r in rows} == want
    assert all(r["steps_with_wrong_rows"] == 0 and r["step_us"] > 0 for r in rows)
    assert all(r["added_us"] is not None for r in rows)
    assert {r["variant"] for r in rows} == {"plain", "busy-main-thread", *PAUSED}
    assert all("idle_host_thread_cpu" in r for r in rows if r["variant"] in PAUSED)
    return rows


def test_the_qwen_step_runs_every_tier_exactly(qwen_table, capsys):
    """plestore's tiers beside vLLM 0.34's two offload paths, warm and (the tiers that read
    storage) cold."""
    tiers = ("device", "pinned", "mapped", "direct+eager", "vllm-pinned-uva", "vllm-disk-offload")
    _bench(capsys, qwen_table, tiers, cold=("mapped", "direct+eager", "vllm-disk-offload"))


def test_the_engram_step_runs_every_tier_exactly(engram_dir, capsys):
    """A directory of both Engram layers' tables times the Engram step: both layers' rows of
    every step exact on every tier, vLLM's pinned-UVA Engram lookup and the stage-before-the-step
    disk method beside them; each plestore tier's host memory reported (pinned: both tables)."""
    tiers = (
        "device",
        "pinned",
        "mapped",
        "direct+eager",
        "vllm-engram-pinned-uva",
        "disk-prestage",
    )
    rows = _bench(capsys, engram_dir, tiers, ("mapped", "direct+eager", "disk-prestage"))
    files = [TableFile.open(p) for p in sorted(engram_dir.glob("engram.layers.*.json"))]
    pinned = next(r for r in rows if r["tier"] == "pinned")
    assert pinned["host_bytes"] >= sum(f.spec.rows * f.layout.row_bytes for f in files)
    assert all(r["host_bytes"] is None for r in rows if r["tier"] == "disk-prestage")


def test_an_engram_step_refuses_a_qwen_baseline(engram_dir, capsys):
    """A baseline of the other model is an error named in the result, not a silent skip."""
    argv = [str(engram_dir), "--steps", "1", "--batches", "1", "--tiers", "vllm-pinned-uva"]
    assert main([*argv, "--idle-s", "0", *SMALL, "--caches", "warm", "--csv", "", "--json"]) == 1
    errors = json.loads(capsys.readouterr().out)["errors"]
    assert [e["tier"] for e in errors] == ["vllm-pinned-uva"]


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("background", [False, True])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 5000])
def test_the_persistent_grid_gather_equals_index_select(n, background):
    """vLLM's Engram lookup's shape (a persistent grid over 16-row tiles, UVA from pinned
    memory) returns the rows a host index_select does, every tile edge included."""
    src = torch.randint(0, 256, (4099, 264), dtype=torch.uint8).pin_memory()
    ids = torch.randint(0, src.shape[0], (n,), dtype=torch.int64)
    got = persistent_grid_gather(src, ids.cuda(), background)
    assert torch.equal(got.cpu(), torch.index_select(src, 0, ids))
