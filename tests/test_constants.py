"""The values C, Python and the Triton kernels share are defined once, in native/constants.h:
the compiled core exports what it was built from, Python reads the header, and no other source
in the tree defines one again."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from plestore import native
from plestore.native import constants

SRC = Path(__file__).resolve().parents[1] / "src" / "plestore"
HEADER = constants.HEADER.relative_to(SRC)

#: every name a shared value goes by: the header's (also with a leading underscore), its states'
#: and counters', the aliases Python gives the header's words, names older sources used
NAMES = set(constants.NUMBERS)
ALIASES = (
    {name.removeprefix("W_") for name in constants.NUMBERS if name.startswith("W_")}
    | {f"S_{s.upper()}" for s in constants.STATES}
    | {f"C_{name}" for name in vars(constants.C)}
    | {"_COLD_ROWS", "_COLD_POOL_ROWS", "_PROBE_ROWS", "GOLDEN", "MIX"}
)
#: names of states and counters: a literal table or unpacking mostly of these is a retyped one
LISTED = set(constants.STATES) | set(constants.COUNTERS) | set(vars(constants.C))


def _sources(*suffixes: str) -> list[Path]:
    return [
        p for p in sorted(SRC.rglob("*")) if p.suffix in suffixes and "integrations" not in p.parts
    ]


def _retyped(names: list[str]) -> bool:
    """Whether names are mostly a state or counter table's (three at least)."""
    shared = [n for n in names if n in LISTED]
    return len(shared) >= 3 and len(shared) >= 0.75 * len(names)


def _python_definitions(text: str) -> list[str]:
    """Assignments of a shared value's name to a literal, and literal tables of its lists."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            names = [t.id for t in flat if isinstance(t, ast.Name)]
            shared = {n for n in names if n in ALIASES or n.lstrip("_") in NAMES}
            literal = node.value is not None and any(
                isinstance(v, ast.Constant) and isinstance(v.value, int)
                for v in ast.walk(node.value)
            )
            if literal and shared:
                found.append(f"line {node.lineno}: {sorted(shared)} = a literal")
            if _retyped(names):
                found.append(f"line {node.lineno}: a state or counter table unpacked by hand")
        if isinstance(node, ast.Tuple | ast.List):
            words = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            if _retyped([w for w in words if isinstance(w, str)]):
                found.append(f"line {node.lineno}: a state or counter table typed out")
    return found


def _c_definitions(text: str) -> list[str]:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    found = []
    for name in NAMES | ALIASES:
        if re.search(rf"#define\s+{name}\s|\b{name}\s*=[^=]", text):
            found.append(name)
    if re.search(r"\bstatic_sets\s*\*\s*\d|\bset\s*\*\s*\d|\bw\s*<\s*\d", text):
        found.append("a static set's ways as a number")
    return found


def test_the_core_is_built_from_the_header():
    core = native.load("auto")
    if not native.available():
        pytest.skip("the native core is not built (the reference reads the header itself)")
    assert constants.built_from(core)
    assert core.ABI_VERSION == native.ABI_VERSION == constants.ABI_VERSION
    assert native.FEED_STATES == constants.STATES and native.FEED_COUNTERS == constants.COUNTERS


def test_the_header_parses_whole():
    text = constants.HEADER.read_text()
    numbers, states, counters = constants.parse(text)
    assert numbers == constants.NUMBERS and len(states) == len(constants.STATES)
    assert [c for c, _ in counters] == list(vars(constants.C))
    with pytest.raises(RuntimeError, match="SHARED_NUMBERS"):  # a value left off the list
        constants.parse(text + "\n#define EXTRA 3\n")


def test_no_second_definition_in_python():
    found = {
        str(p.relative_to(SRC)): d
        for p in _sources(".py")
        if (d := _python_definitions(p.read_text()))
    }
    assert not found, f"constants.h's values defined again (import them from it): {found}"


def test_no_second_definition_in_c():
    found = {
        str(p.relative_to(SRC)): d
        for p in _sources(".c", ".h")
        if p.relative_to(SRC) != HEADER and (d := _c_definitions(p.read_text()))
    }
    assert not found, f"constants.h's values defined again: {found}"


def test_kernels_take_header_words_by_name():
    for p in _sources(".py"):
        assert not re.search(r"header\s*\+\s*\d", p.read_text()), f"{p}: a header word's offset"


@pytest.mark.parametrize(
    ("source", "check"),
    [
        ("STATIC_WAYS = 16\n", _python_definitions),
        ("_PROBE_ROWS = 32\n", _python_definitions),
        ("POSTED, READY = 0, 8\n", _python_definitions),
        ('STATES = ("quiet", "stop", "posted")\n', _python_definitions),
        ("(STOP, STEPS, ROWS) = range(3)\n", _python_definitions),
        ("#define COLD_ROWS 64\n", _c_definitions),
        ("enum { W_READY = 8 };\n", _c_definitions),
        ("x = stags + set * 16;\n", _c_definitions),
    ],
)
def test_the_checks_catch_a_second_definition(source, check):
    assert check(source)
