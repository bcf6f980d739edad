"""The hashing benchmark runs at CI size, so it never rots."""

from __future__ import annotations

from plestore.bench import hashing


def test_bench_hashing_runs_tiny(capsys):
    rows = hashing.main(["--tokens", "256", "--requests", "4", "--repeat", "2", "--no-record"])
    assert {(r["hash"], r["backend"]) for r in rows} >= {
        ("qwen4exp", "numpy"),
        ("engram", "torch-cpu"),
    }
    assert all(r["ms_p50"] > 0 for r in rows) and "Mtok/s" in capsys.readouterr().out
