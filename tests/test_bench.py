"""`plestore bench` runs at a tiny size in CI, so it never rots: every method is exact, the
floors are measured, cold cases run in fresh processes, CSV and JSON come out."""

from __future__ import annotations

import csv
import json
import re
from functools import partial

import pytest

from plestore.cli import main
from plestore.cli.bench import OWN_PARSERS


@pytest.fixture(scope="module")
def table(small_checkpoint, tmp_path_factory):
    from plestore.tablefile.pack import pack_checkpoint

    out = tmp_path_factory.mktemp("bench-table")
    pack_checkpoint(small_checkpoint("qwen3.8-flash-next", "nvfp4"), out, block_bytes=512)
    return out


def test_bench_lookup_tiny(table, tmp_path, capsys):
    out_csv = tmp_path / "b.csv"
    rc = main(
        [
            "bench",
            "lookup",
            str(table),
            "--device",
            "cpu",
            "--json",
            "--reps",
            "2",
            "--workloads",
            "decode-b8,prefill-2048",
            "--cold",
            "decode-b8",
            "--csv",
            str(out_csv),
            "--plot",
            str(tmp_path / "p.png"),
        ]
    )
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    methods = {r["method"] for r in res["lookup"]}
    want = {"hbm-resident", "mmap-fault", "mmap-pool", "odirect-pool", "vllm-disk-offload"}
    assert want | {"plestore-direct"} <= methods
    assert all(r["exact"] for r in res["lookup"])
    cold = [r for r in res["lookup"] if r["cold_ms"] is not None]
    assert {r["method"] for r in cold} >= {"mmap-fault", "vllm-disk-offload", "plestore-direct"}
    assert all(r["workload"] == "decode-b8" and r["dist"] == "uniform" for r in cold)
    assert res["limits"]["disk_4096B_qd64_iops"] > 0
    with out_csv.open() as f:
        rows = list(csv.DictReader(f))
    assert rows and rows[0]["commit"] and rows[0]["date"]
    assert (tmp_path / "p.png").stat().st_size > 0


def test_bench_e2e_tiny(table, capsys, tmp_path):
    rc = main(
        [
            "bench",
            "e2e",
            str(table),
            "--e2e-plot",
            str(tmp_path / "e2e.png"),
            "--device",
            "cpu",
            "--json",
            "--csv",
            "",
            "--batches",
            "2",
            "--hidden-size",
            "64",
            "--layers",
            "2",
            "--prompt-tokens",
            "16",
            "--decode-steps",
            "3",
            "--tiers",
            "device,pinned,direct",
            "--e2e-reps",
            "2",
            "--prefill-chunk",
            "8",
        ]
    )
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)["e2e"]
    assert [(r["tier"], r["cache"], r["reps"]) for r in rows] == [
        ("device", "warm", 2),
        ("pinned", "warm", 2),
        ("direct", "warm", 2),
        ("direct", "cold", 2),
    ]
    assert (tmp_path / "e2e.png").stat().st_size > 0
    assert rows[0]["decode_ratio"] == 1.0  # the resident run against itself
    assert all(r["tokens_equal_resident"] for r in rows)
    assert all(r["decode_ratio"] > 0 and r["prefill_first_ms"] > 0 for r in rows)
    assert all(r["host_decode_ms"] > 0 and r["window_decode_ms"] == 0 for r in rows)  # no GPU
    warm, cold = rows[2], rows[3]
    assert warm["blocks_decode"] == 0 and warm["bound_decode_ratio"] is None  # all cached
    assert 0 < cold["blocks_decode"] <= 2 * 16 and 0 < cold["blocks_prefill"] <= 2 * 8 * 16
    for phase in ("decode", "prefill"):  # the disk's time for those blocks, and what it allows
        assert cold[f"disk_{phase}_ms"] > 0 and 0 < cold[f"bound_{phase}_ratio"] < 1
    step = rows[0]["decode_step_ms"]  # the resident's; on the CPU no window hides the reads
    assert cold["bound_decode_ratio"] == pytest.approx(step / (step + cold["disk_decode_ms"]))
    step, disk = rows[0]["prefill_step_ms"], cold["disk_prefill_ms"]  # 2 chunks, read in turn
    want = 2 * step / max(2 * step + disk, 2 * disk + step)
    assert cold["bound_prefill_ratio"] == pytest.approx(want)


