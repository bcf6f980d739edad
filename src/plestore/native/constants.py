"""The values the host core, Python and the Triton kernels share, read from their one
definition, the C header `constants.h` (the compiled core is built from it and exports them as
`_core.CONSTANTS`; plestore.native refuses a core whose values differ from the header's). Read
from the header rather than the core so the numpy reference has them where the core is not
built. tests/test_constants.py fails on a second definition anywhere in the tree.

Names are the header's: `COLD_ROWS`, `W_READY`, ...; `STATES` and `COUNTERS` are its lists
(lower case, in order), `S` and `C` the same as indices (`S.BAD_ID`, `C.STEPS`)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

__all__ = [
    "ABI_VERSION", "C", "COLD_GRAIN", "COLD_ROWS", "COUNTERS", "HASH_GOLDEN", "HASH_MIX",
    "HASH_SKETCH_SEED", "HEADER", "HEADER_WORDS", "NUMBERS", "PROBE_ROWS", "S", "STATES",
    "STATIC_WAYS", "WARM_GRAIN", "WARM_READS", "W_ASLEEP", "W_FAILED", "W_KEY", "W_POSTED",
    "W_READY", "W_TIMED_OUT", "W_WAKE", "W_WOKEN", "built_from", "parse",
]  # fmt: skip

#: the one definition
HEADER = Path(__file__).with_name("constants.h")


def _list(text: str, macro: str) -> list[list[str]]:
    """The X(...) entries of a list macro `#define macro(X) X(a) X(b, c) ...`."""
    m = re.search(rf"#define {macro}\(X\)((?:[^\n]*\\\n)*[^\n]*)", text)
    if m is None:
        raise RuntimeError(f"{HEADER}: no list {macro}")
    return [[w.strip() for w in e.split(",")] for e in re.findall(r"X\(([^)]*)\)", m.group(1))]


def parse(text: str) -> tuple[dict[str, int], tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(numbers by name, states, counters as (C name, Python name)) of a constants.h text."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    found = re.findall(r"^#define (\w+) (0x[0-9A-Fa-f]+|\d+)(?:ULL)?\s*$", text, re.M)
    numbers = {name: int(value, 0) for name, value in found}
    listed = [e[0] for e in _list(text, "SHARED_NUMBERS")]
    if sorted(listed) != sorted(numbers):
        raise RuntimeError(f"{HEADER}: SHARED_NUMBERS does not list every #define")
    states = tuple(e[0] for e in _list(text, "SHARED_STATES"))
    counters = tuple((e[0], e[1]) for e in _list(text, "SHARED_COUNTERS"))
    return numbers, states, counters


NUMBERS, _STATES, _COUNTERS = parse(HEADER.read_text())
ABI_VERSION = NUMBERS["ABI_VERSION"]
STATIC_WAYS = NUMBERS["STATIC_WAYS"]
COLD_ROWS, COLD_GRAIN = NUMBERS["COLD_ROWS"], NUMBERS["COLD_GRAIN"]
WARM_GRAIN, WARM_READS = NUMBERS["WARM_GRAIN"], NUMBERS["WARM_READS"]
PROBE_ROWS = NUMBERS["PROBE_ROWS"]
W_POSTED, W_READY, W_FAILED = NUMBERS["W_POSTED"], NUMBERS["W_READY"], NUMBERS["W_FAILED"]
W_TIMED_OUT, W_KEY = NUMBERS["W_TIMED_OUT"], NUMBERS["W_KEY"]
W_WAKE, W_WOKEN, W_ASLEEP = NUMBERS["W_WAKE"], NUMBERS["W_WOKEN"], NUMBERS["W_ASLEEP"]
HEADER_WORDS = NUMBERS["HEADER_WORDS"]
HASH_GOLDEN, HASH_MIX = NUMBERS["HASH_GOLDEN"], NUMBERS["HASH_MIX"]
HASH_SKETCH_SEED = NUMBERS["HASH_SKETCH_SEED"]
#: what a host step and feed_serve return, by number (lower case)
STATES = tuple(s.lower() for s in _STATES)
#: feed_serve's counters, a word each, by their Python names
COUNTERS = tuple(py for _, py in _COUNTERS)
#: the states and the counters' words as indices: S.BAD_ID, C.STEPS
S = SimpleNamespace(**{s: i for i, s in enumerate(_STATES)})
C = SimpleNamespace(**{c: i for i, (c, _) in enumerate(_COUNTERS)})


def built_from(core: object) -> bool:
    """Whether a compiled core was built from this header: its exported values and lists."""
    return (
        getattr(core, "CONSTANTS", None) == NUMBERS
        and getattr(core, "STATES", None) == _STATES
        and getattr(core, "COUNTERS", None) == _COUNTERS
    )
