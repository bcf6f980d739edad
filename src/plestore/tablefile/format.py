"""The table file's format: its version, header and data offset, the data file's name, and the
error every table-file check raises."""

from __future__ import annotations

import struct
from pathlib import Path

__all__ = [
    "DATA_OFFSET",
    "DEFAULT_CHUNK_BYTES",
    "FORMAT_VERSION",
    "HEADER",
    "MAGIC",
    "MAX_DATA_BYTES",
    "READABLE_VERSIONS",
    "TableFileError",
    "data_name",
]

FORMAT_VERSION = 2  # 2: + the per-block checksum sidecar
READABLE_VERSIONS = (1, 2)
MAGIC = b"PLESTORE-TABLE\0\0"  # 16 bytes
DATA_OFFSET = 4096  # the header's size: keeps the data region block-aligned for O_DIRECT
DEFAULT_CHUNK_BYTES = 64 << 20
MAX_DATA_BYTES = 1 << 50  # 1 PiB: any size field beyond is corrupt, not a table
HEADER = struct.Struct("<16sI16sQ")  # magic, version, data id, data bytes


class TableFileError(ValueError):
    """A table file is missing, corrupt, incomplete or does not match what was expected."""


def data_name(meta_path: Path) -> str:
    return meta_path.name[: -len(".json")] + ".rows"