def test_bench_footprint_tiny(table, capsys):
    """Disk bytes per decode token per tier (fresh processes, file evicted) and the mapped
    tier's resident set under a budget; with 512-B blocks, direct reads one block per row."""
    args = ["bench", "footprint", str(table), "--device", "cpu", "--json", "--steps", "3"]
    rc = main(
        [*args, "--batch", "2", "--rss-budget", "1M", "--rss-calls", "3", "--rss-rows", "512"]
    )
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    by_tier = {d["tier"]: d for d in res["disk"]}
    assert set(by_tier) == {"mapped", "direct"} and by_tier["direct"]["tokens"] == 6
    for d in by_tier.values():
        assert d["block_bytes"] == 512 and d["row_bytes_per_token"] == 16 * 90
        assert d["disk_bytes_per_token"] >= 0
    # direct reads at most one 512-B block per row, warm-up included (fewer on cache hits)
    assert 0 < by_tier["direct"]["tier_bytes_read"] <= (6 + 2) * 16 * 512
    rss = res["rss"]
    assert rss["budget_bytes"] == 1 << 20 and rss["calls"] == 3 and rss["samples"] > 0
    assert rss["rss_final_bytes"] <= rss["rss_peak_bytes"]


def test_benches_sharing_a_csv_keep_every_row_readable_by_name(tmp_path):
    """Lookup and e2e rows have different columns; the header grows to their union (earlier
    rows rewritten under it) instead of later rows landing under the wrong names."""
    from plestore.bench.report import append_csv

    path = tmp_path / "bench.csv"
    meta = {"date": "d", "bench": "lookup"}
    append_csv(path, [{"method": "m", "warm_ms": 1.5}], meta)
    append_csv(path, [{"method": "n", "warm_ms": 2.5}], meta)
    append_csv(path, [{"tier": "pinned", "decode_ratio": 0.99}], {**meta, "bench": "e2e"})
    append_csv(path, [{"method": "o", "warm_ms": 3.5}], meta)
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["bench"], r["method"], r["warm_ms"], r["tier"]) for r in rows] == [
        ("lookup", "m", "1.5", ""),
        ("lookup", "n", "2.5", ""),
        ("e2e", "", "", "pinned"),
        ("lookup", "o", "3.5", ""),
    ]
    assert rows[2]["decode_ratio"] == "0.99"


