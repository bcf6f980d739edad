"""Real vLLM engines run as subprocesses that end with their test (a test that leaves a
process of its engines behind fails)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from process_sessions import end_session

HERE = Path(__file__).resolve().parent
ENGINE_TIMEOUT_S = 300


def run_engines(jobs: list[dict], timeout: float = ENGINE_TIMEOUT_S) -> list[tuple[dict, str]]:
    """(RESULT, the job's log) of each job, run one after another in one process (engine.py)
    of a session of its own, so every process an engine starts can be found and ended by that
    session's id."""
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "engine.py"), json.dumps(jobs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        end_session(proc.pid)  # (members of the session outside its process group too)
        pytest.fail(f"the engines did not finish in {timeout} s:\n{out[-4000:]}")
    left = end_session(proc.pid)
    assert not left, f"the engines left processes {left} behind:\n{out[-2000:]}"
    runs = []
    for i in range(len(jobs)):
        _, found, rest = out.partition(f"JOB {i}\n")
        assert found, f"job {i} never started (exit {proc.returncode}):\n{out[-4000:]}"
        log, found, rest = rest.partition("RESULT ")
        assert found, f"job {i} printed no result (exit {proc.returncode}):\n{log[-4000:]}"
        line, _, out = rest.partition("\n")
        runs.append((json.loads(line), log))
    return runs


def run_engine(job: dict, timeout: float = ENGINE_TIMEOUT_S) -> tuple[dict, str]:
    return run_engines([job], timeout)[0]
