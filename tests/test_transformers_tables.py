"""One table set per model directory for every engine: tables packed by `plestore pack` (a real
subprocess) are reused by transformers load() as they are (nothing written) and generate the
stock tokens, bf16 and FP8 alike; another checkpoint's tables (or this one's before its files
changed) are refused naming both fingerprints; a reader serving a table keeps its exact rows
while another process packs into the same directory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen4_exp", reason="Qwen4Exp needs transformers >= 5.17")

from qwen4exp_models import build, prompts, run, tiny_config, write_fp8_checkpoint  # noqa: E402

import plestore  # noqa: E402
from plestore.integrations.tables import (  # noqa: E402
    TableMismatchError,
    ple_table_name,
    prepare_table,
)
from plestore.integrations.transformers import (  # noqa: E402
    NGramEmbedding,
    load,
    offload_per_layer_embeddings,
)
from plestore.tablefile import TableFile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
FP8_SCALE = 2.0**-4  # write_fp8_checkpoint's weight_scale


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _checkpoint(out: Path, kind: str, seed: int = 0) -> Path:
    model = build(tiny_config([1, 2], 3), seed=seed)
    if kind == "fp8":
        return write_fp8_checkpoint(model, out)
    model.to(torch.bfloat16).save_pretrained(out)
    return out


def _files(d: Path, lock: bool = True) -> dict:
    """Every file of a table directory (without `lock`: but the pack lock, which a pack takes):
    (inode, size, mtime) — what a write would change."""
    return {
        p.name: (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns)
        for p in d.iterdir()
        if lock or not p.name.startswith(".")
    }


def _cli_pack(ck: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "plestore", "pack", str(ck), str(out), "--no-progress", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)


def _close(model) -> None:
    for m in model.modules():
        if isinstance(m, NGramEmbedding):
            m.close()


@pytest.mark.parametrize("kind,block", [("bf16", "512"), ("fp8", "4096")])
def test_tables_packed_by_the_cli_are_reused_by_load_as_they_are(kind, block, tmp_path):
    ck = _checkpoint(tmp_path / "ck", kind)
    stock = transformers.Qwen4ExpForCausalLM.from_pretrained(ck, dtype=torch.bfloat16).eval()
    want = run(stock)
    packed = _cli_pack(ck, ck / "plestore", "--block-bytes", block)
    assert packed.returncode == 0, packed.stderr
    before = _files(ck / "plestore")
    model, report = load(ck, tier="mapped", dtype=torch.bfloat16)  # default table_dir
    assert report.reused and all(p["reused"] for p in report.layers)
    assert _files(ck / "plestore") == before  # nothing written, not even a lock file
    got = run(model.eval())
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
    for layer in (0, 1):  # vLLM's call (the e4m3 bytes in their own format) reuses them too
        fmt = "fp8_e4m3" if kind == "fp8" else "bf16"
        meta, reused = prepare_table(ck, ck / "plestore", ple_table_name(layer), fmt)
        assert reused and meta == ck / "plestore" / f"ple.layers.{layer}.json"
        if kind == "fp8":  # one convention: the file keeps the checkpoint's scale ...
            assert TableFile.open(meta).spec.scale == FP8_SCALE
            served = model.model.layers[layer].ple.ple_embedding.table
            assert served.spec.scale == 1.0  # ... transformers decodes it at 1.0, as it computes
    assert _files(ck / "plestore") == before
    _close(model)


def test_a_model_dtype_needing_another_format_gets_its_own_table_beside(tmp_path):
    ck = _checkpoint(tmp_path / "ck", "bf16")
    packed = _cli_pack(ck, ck / "plestore")
    assert packed.returncode == 0, packed.stderr
    before = _files(ck / "plestore", lock=False)
    model, report = load(ck, tier="mapped", format="fp32", dtype=torch.float32)
    assert not report.reused and report.format == "fp32"
    after = _files(ck / "plestore")
    assert {k: after[k] for k in before} == before  # the bf16 tables untouched
    assert {"ple.layers.0.fp32.json", "ple.layers.1.fp32.json"} <= set(after)
    _close(model)
    again, report = load(ck, tier="mapped", format="fp32", dtype=torch.float32)
    assert report.reused and _files(ck / "plestore") == after
    _close(again)


def test_another_checkpoints_tables_are_refused_naming_both_fingerprints(tmp_path):
    mine, theirs = _checkpoint(tmp_path / "a", "bf16"), _checkpoint(tmp_path / "b", "bf16", 1)
    tables = tmp_path / "tables"
    assert _cli_pack(theirs, tables).returncode == 0
    before = _files(tables)
    fp_theirs = TableFile.open(tables / "ple.layers.0.json").source["fingerprint"]
    with pytest.raises(TableMismatchError) as e:
        load(mine, tier="mapped", table_dir=tables, dtype=torch.bfloat16)
    assert fp_theirs in str(e.value) and "another checkpoint" in str(e.value)
    from plestore.checkpoint import Checkpoint, detect_tables

    with Checkpoint.open(mine) as ck:
        fp_mine = detect_tables(ck)[0].fingerprint
    assert fp_mine in str(e.value) and fp_mine != fp_theirs
    assert _files(tables) == before
    # the same checkpoint changed in place (its file rewritten): refused too, never replaced
    shard = next(theirs.glob("*.safetensors"))
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    with pytest.raises(TableMismatchError, match="before its files changed"):
        load(theirs, tier="mapped", table_dir=tables, dtype=torch.bfloat16)
    assert _files(tables) == before


PACKER = """
import sys
from plestore.integrations.tables import TableMismatchError, prepare_table
mine, other, tables, name = sys.argv[1:5]
for _ in range(3):
    meta, reused = prepare_table(mine, tables, name)  # the same checkpoint: reused as it is
    assert reused, meta
    prepare_table(mine, tables, name, "fp32")  # another format: a table beside
    try:
        prepare_table(other, tables, name)
    except TableMismatchError:
        pass
    else:
        raise SystemExit("another checkpoint's table was not refused")
