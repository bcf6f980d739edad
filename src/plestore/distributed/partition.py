"""Which rows and which head columns each rank of a group serves: computed here, once.

`rows` (vocab-parallel; Qwen PLE, Gemma): rank r of `world` serves the global rows
`[min(r * per, rows), min((r + 1) * per, rows))` with `per = ceil(padded / world)`,
`padded = rows` rounded up to `pad_to`. This is vLLM's vocab-parallel partition
(`vocab_range_from_global_vocab_size`, which the Qwen4Exp/Engram "ETP" tables use over their
already padded row count, `padded_total / tp` rows a rank) wherever vLLM defines one, i.e. when
`world` divides the row count; there vLLM asserts, and ceil keeps every rank's range contiguous
with the last ones shorter (or empty). `pad_to=64` gives vLLM's `VocabParallelEmbedding`
(DEFAULT_VOCAB_PADDING_SIZE, no LoRA rows): the vocab padded to 64 first, split, clipped.

`heads` (DeepSeek Engram; Qwen PLE where an engine shards heads): rank r serves the
`part = ceil(heads / world)` consecutive hash columns `[r * part, (r + 1) * part)` (clipped),
and the rows those heads address, `[head_offsets[first], head_offsets[end])` (the last rank's
range ends at the table's end, padding rows included), as vLLM's DeepSeek-V4.1 Engram does.
"""

from __future__ import annotations

from dataclasses import dataclass

from plestore.spec import TableSpec
from plestore.tiers import RowRange

__all__ = ["SHARD_MODES", "ShardPlan", "head_columns", "plan_shard", "vocab_range"]

SHARD_MODES = ("rows", "heads")


def vocab_range(rows: int, rank: int, world: int, pad_to: int = 1) -> RowRange:
    """The rows rank `rank` of `world` serves (see the module docstring)."""
    if pad_to < 1:
        raise ValueError(f"pad_to must be >= 1, got {pad_to}")
    if world > rows:
        raise ValueError(
            f"shard='rows': {world} ranks for a table of {rows} rows; at most one rank per row"
        )
    padded = -(-rows // pad_to) * pad_to
    r = RowRange.for_rank(padded, rank, world)  # ceil(padded / world) rows a rank
    return RowRange(min(r.start, rows), min(r.end, rows))


def head_columns(heads: int, rank: int, world: int) -> tuple[int, int]:
    """Hash columns [first, end) of rank `rank`: ceil(heads / world) a rank, the last short."""
    if world > heads:
        raise ValueError(
            f"shard='heads': {world} ranks for {heads} heads; at most one rank per head"
        )
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, {world})")
    part = -(-heads // world)
    return min(rank * part, heads), min((rank + 1) * part, heads)


@dataclass(frozen=True)
class ShardPlan:
    """What one rank serves: its rows, and (heads mode) its columns of each id row."""

    mode: str
    rank: int
    world: int
    rows: RowRange
    heads: int  # id columns per token of the whole table
    columns: tuple[int, int] = (0, 0)  # heads mode: this rank's columns [first, end)
    part: int = 0  # heads mode: columns a rank gathers (ceil(heads / world)); pads short ranks
    head_rows: tuple[tuple[int, int], ...] = ()  # heads mode: [start, end) rows of each column

    @property
    def local_heads(self) -> int:
        return self.columns[1] - self.columns[0]


def plan_shard(spec: TableSpec, mode: str, rank: int, world: int, pad_to: int = 1) -> ShardPlan:
    """The rank's share of `spec` in `mode`; a clear ValueError for a split that cannot be made."""
    if mode not in SHARD_MODES:
        raise ValueError(f"shard must be one of {', '.join(SHARD_MODES)}; got {mode!r}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, {world})")
    if mode == "rows":
        return ShardPlan(mode, rank, world, vocab_range(spec.rows, rank, world, pad_to), spec.heads)
    sizes = getattr(spec.hash, "head_sizes", None)
    if sizes is None or len(sizes) != spec.heads:
        raise ValueError(
            f"shard='heads' needs per-head row ranges: table {spec.name} has no Qwen4Exp or "
            "Engram hash in its spec; use shard='rows'"
        )
    first, end = head_columns(spec.heads, rank, world)
    starts = [int(s) for s in spec.hash.head_offsets]
    bounds = [*starts, spec.rows]  # head h: [bounds[h], bounds[h + 1]); the last one to the end
    head_rows = tuple((starts[h], starts[h] + int(sizes[h])) for h in range(spec.heads))
    rows = RowRange(bounds[first], bounds[end]) if end > first else RowRange(0, 0)
    part = -(-spec.heads // world)
    return ShardPlan(mode, rank, world, rows, spec.heads, (first, end), part, head_rows)
