"""Real vLLM engines run as subprocesses that end with their test (a test that leaves a
process of its engines behind fails)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ENGINE_TIMEOUT_S = 300


def _session_members(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:  # field 6 of stat: the session id
                pids.append(int(entry))
    return pids


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
        _left_behind(proc.pid)  # (members of the session outside its process group too)
        pytest.fail(f"the engines did not finish in {timeout} s:\n{out[-4000:]}")
    left = _left_behind(proc.pid)
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


def _left_behind(sid: int, grace_s: float = 10.0) -> list[int]:
    """Processes of the engine's session still alive after a grace period; ended (by id)."""
    deadline = time.time() + grace_s
    while (left := _session_members(sid)) and time.time() < deadline:
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left
