"""The hashing benchmark runs at CI size, so it never rots."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_hashing.py"


def test_bench_hashing_runs_tiny(capsys):
    spec = importlib.util.spec_from_file_location("bench_hashing", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.main(["--tokens", "256", "--requests", "4", "--repeat", "2", "--no-record"])
    assert {(r["hash"], r["backend"]) for r in rows} >= {
        ("qwen4exp", "numpy"),
        ("engram", "torch-cpu"),
    }
    assert all(r["ms_p50"] > 0 for r in rows) and "Mtok/s" in capsys.readouterr().out
