"""plestore: serve giant embedding tables (Qwen4Exp PLE, DeepSeek Engram, Gemma PLE) off the GPU.

table = plestore.open_table("tables/", tier="auto")      # a packed table file
rows = table.lookup(row_ids)                              # bf16 [..., k * dim] on the GPU
pending = table.prefetch(row_ids); ...; pending.result()  # overlap with earlier layers
with plestore.defaults.set(threads=8): ...                # defaults for a block (or set())
"""

from typing import TYPE_CHECKING

from plestore.formats import FORMATS, RowFormat, get_format
from plestore.options import TableOptions, defaults
from plestore.spec import TableSpec

if TYPE_CHECKING:
    from plestore.lookup import Pending, Table, open_table

__version__ = "0.1.0"

__all__ = [
    "FORMATS",
    "Pending",
    "RowFormat",
    "Table",
    "TableOptions",
    "TableSpec",
    "__version__",
    "defaults",
    "get_format",
    "open_table",
]


def __getattr__(name: str):
    # The lookup engine imports torch (~200 MB resident); the tools that never look rows up
    # (synth, pack, verify, inspect) stay light by importing it only when it is asked for.
    if name in ("Pending", "Table", "open_table"):
        from plestore import lookup

        return getattr(lookup, name)
    raise AttributeError(f"module 'plestore' has no attribute {name!r}")
