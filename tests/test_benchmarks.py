"""The benchmarks run at tiny sizes in CI, so they never rot."""

from __future__ import annotations

import json
import os
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
        "--convert",
        "fp8_e4m3",
        "--rounds",
        "2",
        "--json",
    ]
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    assert out["scale"]["rows"] == 16896 and out["repack"]["reused"]
    conv = out["convert"]
    assert conv["format"] == "fp8_e4m3" and len(conv["seconds"]) == len(conv["plain_seconds"]) == 2
    lo, hi = conv["ratio_range"]
    assert 0 < lo <= conv["ratio_median"] <= hi
    assert out["pack"]["bytes_per_s"] > 0 and out["disk"]["write_bytes_per_s"] > 0
    assert 0 < out["pack"]["peak_rss_bytes"] < 1 << 30
    assert json.loads(results.read_text()) == out
    assert not (tmp_path / "w").exists()  # cleaned up without --keep


PROBES = sorted((ROOT / "benchmarks" / "probes").glob("*.py"))
MAX_PROBES = 7  # each backs a decision in force; plestore bench measures the rest


def test_every_probe_imports_and_shows_help():
    """Each probe's --help, all in one interpreter (each imports torch: one start-up for all)."""
    code = """
import contextlib, io, runpy, sys
sys.path.insert(0, sys.argv[1])
for path in sys.argv[2:]:
    sys.argv = [path, "--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            assert e.code in (0, None), (path, e.code)
        else:
            raise AssertionError(path + ": --help did not exit")
    assert out.getvalue().strip(), path + ": --help printed nothing"
print("ok")
"""
    probes_dir = ROOT / "benchmarks" / "probes"
    run = subprocess.run(
        [sys.executable, "-c", code, str(probes_dir), *map(str, PROBES)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stderr[-3000:]
    assert 1 <= len(PROBES) <= MAX_PROBES, "probes are the few behind live decisions"


def test_probes_are_indexed():
    index = (ROOT / "benchmarks" / "probes" / "README.md").read_text()
    assert all(f"`{p.name}`" in index for p in PROBES), "a probe missing from probes/README.md"


def test_results_hold_the_current_state_in_proportion():
    """RESULTS.md is today's numbers, a table per benchmark; history lives in bench.csv, the raw
    files and git (#36)."""
    lines = (ROOT / "benchmarks" / "RESULTS.md").read_text().splitlines()
    assert len(lines) <= 225, f"RESULTS.md has {len(lines)} lines (at most 225)"
    long = [i for i, line in enumerate(lines, 1) if len(line) > 300]
    assert not long, f"RESULTS.md lines over 300 characters: {long}"


def test_device_harness_lists_its_stages_and_refuses_unknown_ones(tmp_path):
    harness = ROOT / "benchmarks" / "device.sh"
    assert subprocess.run(["bash", "-n", str(harness)]).returncode == 0
    usage = subprocess.run(["bash", str(harness), "--help"], capture_output=True, text=True)
    assert usage.returncode == 0
    for stage in ("gpu-tests", "table", "demo", "e2e", "e2e-cold", "lookup", "probe-NAME"):
        assert stage in usage.stdout
    env = {**os.environ, "OUT": str(tmp_path)}
    bad = subprocess.run(
        ["bash", str(harness), "demo", "nonsense"], capture_output=True, text=True, env=env
    )
    assert bad.returncode == 2 and "unknown stage nonsense" in bad.stderr
    assert not list(tmp_path.iterdir())  # nothing ran
    missing = subprocess.run(
        ["bash", str(harness), "probe-nonsense"], capture_output=True, text=True, env=env
    )
    assert missing.returncode != 0 and "no benchmarks/probes/nonsense.py" in missing.stderr