def test_machine_records_the_commit_of_the_plestore_source_not_the_cwd(tmp_path):
    """Run from another git checkout: the commit is the plestore tree's, not that checkout's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import plestore

    other = tmp_path / "other-checkout"
    other.mkdir()
    git = ["git", "-C", str(other), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (other / "f").write_text("x")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-qm", "other"], check=True)
    theirs = subprocess.run(
        [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    package = Path(plestore.__file__).resolve().parent
    ours = subprocess.run(
        ["git", "-C", str(package), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    env = {k: v for k, v in os.environ.items() if k != "PLESTORE_COMMIT"}
    env["PYTHONPATH"] = str(package.parent)
    code = "from plestore.bench.report import machine; print(machine()['commit'])"
    got = subprocess.run(
        [sys.executable, "-c", code], cwd=other, env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert got != theirs
    assert got == (ours or "unknown")


@pytest.mark.parametrize("name", list(OWN_PARSERS))
def test_own_parser_benches_name_their_command_in_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", name, "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: plestore bench {name} ")
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert re.search(rf"^    {name}\b", out, re.M)  # listed by `plestore bench --help`


def test_bench_shared_tiny(table, capsys, tmp_path, monkeypatch):
    """Two processes per mode: private copies count twice in PSS, the shared one once (one
    builder); the rows are the same either way."""
    monkeypatch.setenv("PLESTORE_SHM_DIR", str(tmp_path / "shm"))
    rc = main(
        ["bench", "shared", str(table), "--device", "cpu", "--json", "--procs", "2"]
        + ["--reps", "3", "--rounds", "1", "--batch", "4"]
    )
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["rows_exact"] and res["procs"] == 2
    assert res["private"]["copies"] > 1.9 and res["shared"]["copies"] <= 1.1
    assert res["shared"]["builders"] == [1] and res["private"]["builders"] == [0]
    assert res["private"]["lookup_p50_s"] > 0 and res["lookup_ratio"] > 0


def test_e2e_disk_bound_is_each_direct_rows_own_reads(table, monkeypatch):
    """A direct tier behind a GPU row cache reads only its misses: its bound is that of its own
    blocks, read as its table reads (none: 1.0; under one a step: that share of one block's
    time); mapped counts no blocks and takes the direct tier's behind the same cache."""
    import plestore
    from plestore.bench import e2e

    monkeypatch.setattr(e2e, "random_read_floor_s", lambda path, n, *a, **k: n * 1e-5)
    r = partial(e2e.E2EResult, batch=1, prefill_step_ms=4.0, decode_step_ms=2.0)
    cached, half = "direct:gpu_cache_bytes=1048576", "direct:gpu_cache_bytes=65536"
    rows = [
        r("device", cache="warm"),
        r("direct", cache="cold", blocks_decode=16, blocks_prefill=200),
        r(cached, cache="cold", blocks_decode=4, blocks_prefill=0),
        r(half, cache="cold", blocks_decode=0.5, blocks_prefill=1.4),
        r("mapped", cache="cold"),
        r("mapped:gpu_cache_bytes=1048576", cache="cold"),
    ]
    with plestore.open_table(table, tier="direct", device="cpu") as t:
        e2e._disk_bound(rows, {"direct": t, cached: t, half: t}, 2, lambda m: None)
    assert [x.disk_decode_ms for x in rows[1:]] == pytest.approx([0.16, 0.04, 0.005, 0.16, 0.04])
    assert [x.disk_prefill_ms for x in rows[1:]] == pytest.approx([2.0, 0.0, 0.01, 2.0, 0.0])
    assert rows[2].bound_prefill_ratio == 1.0 and rows[0].bound_decode_ratio is None
    assert rows[2].bound_decode_ratio == pytest.approx(2.0 / 2.04)


def test_e2e_cold_runs_drop_every_tables_caches_and_warm_runs_warm_again(table, monkeypatch):
    """A page another open table maps stays in the page cache through an eviction, so a cold run
    drops every table's caches; a warm run after a cold one runs once untimed first."""
    import torch

    import plestore
    from plestore.bench import e2e

    events = []
    drop, gen = plestore.Table.drop_caches, e2e.ReferenceDecoder.generate
    monkeypatch.setattr(
        plestore.Table, "drop_caches", lambda t: events.append(("drop", t.tier.name)) or drop(t)
    )
    monkeypatch.setattr(
        e2e.ReferenceDecoder,
        "generate",
        lambda m, *a, **k: events.append(("run", m.table.tier.name)) or gen(m, *a, **k),
    )
    kw = dict(hidden_size=64, num_layers=2, prompt_tokens=8, decode_steps=2, prefill_chunk=8)
    e2e.run_e2e(
        str(table), ["mapped", "direct"], [1], torch.device("cpu"), reps=2, log=lambda m: None, **kw
    )
    runs = [e[1] for e in events if e[0] == "run"]
    warm, cold = ["device", "mapped", "direct"], ["mapped", "direct"]
    again = ["device", "mapped", "mapped", "direct", "direct"]  # re-warmed, then timed
    assert runs == warm + warm + cold + again + cold  # warm-up, rep 1, rep 2
    drops = [e[1] for e in events if e[0] == "drop"]
    assert drops == ["device", "mapped", "direct"] * 4  # 4 cold runs, every table each time