print("packer done")
"""


@pytest.mark.parametrize("tier", ["mapped", "direct"])
def test_a_reader_keeps_exact_rows_while_another_process_packs_the_directory(tier, tmp_path):
    mine, other = _checkpoint(tmp_path / "a", "bf16"), _checkpoint(tmp_path / "b", "bf16", 1)
    tables = tmp_path / "tables"
    name = ple_table_name(1)
    meta, _ = prepare_table(mine, tables, name)
    before = _files(tables, lock=False)
    reference = plestore.open_table(meta, tier="device", device="cpu")  # a resident gather
    reader = plestore.open_table(meta, tier=tier, device="cpu")
    rng = np.random.default_rng(0)
    cmd = [sys.executable, "-c", textwrap.dedent(PACKER), str(mine), str(other), str(tables)]
    packer = subprocess.Popen(
        [*cmd, name], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lookups = 0
    try:
        while packer.poll() is None or lookups < 20:
            ids = torch.from_numpy(rng.integers(0, reader.spec.rows, (64, 4)))
            assert torch.equal(reader.lookup(ids), reference.lookup(ids))
            lookups += 1
    finally:
        out, err = packer.communicate(timeout=300)
        reader.close()
        reference.close()
    assert packer.returncode == 0 and "packer done" in out, err
    after = _files(tables)
    assert {k: after[k] for k in before} == before  # nothing replaced under the reader
    assert f"{name}.fp32.json" in after


def test_plestore_stats_has_every_served_tables_counters(tmp_path):
    """model.plestore_stats(): every served table's stats(), keyed by its name, after load()
    and after offload_per_layer_embeddings()."""
    ck = _checkpoint(tmp_path / "ck", "bf16")
    loaded, _ = load(ck, tier="mapped", dtype=torch.bfloat16)
    offloaded = build(tiny_config([1, 2], 3))
    offload_per_layer_embeddings(offloaded, tmp_path / "o", tier="mapped")
    ids, mask = prompts()
    for model, names in ((loaded, ["ple.layers.0", "ple.layers.1"]), (offloaded, None)):
        names = names or ["ple.layers.0.fp32", "ple.layers.1.fp32"]
        assert sorted(model.plestore_stats()) == names
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        stats = model.plestore_stats()
        for name in names:
            rows = sum(p["rows"] for p in stats[name]["phases"].values())
            assert rows == ids.numel() * 4 and stats[name]["tier"] == "mapped"  # 4 heads a token
        _close(model)
