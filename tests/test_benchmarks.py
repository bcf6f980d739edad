"""The benchmarks run at tiny sizes in CI, so they never rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pack_full_runs_at_tiny_scale(tmp_path):
    results = tmp_path / "r.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "plestore.bench.pack",
        "--ngram-vocab-size-base",
        "1000",
        "--disk-test-gib",
        "0.0625",
        "--workdir",
        str(tmp_path / "w"),
        "--no-progress",
        "--results",
        str(results),
        "--json",
    ]
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    assert out["scale"]["rows"] == 16896 and out["repack"]["reused"]
    assert out["pack"]["bytes_per_s"] > 0 and out["disk"]["write_bytes_per_s"] > 0
    assert 0 < out["pack"]["peak_rss_bytes"] < 1 << 30
    assert json.loads(results.read_text()) == out
    assert not (tmp_path / "w").exists()  # cleaned up without --keep
