"""`TableSpec` (rows, dim, format, scale, shards, hash) and `RowLayout` (where each row sits in
a table file): frozen dataclasses validated at construction that round-trip through JSON."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from plestore.formats import get_format
from plestore.spec.hashspec import (
    HashSpec,
    check_positive,
    from_fields,
    hash_from_dict,
    hash_to_dict,
)
from plestore.spec.hf import table_fields_from_hf_config

__all__ = ["RowLayout", "ShardLayout", "TableSpec"]


@dataclass(frozen=True)
class ShardLayout:
    """How a checkpoint splits the table's rows: shard i holds rows
    [i*rows_per_shard, i*rows_per_shard + rows_i), the last shards possibly shorter or empty."""

    rows_per_shard: int
    num_shards: int

    def __post_init__(self) -> None:
        check_positive(self, "rows_per_shard", "num_shards")

    def shard_rows(self, i: int, total_rows: int) -> tuple[int, int]:
        """(first global row, row count) of shard i."""
        start = i * self.rows_per_shard
        return start, max(0, min(self.rows_per_shard, total_rows - start))


@dataclass(frozen=True)
class TableSpec:
    """One embedding table: `rows` x `dim` values in `format`, looked up `heads` rows per token.

    `scale` is the per-table scale (fp8 weight_scale, nvfp4 weight_scale_2; 1.0 otherwise).
    `tensor` names the table in its checkpoint (the shard prefix for sharded tables).
    """

    name: str
    rows: int
    dim: int
    format: str
    scale: float = 1.0
    heads: int = 1
    shards: ShardLayout | None = None
    hash: HashSpec | None = None
    tensor: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TableSpec.name must not be empty (a string), got {self.name!r}")
        if not isinstance(self.tensor, str):
            raise ValueError(f"TableSpec.tensor must be a string, got {self.tensor!r}")
        check_positive(self, "rows", "dim", "heads")
        if not isinstance(self.format, str) and not hasattr(self.format, "row_bytes"):
            raise ValueError(f"TableSpec.format must be a format name, got {self.format!r}")
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)):
            raise ValueError(f"TableSpec.scale must be a number, got {self.scale!r}")
        if self.shards is not None and not isinstance(self.shards, ShardLayout):
            raise ValueError(f"TableSpec.shards must be a ShardLayout, got {self.shards!r}")
        fmt = get_format(self.format)
        object.__setattr__(self, "format", fmt.name)
        fmt.check_dim(self.dim)
        scale = float(self.scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"TableSpec.scale must be finite and > 0, got {self.scale!r}")
        if not fmt.has_table_scale and scale != 1.0:
            raise ValueError(f"format {fmt.name} has no per-table scale, got scale={scale}")
        object.__setattr__(self, "scale", scale)
        if self.hash is not None:
            if self.hash.num_rows != self.rows:
                raise ValueError(
                    f"table {self.name}: hash addresses {self.hash.num_rows} rows, spec has "
                    f"{self.rows}"
                )
            if self.hash.heads != self.heads:
                raise ValueError(
                    f"table {self.name}: hash gives {self.hash.heads} ids per token, spec has "
                    f"heads={self.heads}"
                )
        sh = self.shards
        if sh is not None and sh.rows_per_shard * sh.num_shards < self.rows:
            raise ValueError(
                f"table {self.name}: {self.shards.num_shards} shards of "
                f"{self.shards.rows_per_shard} rows cannot hold {self.rows} rows"
            )

    @property
    def row_bytes(self) -> int:
        return get_format(self.format).row_bytes(self.dim)

    @property
    def nbytes(self) -> int:
        """Packed bytes of all rows (no block padding)."""
        return self.rows * self.row_bytes

    def replace(self, **changes: Any) -> TableSpec:
        return dataclasses.replace(self, **changes)

    # -- JSON --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "rows": self.rows,
            "dim": self.dim,
            "format": self.format,
            "scale": self.scale,
            "heads": self.heads,
            "shards": dataclasses.asdict(self.shards) if self.shards else None,
            "hash": hash_to_dict(self.hash) if self.hash else None,
            "tensor": self.tensor,
        }

    @classmethod
    def from_dict(cls, d: dict) -> TableSpec:
        if not isinstance(d, dict):
            raise ValueError(f"a TableSpec is a JSON object, got {type(d).__name__}")
        d = dict(d)
        if d.get("shards") is not None:
            d["shards"] = from_fields(ShardLayout, d["shards"])
        if d.get("hash") is not None:
            d["hash"] = hash_from_dict(d["hash"])
        return from_fields(cls, d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> TableSpec:
        from plestore.io.jsonfile import parse_json

        return cls.from_dict(parse_json(text, "TableSpec JSON"))

    @classmethod
    def from_hf_config(
        cls, config: str | Path | dict, table: str | None = None, format: str | None = None
    ) -> TableSpec:
        """The table of a Hugging Face config; `table` (a name) picks one when it has several."""
        specs = table_specs_from_hf_config(config, format=format)
        if table is None and len(specs) == 1:
            return specs[0]
        for s in specs:
            if s.name == table:
                return s
        names = ", ".join(s.name for s in specs)
        raise ValueError(f"config has tables [{names}]; pass table= one of them (got {table!r})")


def table_specs_from_hf_config(
    config: str | Path | dict, format: str | None = None
) -> list[TableSpec]:
    """Every offloadable table a Hugging Face config describes (Qwen4Exp PLE layers, Engram
    layers, or the Gemma 3n/4 per-layer embedding). `format` overrides the stored format."""
    specs = []
    for f in table_fields_from_hf_config(config, format):
        shards = f.pop("shards", None)
        specs.append(TableSpec(**f, shards=None if shards is None else ShardLayout(*shards)))
    return specs


@dataclass(frozen=True)
class RowLayout:
    """Where rows sit in a table file's data region.

    Rows are `row_stride` bytes apart and never straddle a `block_bytes` block (4096 matches a
    page, 512 a sector; 0 packs rows back to back), so a cold row costs exactly one block read.
    A row larger than a block starts on a block boundary and spans the fewest whole blocks.
    """

    row_bytes: int
    row_stride: int = 0  # 0: = row_bytes
    block_bytes: int = 4096

    VALID_BLOCKS: ClassVar[tuple[int, ...]] = (0, 512, 4096)

    def __post_init__(self) -> None:
        check_positive(self, "row_bytes")
        check_positive(self, "row_stride", allow_zero=("row_stride",))
        if type(self.block_bytes) is not int:
            raise ValueError(f"RowLayout.block_bytes must be an int, got {self.block_bytes!r}")
        if self.row_stride == 0:
            object.__setattr__(self, "row_stride", self.row_bytes)
        if self.row_stride < self.row_bytes:
            raise ValueError(f"row_stride {self.row_stride} < row_bytes {self.row_bytes}")
        if self.block_bytes not in self.VALID_BLOCKS:
            raise ValueError(
                f"block_bytes must be one of {self.VALID_BLOCKS}, got {self.block_bytes}"
            )

    @property
    def rows_per_block(self) -> int:
        """Rows per block (0 when unblocked or when a row spans several blocks)."""
        if self.block_bytes == 0 or self.row_stride > self.block_bytes:
            return 0
        return self.block_bytes // self.row_stride

    @property
    def row_span(self) -> int:
        """Bytes one row occupies when rows do not share blocks (row_stride > block_bytes)."""
        return -(-self.row_stride // self.block_bytes) * self.block_bytes

    def offsets(self, rows: np.ndarray) -> np.ndarray:
        """int64 byte offset of each row within the data region. The one row -> offset rule."""
        rows = np.asarray(rows, dtype=np.int64)
        if self.block_bytes == 0:
            return rows * self.row_stride
        rpb = self.rows_per_block
        if rpb == 0:
            return rows * self.row_span
        return (rows // rpb) * self.block_bytes + (rows % rpb) * self.row_stride

    def data_bytes(self, num_rows: int) -> int:
        """Size of the data region holding num_rows rows (whole blocks when blocked)."""
        if num_rows == 0:
            return 0
        if self.block_bytes == 0:
            return num_rows * self.row_stride
        rpb = self.rows_per_block
        if rpb == 0:
            return num_rows * self.row_span
        return -(-num_rows // rpb) * self.block_bytes

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RowLayout:
        return from_fields(cls, d)
