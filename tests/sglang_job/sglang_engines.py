"""Real SGLang engines for the tests, each in a subprocess (sglang_engine.py) of a session of
its own: every process it starts is found by that session's id, and a test fails if one is
left behind (ended by its pid).

    run = run_engine(model_dir, env={"PLESTORE_SGLANG": json.dumps({"tier": "mapped"})})
    run.tokens   # [[ids]] per prompt (raises with the engine's log if it failed)
    run.log      # the engine's stdout + stderr (its processes' logs included)

Every engine runs with the CI shims (.ci/sglang-shim: on PYTHONPATH, spawned processes too),
TRITON_INTERPRET=1 (SGLang's Triton kernels on the CPU) and the GDN recurrence in torch
(gdn_torch.py, installed by the shim) — the same for stock and plestore engines.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from process_sessions import end_session
from sglang_models import NEW_TOKENS, PROMPTS

HERE = Path(__file__).resolve().parent
SHIM = HERE.parents[1] / ".ci" / "sglang-shim"
#: an engine's start (~12 s on 2 cores) + 4 prompts x 16 tokens (~8 s), with room for a
#: slow machine and a plugin that packs its tables at start
ENGINE_TIMEOUT_S = 300
#: every engine's environment, under the test's and the job's own
BASE_ENV = {
    "TRITON_INTERPRET": "1",
    "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",  # (no py-spy here: a crash would wait on it)
    "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
    # torch.compile (SGLang's hyper-connection mixes, MoE top-k, sampler) on a CPU is inductor
    # building C++ with g++: ~20 s an engine; eager runs the same ops (and the same tokens)
    "TORCHDYNAMO_DISABLE": "1",
}


@dataclass
class EngineRun:
    result: dict
    log: str
    seconds: float
    env: dict = field(default_factory=dict)

    @property
    def error(self) -> str | None:
        return self.result.get("error")

    @property
    def tokens(self) -> list[list[int]]:
        """The greedy tokens of each prompt; AssertionError with the log's tail if it failed."""
        assert self.error is None, f"engine failed: {self.error}\n{self.log[-6000:]}"
        return self.result["tokens"]


def engine_env(env: dict | None = None) -> dict:
    """The subprocess's environment: this one's, BASE_ENV, the shim and this directory first on
    PYTHONPATH, then `env` (a value None removes the variable)."""
    out = {**os.environ, **BASE_ENV}
    out["PYTHONPATH"] = os.pathsep.join(
        [str(SHIM), str(HERE)] + ([out["PYTHONPATH"]] if out.get("PYTHONPATH") else [])
    )
    for k, v in (env or {}).items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = str(v)
    return out


def start_engine(
    model: str | Path,
    *,
    env: dict | None = None,
    prompts: list[list[int]] = PROMPTS,
    max_new_tokens: int = NEW_TOKENS,
    engine_args: dict | None = None,
) -> subprocess.Popen:
    """sglang_engine.py on one job, in a new session (its pid is the session id); wait with
    finish_engine. `engine_args`: sglang.Engine keyword arguments over sglang_engine.ENGINE_ARGS
    (e.g. {"tp_size": 2}: ranks on gloo, each bound to one core)."""
    engine_args = engine_args or {}
    tp = engine_args.get("tp_size", 1)
    if tp > 1:  # one core per rank, round robin (SGLang asks one NUMA node a rank otherwise)
        cores = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
        env = {"SGLANG_CPU_OMP_THREADS_BIND": cores, **(env or {})}
    job = {
        "model": str(model),
        "prompts": prompts,
        "max_new_tokens": max_new_tokens,
        "engine_args": engine_args,
    }
    before = _shm_entries()  # (what the engine leaves there is removed at its end)
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "sglang_engine.py"), json.dumps(job)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=engine_env(env),
        cwd=HERE,
    )
    proc.shm_before = before
    return proc


def finish_engine(proc: subprocess.Popen, timeout: float = ENGINE_TIMEOUT_S) -> EngineRun:
    """The engine's RESULT and log. Raises AssertionError if it timed out, printed no result,
    or left a process of its session behind (all ended, by pid, first)."""
    t0 = time.time()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_session(proc.pid, grace_s=0)
        _remove_shm_leftovers(proc.shm_before)
        out, _ = proc.communicate()
        raise AssertionError(f"the engine did not finish in {timeout} s:\n{out[-6000:]}") from None
    left = end_session(proc.pid)
    _remove_shm_leftovers(proc.shm_before)
    assert not left, f"the engine left processes {left} behind:\n{out[-3000:]}"
    log, found, line = out.rpartition("RESULT ")
    assert found, f"the engine printed no result (exit {proc.returncode}):\n{out[-6000:]}"
    return EngineRun(json.loads(line.splitlines()[0]), log, time.time() - t0)


def run_engine(model: str | Path, timeout: float = ENGINE_TIMEOUT_S, **kw) -> EngineRun:
    """One engine, start to shutdown (start_engine's arguments)."""
    return finish_engine(start_engine(model, **kw), timeout)


def run_engines(jobs: list[dict], parallel: int = 1) -> list[EngineRun]:
    """Engines of `jobs` (each: run_engine's keyword arguments, "model" included), at most
    `parallel` at a time; runs in the jobs' order."""
    runs: list[EngineRun | None] = [None] * len(jobs)
    pending = list(enumerate(jobs))
    active: list[tuple[int, subprocess.Popen]] = []
    try:
        while pending or active:
            while pending and len(active) < parallel:
                i, job = pending.pop(0)
                active.append((i, start_engine(**job)))
            i, proc = active.pop(0)
            runs[i] = finish_engine(proc)
    finally:
        for _, proc in active:  # (a failure above: end the others too)
            end_session(proc.pid, grace_s=0)
            proc.communicate()
    return runs


#: what an SGLang engine leaves in /dev/shm when it ends (its message queues, ~25 MiB an engine,
#: and load records): removed once no live process maps or holds it open. (Names of other
#: software's files, multiprocessing's semaphores say, are left alone: a parallel process may
#: be between making one and opening it.)
SHM = Path("/dev/shm")
_SHM_LEFTOVER = re.compile(r"^(sgl_shm_mq_|sglang_loads_)")


def _shm_entries() -> set[str]:
    return {p.name for p in SHM.iterdir()} if SHM.is_dir() else set()


def _shm_in_use() -> set[str]:
    used = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            maps = Path(f"/proc/{entry}/maps").read_text()
            fds = [os.readlink(f"/proc/{entry}/fd/{fd}") for fd in os.listdir(f"/proc/{entry}/fd")]
        except OSError:
            continue
        for path in [line.rsplit(" ", 1)[-1] for line in maps.splitlines()] + fds:
            if path.startswith("/dev/shm/"):
                used.add(path.removeprefix("/dev/shm/"))
    return used


def _remove_shm_leftovers(before: set[str]) -> None:
    """Remove what engines made in /dev/shm since `before` that nothing uses any more."""
    new = {n for n in _shm_entries() - before if _SHM_LEFTOVER.match(n)}
    if not new:
        return
    for name in new - _shm_in_use():
        (SHM / name).unlink(missing_ok=True)
