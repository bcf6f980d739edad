"""The fuzzer, a test tool: seeded mutations of every untrusted input, each case timed.

    PYTHONPATH=src python3 tests/fuzz.py --cases 10000 --seed 7 --json

tests/test_fuzz.py runs it at a fixed small budget in CI; this command runs it at full size.

Each case builds one mutated input (a safetensors header, table metadata or its checksum
sidecar, a Hugging Face config, a token map, CLI arguments, lookup ids; see fuzz_targets and
fuzz_ids) and feeds it to the code that reads it. A case passes if it succeeds or raises the
clear error its target allows (the ValueError family, which names the field; IndexError for
out-of-range ids; a CLI exit status) within `slow_s`. Anything else is reported with its input:
an unclear exception (TypeError, KeyError, OverflowError, ...), a hang (interrupted after
`hang_s`), or a slow case. Deterministic for a seed: case i draws from its own generator seeded
(seed, i).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from fuzz_ids import LookupIdsTarget
from fuzz_targets import TARGETS

__all__ = ["FuzzReport", "all_targets", "main", "run_fuzz"]


@dataclass
class FuzzReport:
    seed: int
    cases: int
    seconds: float
    by_target: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)  # ok / clear / unclear / hang
    unclear: list[dict] = field(default_factory=list)  # first few failures with their input
    slow: list[dict] = field(default_factory=list)  # cases over slow_s
    max_case_s: float = 0.0
    p99_case_s: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.unclear and not self.slow

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


class _Hang(BaseException):
    """Raised by the alarm in a case that runs past hang_s (a BaseException: no target's
    `except Exception` may swallow it)."""


def _alarm(signum, frame):
    raise _Hang()


def run_fuzz(
    cases: int,
    seed: int,
    targets: list[str] | None = None,
    slow_s: float = 1.0,
    hang_s: float = 10.0,
    workdir: str | Path | None = None,
    keep: int = 20,
) -> FuzzReport:
    """Run `cases` mutations spread round-robin over `targets` (default: all)."""
    known = all_targets()
    names = targets or list(known)
    unknown = set(names) - set(known)
    if unknown:
        raise ValueError(f"unknown fuzz targets {sorted(unknown)}; targets: {', '.join(known)}")
    rep = FuzzReport(seed, cases, 0.0)
    times: list[float] = []
    outcomes: Counter = Counter()
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        made = {n: known[n](Path(tmp) / n) for n in names}
        use_alarm = hasattr(signal, "setitimer") and _main_thread()
        old = signal.signal(signal.SIGALRM, _alarm) if use_alarm else None
        t_all = time.perf_counter()
        try:
            for i in range(cases):
                name = names[i % len(names)]
                target = made[name]
                rng = np.random.default_rng([seed, i])
                t0 = time.perf_counter()
                if use_alarm:
                    signal.setitimer(signal.ITIMER_REAL, hang_s)
                try:
                    case = target.case(rng)
                    outcome, error = _run_case(target, case)
                except _Hang:
                    outcome, error, case = (
                        "hang",
                        f"no result after {hang_s} s",
                        locals().get("case"),
                    )
                finally:
                    if use_alarm:
                        signal.setitimer(signal.ITIMER_REAL, 0)
                dt = time.perf_counter() - t0
                times.append(dt)
                outcomes[outcome] += 1
                rep.by_target[name] = rep.by_target.get(name, 0) + 1
                info = {"case": i, "target": name, "seconds": round(dt, 4), "input": _show(case)}
                if outcome in ("unclear", "hang") and len(rep.unclear) < keep:
                    rep.unclear.append({**info, "outcome": outcome, "error": error})
                elif dt > slow_s and len(rep.slow) < keep:
                    rep.slow.append({**info, "outcome": outcome, "error": error})
        finally:
            if use_alarm:
                signal.signal(signal.SIGALRM, old)
            for t in made.values():
                t.close()
        rep.seconds = time.perf_counter() - t_all
    rep.outcomes = dict(outcomes)
    if times:
        rep.max_case_s = round(max(times), 4)
        rep.p99_case_s = round(float(np.percentile(times, 99)), 4)
    return rep


def _run_case(target, case) -> tuple[str, str]:
    try:
        target.run(case)
    except target.clear as e:
        if not str(e).strip():
            return "unclear", f"{type(e).__name__} with an empty message"
        return "clear", f"{type(e).__name__}: {e}"[:300]
    except _Hang:
        raise
    except BaseException as e:  # noqa: BLE001 - the point: anything else is a finding
        tb = traceback.extract_tb(e.__traceback__)[-1]
        where = f"{Path(tb.filename).name}:{tb.lineno}"
        return "unclear", f"{type(e).__name__}: {e} (at {where})"[:400]
    return "ok", ""


def _show(case: Any) -> str:
    s = getattr(case, "describe", None)
    text = s() if callable(s) else repr(case)
    return text if len(text) < 300 else text[:300] + "..."


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def all_targets() -> dict:
    """Target name -> class."""
    return {**TARGETS, "lookup-ids": LookupIdsTarget}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="tests/fuzz.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--cases", type=int, default=10000, help="mutations to run (default 10000)")
    p.add_argument("--seed", type=int, default=None, help="default: a fresh one, printed")
    p.add_argument("--targets", help=f"comma-separated (default all: {','.join(all_targets())})")
    p.add_argument("--slow-s", type=float, default=1.0, help="report cases slower than this")
    p.add_argument("--hang-s", type=float, default=10.0, help="interrupt a case after this")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    args = p.parse_args(argv)
    if args.cases < 1:
        p.error("--cases must be >= 1")
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    targets = args.targets.split(",") if args.targets else None
    try:
        rep = run_fuzz(args.cases, seed, targets, args.slow_s, args.hang_s)
    except ValueError as e:
        print(f"fuzz: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rep.to_dict(), indent=1))
    else:
        print(
            f"fuzz: {rep.cases} cases, seed {rep.seed}, {rep.seconds:.1f} s; outcomes "
            f"{rep.outcomes}; per case max {rep.max_case_s * 1e3:.1f} ms, p99 "
            f"{rep.p99_case_s * 1e3:.1f} ms"
        )
        for u in rep.unclear:
            print(f"  {u['outcome']} [{u['target']} #{u['case']}]: {u['error']}\n    {u['input']}")
        for s in rep.slow:
            print(f"  slow {s['seconds']:.2f} s [{s['target']} #{s['case']}]: {s['input']}")
        print("PASS" if rep.passed else "FAIL")
    return 0 if rep.passed else 1


if __name__ == "__main__":
    sys.exit(main())
