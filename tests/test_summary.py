"""The test run's own summary: pytest's -ra (pyproject's addopts) prints one SKIPPED line per
reason, not one per test file and line (114 lines on a CPU run before)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HAS_CUDA

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(HAS_CUDA, reason="with a GPU these files skip nothing to fold")
def test_skips_fold_to_one_line_per_reason():
    files = ["tests/test_hashing_cuda.py", "tests/test_layers_ops.py"]  # CUDA skips, 6 lines
    r = subprocess.run(
        [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    lines = [line for line in r.stdout.splitlines() if line.startswith("SKIPPED")]
    assert r.returncode == 0 and len(lines) == 1, r.stdout
    assert re.match(r"SKIPPED \[\d+\] tests: needs a CUDA GPU", lines[0]), lines
