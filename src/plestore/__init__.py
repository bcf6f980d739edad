"""plestore: serve giant embedding tables (Qwen4Exp PLE, DeepSeek Engram, Gemma PLE) off the GPU.

table = plestore.open_table("tables/", tier="auto")      # a packed table file
rows = table.lookup(row_ids)                              # bf16 [..., k * dim] on the GPU
pending = table.prefetch(row_ids); ...; pending.result()  # overlap with earlier layers
"""

from plestore.formats import FORMATS, RowFormat, get_format
from plestore.lookup import Pending, Table, open_table
from plestore.options import TableOptions
from plestore.spec import TableSpec

__version__ = "0.1.0"

__all__ = [
    "FORMATS",
    "Pending",
    "RowFormat",
    "Table",
    "TableOptions",
    "TableSpec",
    "__version__",
    "get_format",
    "open_table",
]
