"""`plestore bench fuzz`: seeded mutations of every untrusted input, each case timed.

    plestore bench fuzz --cases 10000 --seed 7 --json

Each case builds one mutated input (a safetensors header, table metadata or its checksum
sidecar, a Hugging Face config, a token map, CLI arguments, lookup ids; see fuzz_targets) and
feeds it to the code that reads it. A case passes if it succeeds or raises the clear error its
target allows (the ValueError family, which names the field; IndexError for out-of-range ids;
a CLI exit status) within `slow_s`. Anything else is reported with its input: an unclear
exception (TypeError, KeyError, OverflowError, ...), a hang (interrupted after `hang_s`), or a
slow case. Deterministic for a seed: case i draws from its own generator seeded (seed, i).
"""

from __future__ import annotations

import argparse
import json
import math
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

__all__ = ["FuzzReport", "Mutator", "all_targets", "main", "run_fuzz"]

_HUGE = (2**31, 2**32 + 1, 2**40, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64, 10**30)
_STRINGS = ("", "a", "0", "-1", "1e9", "bf16", "\x00", "\u00e9\ud7ff", "../x", " " * 3)


class Mutator:
    """Random JSON-shaped edits: a value replaced by a neighbour or another type, keys dropped
    or added, lists emptied or grown to thousands of entries, strings of odd characters."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def pick(self, seq):
        return seq[int(self.rng.integers(len(seq)))]

    def value(self, old: Any = None) -> Any:
        """A replacement for `old`: usually a near miss of the same type, else anything."""
        r = self.rng.random()
        if isinstance(old, bool):
            pass
        elif isinstance(old, int) and r < 0.5:
            return self.pick(
                [old + 1, old - 1, -old, 0, -1, old * 2, old // 2, old * 1000, old + 2**32]
            )
        elif isinstance(old, float) and r < 0.5:
            return self.pick([0.0, -old, math.nan, math.inf, -math.inf, old * 1e300, 1e-320])
        elif isinstance(old, str) and r < 0.4:
            return self.pick([old[:-1], old.upper(), old + "x", old * 2, ""])
        elif isinstance(old, list) and r < 0.5:
            return self.list_edit(old)
        kind = int(self.rng.integers(8))
        if kind == 0:
            return int(self.rng.integers(-3, 5))
        if kind == 1:
            return self.pick(_HUGE) * self.pick([1, -1])
        if kind == 2:
            return self.pick([0.5, -1.5, math.nan, math.inf, 1e308, 3.0])
        if kind == 3:
            return self.pick([True, False, None])
        if kind == 4:
            return self.pick(_STRINGS)
        if kind == 5:
            return self.pick([[], [1], [0, -1], ["x"], [[1, 2]], [None], [1.5]])
        if kind == 6:
            return self.pick([{}, {"a": 1}, {"": None}])
        return self.list_edit(old if isinstance(old, list) else [1])

    def list_edit(self, old: list) -> list:
        kind = int(self.rng.integers(5))
        if kind == 0:
            return []
        if kind == 1:  # thousands of entries: loops and allocations that grow with a list
            n = int(self.pick([1000, 5000, 20000]))
            return list(range(1, n + 1)) if not old or isinstance(old[0], int) else (old * n)[:n]
        if kind == 2:
            return old + old
        if kind == 3 and old:
            out = list(old)
            out[int(self.rng.integers(len(out)))] = self.value()
            return out
        return old[:-1]

    def tree(self, doc: Any, edits: int = 1) -> tuple[Any, list[str]]:
        """`edits` random edits anywhere in a JSON document (a deep copy); the edited paths."""
        doc = json.loads(json.dumps(doc))
        where = []
        for _ in range(edits):
            paths = list(_paths(doc))
            if not paths:
                return self.value(doc), ["$"]
            path = self.pick(paths)
            parent = doc
            for k in path[:-1]:
                parent = parent[k]
            key = path[-1]
            op = self.rng.random()
            if isinstance(parent, dict) and op < 0.15:
                del parent[key]
            elif isinstance(parent, dict) and op < 0.22:
                parent[self.pick(["extra", "", key + "_"])] = self.value()
            elif op < 0.3:
                parent[key] = [parent[key]]  # a scalar wrapped in a list (list-valued dtype)
            else:
                parent[key] = self.value(parent[key])
            where.append("/".join(map(str, path)))
        return doc, where

    def bytes_edit(self, raw: bytes) -> bytes:
        """Flip, drop, truncate or splice bytes."""
        b = bytearray(raw)
        kind = int(self.rng.integers(4))
        if kind == 0 and b:
            for _ in range(int(self.rng.integers(1, 4))):
                b[int(self.rng.integers(len(b)))] ^= 1 << int(self.rng.integers(8))
        elif kind == 1:
            b = b[: int(self.rng.integers(len(b) + 1))]
        elif kind == 2 and b:
            i = int(self.rng.integers(len(b)))
            del b[i : i + int(self.rng.integers(1, 16))]
        else:
            i = int(self.rng.integers(len(b) + 1))
            b[i:i] = self.pick([b"\xff" * 4, b"{", b'"', b"[" * 5000, b"\x00" * 8])
        return bytes(b)


def _paths(doc: Any, prefix: tuple = ()):
    items = (
        doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    )
    for k, v in items:
        yield (*prefix, k)
        if isinstance(v, (dict, list)) and len(v) < 64:
            yield from _paths(v, (*prefix, k))


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
    TARGETS = all_targets()
    names = targets or list(TARGETS)
    unknown = set(names) - set(TARGETS)
    if unknown:
        raise ValueError(f"unknown fuzz targets {sorted(unknown)}; targets: {', '.join(TARGETS)}")
    rep = FuzzReport(seed, cases, 0.0)
    times: list[float] = []
    outcomes: Counter = Counter()
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        made = {n: TARGETS[n](Path(tmp) / n) for n in names}
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
    """Target name -> class (imported late: the targets import this module's Mutator)."""
    from plestore.bench.fuzz_ids import LookupIdsTarget
    from plestore.bench.fuzz_targets import TARGETS

    return {**TARGETS, "lookup-ids": LookupIdsTarget}


def main(argv: list[str] | None = None) -> int:
    TARGETS = all_targets()

    p = argparse.ArgumentParser(
        prog="plestore bench fuzz",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--cases", type=int, default=10000, help="mutations to run (default 10000)")
    p.add_argument("--seed", type=int, default=None, help="default: a fresh one, printed")
    p.add_argument("--targets", help=f"comma-separated (default all: {','.join(TARGETS)})")
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
        print(f"plestore bench fuzz: error: {e}", file=sys.stderr)
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
