"""What a fuzz case is: the Mutator that draws one from a seeded generator, the Case it makes,
and the Target a mutated input is fed to (tests/fuzz.py runs them; tests/fuzz_targets.py and
tests/fuzz_ids.py hold one Target per untrusted input)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Case", "Mutator", "Target"]

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
class Case:
    kind: str
    data: Any
    where: Any = None

    def describe(self) -> str:
        d = self.data
        if isinstance(d, bytes):
            d = d[:160]
        elif isinstance(d, (dict, list)):
            d = json.dumps(d, default=str)[:240]
        return f"{self.kind} {self.where or ''}: {d!r}"


class Target:
    """One untrusted input: builds its valid inputs once (`__init__`, in a scratch directory),
    draws one mutated case from a generator (`case(rng)`) and feeds it to the code that reads
    it (`run(case)`); `clear` is the exception family that counts as a clear refusal."""

    clear: tuple[type[BaseException], ...] = (ValueError,)

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def close(self) -> None:
        pass
