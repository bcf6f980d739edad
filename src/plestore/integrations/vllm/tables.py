"""A model's PLE tables for a serving engine: packed straight from the checkpoint's shard files
into the table directory on the first start, reused by fingerprint on every later one, and
refused when the directory holds another checkpoint's tables. Engine-agnostic (no vLLM import).

    prepare_table(model_dir, table_dir, name, fmt)   -> (the table's .json path, reused)

Several processes starting at once pack once: pack_checkpoint holds the directory's pack lock,
the others wait (bounded by the packer's progress) and find the table reusable. A killed pack
leaves nothing that opens; the next start deletes its leftovers and packs again.
"""

from __future__ import annotations

import os
from pathlib import Path

from plestore.checkpoint import Checkpoint, declare_qwen_shard_format, detect_tables
from plestore.tablefile.pack import PACK_LOCK_TIMEOUT_S, foreign_table, pack_checkpoint

__all__ = ["TableMismatch", "ple_table_name", "prepare_table"]


class TableMismatch(ValueError):
    """The table directory holds a table packed from another checkpoint or config."""


def ple_table_name(layer: int) -> str:
    """The packed table of decoder layer `layer` (0-based): `ple.layers.<layer>`."""
    return f"ple.layers.{layer}"


def prepare_table(
    model_dir: str | os.PathLike,
    table_dir: str | os.PathLike,
    name: str,
    fmt: str | None = None,
    timeout_s: float = PACK_LOCK_TIMEOUT_S,
) -> tuple[Path, bool]:
    """(the table's metadata path, whether it was reused) for table `name` of the checkpoint, in
    format `fmt` (what the engine computes with: None or the source's own keeps its bytes)."""
    with Checkpoint.open(model_dir) as ck:
        qwen = any(".ngram_embedding.shard_" in n for n in ck.tensors)
        shard_fmt = declare_qwen_shard_format(ck) if qwen else None
        sources = {s.name: s for s in detect_tables(ck)}  # validates every shard and constant
        if name not in sources:
            raise ValueError(
                f"{model_dir} has no table {name} (its tables: "
                f"{', '.join(sorted(sources)) or 'none'})"
            )
        src = sources[name]
        fmt = fmt or src.spec.format
        if shard_fmt == "fp8_e4m3" and fmt != "fp8_e4m3":
            raise ValueError(
                f"{src.spec.tensor}: the shards are F8_E4M3 but the engine loads this table "
                f"as {fmt} (no fp8 scale applied); declare ple_embedding_dtype float8_e4m3fn"
            )
        out = Path(table_dir)
        meta = out / f"{name}.json"
        why = foreign_table(out, src, ours="this engine's checkpoint ")
        if why:
            raise TableMismatch(
                f"{why}. Give another table_dir, or remove {out} to re-pack it from this checkpoint"
            )
        # force=False: a table another start packed from another checkpoint while this one
        # waited for the lock is refused there too (TableFileError); this one's is replaced
        report = pack_checkpoint(
            ck,
            out,
            format=None if fmt == src.spec.format else fmt,
            table=name,
            lock_timeout_s=timeout_s,
        )
    return meta, report.reused
