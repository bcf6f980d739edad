"""The vLLM job's fixtures: tiny checkpoints, and real engines run as subprocesses that end
with their test (a test that leaves a process of its engine behind fails)."""

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


def run_engine(job: dict, timeout: float = ENGINE_TIMEOUT_S) -> tuple[dict, str]:
    """(the engine's RESULT, its whole output). The engine runs in a session of its own, so
    every process it starts can be found and ended by that session's id."""
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "engine.py"), json.dumps(job)],
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
        pytest.fail(f"the engine did not finish in {timeout} s:\n{out[-4000:]}")
    left = _left_behind(proc.pid)
    assert not left, f"the engine left processes {left} behind:\n{out[-2000:]}"
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, f"the engine printed no result (exit {proc.returncode}):\n{out[-4000:]}"
    return json.loads(lines[-1][len("RESULT ") :]), out


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


def tokens_of(job: dict) -> list[list[int]]:
    result, out = run_engine(job)
    assert result["error"] is None, out[-6000:]
    return result["tokens"]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Directories of the tiny checkpoints, made once (lazily, per kind)."""
    from vllm_models import save_gemma, save_qwen

    made: dict[str, Path] = {}
    makers = {
        "qwen-bf16": lambda d: save_qwen(d),
        "qwen-fp8": lambda d: save_qwen(d, fp8=True),
        "gemma3n": save_gemma,
    }

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = makers[kind](tmp_path_factory.mktemp(kind))
        return made[kind]

    return get
