"""`plestore pack` whose table writer sleeps after every batch, so a test can kill a pack
mid-way or race another against it."""

from __future__ import annotations

import sys

_SCRIPT = """
import sys, time
from plestore.cli import main
from plestore.tablefile.writer import TableWriter

delay = float(sys.argv.pop(1))
write = TableWriter.write_prepared
TableWriter.write_prepared = lambda self, p: (write(self, p), time.sleep(delay))[0]
sys.exit(main(sys.argv[1:]))
"""


def slow_pack(checkpoint, out, delay_s: float, *args: str) -> list[str]:
    """The command line: one thread, the given extra pack arguments."""
    return [sys.executable, "-c", _SCRIPT, str(delay_s), "pack", str(checkpoint), str(out)] + [
        "--threads",
        "1",
        "--no-progress",
        *args,
    ]
