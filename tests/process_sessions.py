"""The processes of a session (an engine started with `start_new_session=True`): found by the
session's id in /proc and ended by their ids — never by name. Shared by the engine jobs
(tests/vllm_job, tests/sglang_job)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def session_members(sid: int) -> list[int]:
    """The live processes of session `sid` (zombies, already ended, left out)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":  # stat field 6: the session id
                pids.append(int(entry))
    return pids


def end_session(sid: int, grace_s: float = 10.0) -> list[int]:
    """The session's processes still alive after grace_s, each then ended by its pid."""
    deadline = time.time() + grace_s
    while (left := session_members(sid)) and time.time() < deadline:
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left
