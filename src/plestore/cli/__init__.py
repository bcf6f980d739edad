"""The `plestore` command line. Each subcommand lives in its own module with a `register`."""

from __future__ import annotations

import argparse
import importlib
import sys

from plestore import __version__
from plestore.cli.bench import OWN_PARSERS

# Subcommand modules, in the order `plestore --help` lists them.
_COMMANDS = [
    "demo",
    "synth",
    "pack",
    "verify",
    "inspect",
    "rows",
    "bench",
    "hash",
    "formats",
    "config",
    "text",
    "profile",
    "shm",
]
#: command -> its module (filled as the parser is built; `inspect-config` lives in config)
_MODULES: dict[str, str] = {}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plestore",
        description="Serve giant embedding tables (Qwen4Exp PLE, DeepSeek Engram, Gemma PLE) "
        "from HBM, pinned DRAM, mmap or direct I/O.",
    )
    parser.add_argument("--version", action="version", version=f"plestore {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        importlib.import_module(f"plestore.cli.{name}").register(sub)
        for command in set(sub.choices) - set(_MODULES):
            _MODULES[command] = name
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _run(argv)
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's status for SIGINT
        name = argv[0] if argv and argv[0] in _MODULES else ""
        note = getattr(sys.modules.get(f"plestore.cli.{_MODULES.get(name)}"), "INTERRUPTED", "")
        who = f"plestore {name}".rstrip()
        print(f"{who}: interrupted" + (f"; {note}" if note else ""), file=sys.stderr)
        return 130


def _run(argv: list[str]) -> int:
    parser = build_parser()
    if argv[:1] == ["bench"] and argv[1:2] and argv[1] in OWN_PARSERS:
        bench = importlib.import_module(f"plestore.bench.{OWN_PARSERS[argv[1]]}")
        out = bench.main(argv[2:])  # these benchmarks have their own argument parsers
        return out if isinstance(out, int) else 0
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, IndexError, OSError) as e:  # bad input, ids, files: one line
        print(f"plestore {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
