"""The package layout: every import points down the data flow, no module load has a cycle, no two
modules import each other, no private name crosses a module, no source file outgrows one idea
(~450 lines) nor a function 80 lines; TableOptions keeps to the user's choices (14 fields at
most), and each PLESTORE_* variable is read in one place."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = SRC / "plestore"

# The stages, bottom first: a module may import its own stage and the stages below it. A new
# top-level package or module goes here (a longer dotted prefix may give a module of a package
# its own stage).
STAGES: list[tuple[str, ...]] = [
    ("plestore.native",),  # compiled host code; imports nothing of plestore
    ("plestore.io",),  # host I/O and bounded file reading; imports nothing above it
    ("plestore.formats",),
    ("plestore.spec",),
    ("plestore.hashing",),
    ("plestore.checkpoint",),
    ("plestore.tablefile",),
    ("plestore.options",),
    ("plestore",),  # the package's public names (the lookup names lazily, see LAZY_UPWARD)
    ("plestore.tiers",),
    ("plestore.kernels",),
    ("plestore.lookup",),
    ("plestore.distributed",),
    ("plestore.layers",),
    ("plestore.models",),
    ("plestore.integrations.tables",),  # one packing path for every engine; imports none
    ("plestore.integrations.transformers.common",),  # what both model families share
    ("plestore.integrations.transformers.gemma", "plestore.integrations.transformers.qwen"),
    ("plestore.integrations",),
    ("plestore.bench",),
    ("plestore.cli", "plestore.__main__"),
]

# Upward imports allowed because they run inside a function, each with its reason.
LAZY_UPWARD: dict[tuple[str, str], str] = {
    ("plestore", "plestore.lookup"): "the lookup engine imports torch; tools that never look "
    "rows up (synth, pack, verify, inspect) must not load it",
}

# Modules that import an optional engine at module level: loaded only where it is installed (the
# vLLM and SGLang jobs of .ci/run import them).
ENGINE_MODULES: dict[str, str] = {
    "plestore.integrations.vllm.deepseek": "vllm",
    "plestore.integrations.vllm.engram": "vllm",
    "plestore.integrations.vllm.gemma": "vllm",
    "plestore.integrations.vllm.loading": "vllm",
    "plestore.integrations.vllm.qwen": "vllm",
    "plestore.integrations.sglang.embedding": "sglang",
}

# Source files allowed past MAX_LINES, each with its reason.
MAX_LINES = 450
LONG_FILES: dict[str, str] = {}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _stage(module: str) -> int:
    best, rank = -1, None
    for i, prefixes in enumerate(STAGES):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    top = ".".join(module.split(".")[:2])
    # "plestore" alone matches every module: a package not listed above must not fall to it
    if rank is None or (STAGES[rank] == ("plestore",) and module != "plestore"):
        raise AssertionError(
            f"{top} has no stage: add it to STAGES in tests/test_layout.py, above what it "
            "imports and below what imports it"
        )
    return rank


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(module: str, path: Path):
    """(imported module, line, inside a function) for every plestore import not under
    `if TYPE_CHECKING:`."""
    modules = _modules()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def resolve(name: str) -> str:
        while name not in modules:  # `from plestore.x import Name`: the module is plestore.x
            name = name.rpartition(".")[0]
        return name

    def walk(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    yield from walk(other, in_function)
                continue
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == "plestore":
                        yield resolve(alias.name), child.lineno, inner
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    name = ".".join(base + ([child.module] if child.module else []))
                else:
                    name = child.module or ""
                if name.split(".")[0] == "plestore":
                    for alias in child.names:
                        yield resolve(f"{name}.{alias.name}"), child.lineno, inner
            yield from walk(child, inner)

    yield from walk(ast.parse(path.read_text(), str(path)), False)


def test_every_module_has_a_stage():
    for module in _modules():
        _stage(module)


def test_unknown_package_is_named():
    try:
        _stage("plestore.newthing.x")
    except AssertionError as e:
        assert "plestore.newthing has no stage" in str(e) and "STAGES" in str(e)
    else:
        raise AssertionError("an unlisted package was given a stage")


def test_imports_point_down():
    wrong = []
    for module, path in _modules().items():
        for target, line, in_function in _imports(module, path):
            if _stage(target) <= _stage(module):
                continue
            if in_function and (module, target) in LAZY_UPWARD:
                continue
            where = "inside a function" if in_function else "at module level"
            wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target} {where}")
    assert not wrong, "imports pointing up the stages (see STAGES):\n" + "\n".join(wrong)


def test_lazy_upward_entries_are_used():
    used = {
        (module, target)
        for module, path in _modules().items()
        for target, _, in_function in _imports(module, path)
        if in_function
    }
    assert set(LAZY_UPWARD) <= used, set(LAZY_UPWARD) - used


def test_no_module_level_import_cycle():
    """Import every module in a fresh interpreter, in alphabetical order and in reverse: a cycle
    at module load fails one of the two orders."""
    names = sorted(
        m
        for m in _modules()
        if not m.endswith("__main__")  # __main__ runs the CLI
        and (m not in ENGINE_MODULES or importlib.util.find_spec(ENGINE_MODULES[m]))
    )
    for order in (names, names[::-1]):
        code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
        run = subprocess.run(
            [sys.executable, "-c", code, *order],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(SRC)},
            timeout=120,
        )
        assert run.returncode == 0, run.stderr[-3000:]


def test_no_source_file_too_long():
    long = []
    for path in sorted(SRC.rglob("*")):
        if not path.is_file() or path.suffix in (".pyc", ".so"):
            continue
        rel = str(path.relative_to(ROOT))
        lines = len(path.read_bytes().splitlines())
        if lines > MAX_LINES and rel not in LONG_FILES:
            long.append(f"{rel}: {lines} lines")
    assert not long, (
        f"files over {MAX_LINES} lines (split them, or list one in LONG_FILES with a reason):\n"
        + "\n".join(long)
    )


def test_measured_constants_name_an_existing_results_entry():
    """`measured: RESULTS.md "ENTRY"` in the source (and the probes' index) names a heading of
    benchmarks/RESULTS.md, so a renamed entry cannot leave a comment pointing nowhere."""
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    headings = set(re.findall(r"^#+ (.+)$", results, re.M))
    cited = {}
    files = [*SRC.rglob("*.py"), ROOT / "benchmarks" / "probes" / "README.md"]
    for path in files:
        text = " ".join(path.read_text().split())  # a citation may wrap across comment lines
        text = text.replace(" #: ", " ").replace(" # ", " ")
        for name in re.findall(r'RESULTS\.md "([^"]+)"', text):
            cited.setdefault(name, str(path.relative_to(ROOT)))
    assert cited, "no citations found: has the convention changed?"
    missing = {name: where for name, where in cited.items() if name not in headings}
    assert not missing, f"RESULTS.md has no heading for: {missing}"


def test_no_two_modules_import_each_other():
    """Not even inside a function (a lazy import hides a cycle, it does not remove it); only
    `if TYPE_CHECKING:` imports, which never run, may point back."""
    edges = {
        module: {target for target, _, _ in _imports(module, path) if target != module}
        for module, path in _modules().items()
    }
    pairs = sorted(
        f"{a} <-> {b}" for a, targets in edges.items() for b in targets if a < b and a in edges[b]
    )
    assert not pairs, "modules importing each other:\n" + "\n".join(pairs)


def test_no_private_name_is_imported_across_modules():
    """`from x import _name` only by x itself (plestore.native takes its compiled submodule
    `_core`): a name another module needs is not private."""
    modules = _modules()
    wrong = []
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            source = ".".join(base + [node.module or ""]) if node.level else node.module or ""
            for alias in node.names:
                name = alias.name
                if not name.startswith("_") or name.startswith("__"):
                    continue
                if source.split(".")[0] == "plestore" and source != module:
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} {source}.{name}")
    assert not wrong, "private names imported from other modules:\n" + "\n".join(wrong)


MAX_FUNCTION_LINES = 80


def test_no_function_too_long():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines}")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_table_options_hold_the_users_choices_in_at_most_14_fields():
    """TableOptions: what a user chooses (14 fields at most, `tuning` one of them); the knobs
    live in Tuning. Both take every name from PLESTORE_* (tests/test_options.py)."""
    from dataclasses import fields

    from plestore.options import TableOptions, Tuning

    own = [f.name for f in fields(TableOptions)]
    assert len(own) <= 14, own
    assert "tuning" in own and not set(own) & {f.name for f in fields(Tuning)}


def test_each_environment_variable_is_read_in_one_place():
    """A PLESTORE_* variable is read by one module; the options' own (PLESTORE_<FIELD>) only by
    options.py, and no product module reads a variable meant for tests."""
    from dataclasses import fields

    from plestore.options import TableOptions, Tuning

    option_vars = {f"PLESTORE_{f.name.upper()}" for c in (TableOptions, Tuning) for f in fields(c)}
    readers: dict[str, set[str]] = {}
    for module, path in _modules().items():
        for name in re.findall(
            r"""environ(?:\.get)?[\[(]\s*["'](PLESTORE_\w+)""", path.read_text()
        ):
            readers.setdefault(name, set()).add(module)
    twice = {name: sorted(m) for name, m in readers.items() if len(m) > 1}
    assert not twice, f"read in several modules: {twice}"
    stray = {name: sorted(m) for name, m in readers.items() if name in option_vars}
    assert not stray, f"options' variables read outside options.py: {stray}"
    hooks = [name for name in readers if "DELAY" in name or "TEST" in name]
    assert not hooks, f"test hooks in product code: {hooks}"
