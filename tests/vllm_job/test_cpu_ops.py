"""plestore's torch versions of vLLM's Triton-only Qwen4Exp ops (integrations/vllm/cpu_ops.py)
against vLLM's own kernels run by Triton's interpreter on the same inputs (triton_reference.py,
in a process of its own). float32: equal up to fp32 summation order; bf16: within 2 ulps (the
interpreter converts fp32 -> bf16 toward zero where a GPU rounds to nearest, and the ops round
at two boundaries)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM job's venv has vLLM (.ci/vllm); this one has not")
pytest.importorskip("triton", reason="vLLM's kernels need Triton's interpreter")

TOLERANCE = {"float32": 1e-6, "bfloat16": 2.0**-6}  # relative to max(|value|, 1)


def test_torch_ops_match_vllms_triton_kernels():
    script = Path(__file__).with_name("triton_reference.py")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    ops = {r["op"].split("[")[0] for r in rows}
    assert ops == {
        "grouped_gemma_rmsnorm",
        "hc_silu",
        "hc_gate_mix",
        "hc_combine",
        "hc_combine_norm",
        "ple_gate",
        "ple_conv",
    }
    bad = [r for r in rows if not r["max_rel"] <= TOLERANCE[r["dtype"]]]
    assert not bad, bad
    assert sum(r["values"] for r in rows) > 100_000