@pytest.mark.parametrize("tier", ["direct", "direct:shard=rows"])
def test_e2e_every_run_finds_the_gpu_cache_as_a_restart_would(table, monkeypatch, tier):
    """Behind a GPU row cache every run, warm or cold, starts from the static set alone: the
    same prompts then hit the same rows in every run (kept, the dynamic rows admitted by the runs
    before would serve later runs whole). A sharded tier's cache is its rank's table's."""
    import socket

    import numpy as np
    import torch
    import torch.distributed as dist

    from plestore.bench import e2e
    from plestore.lookup import gpucache, metrics
    from plestore.tablefile import TableFile

    tf = TableFile.open(table)
    hot = np.arange(0, tf.spec.rows, 7)  # a static set: some hits in every run
    monkeypatch.setattr(gpucache, "load_profile", lambda file: hot)
    hits, record = {}, metrics.Metrics.record
    monkeypatch.setattr(
        metrics.Metrics,
        "record",
        lambda m, r: hits.setdefault(id(m), []).append(r.gpu_cache_hits) or record(m, r),
    )
    kw = dict(hidden_size=64, num_layers=2, prompt_tokens=16, decode_steps=4, prefill_chunk=8)
    if "shard" in tier:  # a one-rank group of this process
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        e2e.run_e2e(
            str(table), [tier], [2], torch.device("cpu"), reps=2, log=lambda m: None,
            gpu_caches=(1 << 20,), **kw,
        )  # fmt: skip
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    (cached,) = [h for h in hits.values() if any(h)]
    per_run = len(cached) // 6  # warm-up; rep 1 warm, cold; rep 2 re-warm, warm, cold
    runs = [cached[i : i + per_run] for i in range(0, len(cached), per_run)]
    assert len(runs) == 6 and all(r == runs[0] for r in runs)


def test_bench_hoststep_tiny(table, capsys):
    """The host step of every host tier beside the DRAM bound measured in the same run, on the
    CPU: each row of its JSON has the step's time, the bound and their ratio."""
    args = ["bench", "hoststep", str(table), "--json", "--rows", "16,64", "--steps", "3"]
    assert main([*args, "--sets", "2"]) == 0
    rows = json.loads(capsys.readouterr().out)["hoststep"]
    tiers = {"mapped", "direct", "pinned", "cascade", "mapped+gpu-cache"}
    assert {(r["tier"], r["rows"]) for r in rows} == {(t, n) for t in tiers for n in (16, 64)}
    for r in rows:
        assert r["steps"] == 3 and r["host_step_us"] > 0 and r["fed_step_us"] > 0
        assert r["bound_us"] == min(r["bound_one_thread_us"], r["bound_pool_us"]) > 0
        assert r["ratio"] == pytest.approx(r["host_step_us"] / r["bound_us"])


def test_bench_sglang_tiny(table, capsys):
    """SGLang's pinned and file backends beside plestore's tiers: every method exact, each
    step's time beside sglang-file's in the same run, cold cases in fresh processes, and each
    method's host memory after a decode run (plestore's mapped tier held to its budget)."""
    args = ["bench", "sglang", str(table), "--device", "cpu", "--json", "--reps", "2"]
    methods = "sglang-pinned-uva,sglang-file,plestore-mapped,plestore-direct"
    args += ["--methods", methods, "--workloads", "decode-b8,prefill-4096", "--cold", "decode-b8"]
    assert main([*args, "--long-steps", "6", "--budget", "64K"]) == 0
    res = json.loads(capsys.readouterr().out)
    steps = {(r["method"], r["workload"]): r for r in res["steps"]}
    assert {m for m, _ in steps} == set(methods.split(","))
    for (method, workload), r in steps.items():
        assert r["exact"] and r["warm_ms"] > 0, (method, workload)
        file = steps[("sglang-file", workload)]
        assert r["warm_vs_file"] == pytest.approx(r["warm_ms"] / file["warm_ms"])
        disk = method in ("sglang-file", "plestore-mapped", "plestore-direct")
        assert (r["cold_ms"] is not None) == (disk and workload == "decode-b8")
    resident = {r["method"]: r for r in res["resident"]}
    assert set(resident) == set(methods.split(","))
    pinned = resident["sglang-pinned-uva"]
    assert pinned["final_bytes"] == pinned["table_bytes"] and pinned["budget_bytes"] is None
    mapped = resident["plestore-mapped"]
    assert mapped["budget_bytes"] == 64 << 10 and mapped["steps"] == 6
    assert resident["sglang-file"]["peak_bytes"] > 0  # (its mapping faulted in)
