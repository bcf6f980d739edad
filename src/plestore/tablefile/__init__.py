"""Table files: a checkpoint's embedding table packed once into a row-addressable file.

    checkpoint tensors -> pack (convert rows, lay them out, checksum) -> <table>.rows + .json
    <table>.json -> TableFile.open (validate in O(1)) -> tiers read rows; verify re-checks bytes

`format` is the file format, `file` its validation, `layout` where rows lie, `writer` the atomic
write, `pack` the streaming pack, `convert` its format conversion, `verify` the checks against the
file and its checkpoint.
"""

from plestore.tablefile.file import TableFile, VerifyReport, find_tables, no_tables_message
from plestore.tablefile.format import DATA_OFFSET, FORMAT_VERSION, TableFileError
from plestore.tablefile.layout import PreparedRows, crc32_combine, place_bytes
from plestore.tablefile.writer import TableWriter, remove_stale_temps, stale_temps

__all__ = [
    "DATA_OFFSET",
    "FORMAT_VERSION",
    "PreparedRows",
    "TableFile",
    "TableFileError",
    "TableWriter",
    "VerifyReport",
    "crc32_combine",
    "find_tables",
    "no_tables_message",
    "place_bytes",
    "remove_stale_temps",
    "stale_temps",
]
