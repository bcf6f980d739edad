"""One packing path for every engine and the CLI: a model's tables packed from its checkpoint
files into the table directory once (`pack_checkpoint`, the CLI's `plestore pack`), and reused
as they are by every engine after (nothing written, no lock taken). Imports no engine.

    prepare_table(model_dir, table_dir, name, fmt)  -> (the table's .json path, reused)

- One fingerprint: the source's (`SourceTable.fingerprint`: the checkpoint's headers, names,
  shapes, file sizes and mtimes). A table of another checkpoint, or of this one before its files
  changed, is refused with `plestore pack`'s message (`foreign_table`) — never replaced.
- One FP8 convention: an FP8 checkpoint's table keeps the e4m3 bytes and the checkpoint's own
  `weight_scale` (what `plestore pack` and vLLM serve); an engine computing with another scale
  opens the same file at it (`TableFile.with_scale`: transformers, 1.0).
- One table per format: `name` holds the checkpoint's own format (any block size is reused);
  an engine needing another format gets `name.<format>` beside it, never a re-pack over it.

Several processes starting at once pack once: pack_checkpoint holds the directory's pack lock,
the others wait (bounded by the packer's progress) and find the table reusable. A killed pack
leaves nothing that opens; the next start deletes its leftovers and packs again.
"""

from __future__ import annotations

import os
import re
from contextlib import nullcontext
from pathlib import Path

from plestore.checkpoint import Checkpoint, SourceTable, declare_qwen_shard_format, detect_tables
from plestore.formats import get_format
from plestore.tablefile import TableFile, TableFileError
from plestore.tablefile.pack import (
    PACK_LOCK_TIMEOUT_S,
    foreign_table,
    pack_checkpoint,
    renamed,
    reusable,
)

__all__ = ["TableMismatchError", "ple_table_name", "ple_table_of", "prepare_table", "table_name"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class TableMismatchError(ValueError):
    """The table directory holds a table packed from another checkpoint (or from this one
    before its files changed), or from other weights."""


def ple_table_name(layer: int) -> str:
    """The packed table of Qwen4Exp decoder layer `layer` (0-based): `ple.layers.<layer>`."""
    return f"ple.layers.{layer}"


def ple_table_of(module_name: str) -> str:
    """The packed table of the PLE layer an engine's module sits in
    ('model.language_model.layers.1.ple.ple_embedding.ngram_embedding' -> 'ple.layers.1')."""
    m = _LAYER.search(module_name)
    if m is None:
        raise ValueError(f"{module_name}: no decoder layer index in the module name")
    return ple_table_name(int(m.group(1)))


def table_name(name: str, fmt: str) -> str:
    """The file name of table `name` converted to format `fmt` (beside the source's)."""
    return f"{name}.{fmt}"


def prepare_table(
    model_dir: str | os.PathLike | Checkpoint,
    table_dir: str | os.PathLike,
    name: str,
    fmt: str | None = None,
    timeout_s: float = PACK_LOCK_TIMEOUT_S,
) -> tuple[Path, bool]:
    """(the table's metadata path, whether it was reused) for table `name` of the checkpoint
    (`detect_tables`' names: `ple.layers.<L>`, `embed_tokens_per_layer`, ...) in format `fmt`
    (what the engine computes with; None: the checkpoint's own, byte for byte). Raises
    TableMismatchError for another checkpoint's table, ValueError for FP8 shards asked in
    another format (no engine applies their scale then)."""
    opened = nullcontext(model_dir) if isinstance(model_dir, Checkpoint) else None
    with opened or Checkpoint.open(model_dir) as ck:
        src, fmt = _source(ck, name, fmt)
        out = Path(table_dir)
        opts = {"format": fmt, "block_bytes": None, "scale": None}
        candidates = [name, table_name(name, fmt)]
        for candidate in candidates:  # a table of this source in this format: as it is
            tf = _opened(out / f"{candidate}.json")
            if tf is not None and reusable(tf, src, opts):
                return tf.meta_path, True
        # the source's format goes to `name` unless a table of it in another format is there
        own = fmt == src.spec.format and _opened(out / f"{name}.json") is None
        target = name if own else table_name(name, fmt)
        for candidate in dict.fromkeys([name, target]):  # the directory's, and what is written
            why = foreign_table(out, renamed(src, candidate), ours="this engine's checkpoint ")
            if why:
                raise TableMismatchError(
                    f"{why}. Give another table directory, or remove {out} to re-pack it from "
                    "this checkpoint"
                )
        report = pack_checkpoint(
            ck,
            out,
            format=None if fmt == src.spec.format else fmt,
            block_bytes=None,
            table=name,
            lock_timeout_s=timeout_s,
            names={name: target},
        )  # force=False: a table another start packed from elsewhere meanwhile is refused
    return out / f"{target}.json", report.reused


def _opened(meta: Path) -> TableFile | None:
    """The table at `meta` if one opens there (a killed pack's leftovers do not)."""
    try:
        return TableFile.open(meta) if meta.exists() else None
    except TableFileError:
        return None


def _source(ck: Checkpoint, name: str, fmt: str | None) -> tuple[SourceTable, str]:
    """Table `name` of the checkpoint (validated) and the format it is asked in."""
    qwen = any(".ngram_embedding.shard_" in n for n in ck.tensors)
    shard_fmt = declare_qwen_shard_format(ck) if qwen else None
    sources = {s.name: s for s in detect_tables(ck)}  # validates every shard and constant
    if name not in sources:
        raise ValueError(
            f"{ck.root} has no table {name} (its tables: {', '.join(sorted(sources)) or 'none'})"
        )
    src = sources[name]
    fmt = get_format(fmt or src.spec.format).name
    if shard_fmt == "fp8_e4m3" and fmt != "fp8_e4m3":
        raise ValueError(
            f"{src.spec.tensor}: the shards are F8_E4M3 but the engine loads this table as "
            f"{fmt} (no fp8 scale applied); declare ple_embedding_dtype float8_e4m3fn"
        )
    return src, fmt
