"""Which table of a source a pack finds in its output directory: one to reuse as it is
(`reusable`), one of this source to replace (`replaced_options` says how it differs), or another
source's, refused unless forced (`foreign_table`)."""

from __future__ import annotations

from pathlib import Path

from plestore.checkpoint import SourceTable
from plestore.tablefile import FORMAT_VERSION, TableFile, TableFileError

__all__ = [
    "ForeignTableError",
    "foreign_table",
    "refuse_foreign",
    "replaced_options",
    "reusable",
    "reusable_table",
]


def reusable_table(out: Path, src: SourceTable, opts: dict) -> TableFile | None:
    meta = out / f"{src.name}.json"
    if not meta.exists():
        return None
    try:
        tf = TableFile.open(meta)
    except TableFileError:
        return None
    return tf if reusable(tf, src, opts) else None


def replaced_options(out: Path, src: SourceTable, opts: dict) -> dict | None:
    """The options (name -> [old, new]) in which the table of `src` in `out` differs from the
    one about to replace it, or None: no such table (none, another source's, none that opens)."""
    try:
        old = TableFile.open(out / f"{src.name}.json")
    except (OSError, TableFileError):
        return None
    stored = old.source.get("options")
    if old.source.get("fingerprint") != src.fingerprint or not isinstance(stored, dict):
        return None
    changed = {k: [stored.get(k), v] for k, v in opts.items() if stored.get(k) != v}
    return changed or {"format version": [old.version, FORMAT_VERSION]}


def reusable(tf: TableFile, src: SourceTable, opts: dict) -> bool:
    """Whether the opened table `tf` is `src` packed with `opts` (block_bytes None: any)."""
    stored = tf.source.get("options")
    if not isinstance(stored, dict) or tf.source.get("fingerprint") != src.fingerprint:
        return False
    want = {k: v for k, v in opts.items() if not (k == "block_bytes" and v is None)}
    same = all(k in stored and stored[k] == v for k, v in want.items())
    return same and tf.block_checks is not None  # older formats are re-packed


def foreign_table(out: Path, src: SourceTable, ours: str = "") -> str | None:
    """Why the table in `out` that packing `src` would replace is another source's (its
    fingerprint differs: another checkpoint, or this path's files changed since), or None: no
    table there, one that does not open (replaced), or this source's. `ours` names src's
    checkpoint in the message."""
    meta = out / f"{src.name}.json"
    try:
        old = TableFile.open(meta) if meta.exists() else None
    except TableFileError:
        return None
    theirs = None if old is None else old.source.get("fingerprint")
    if old is None or theirs == src.fingerprint:
        return None
    where, root = old.source.get("checkpoint"), Path(src.checkpoint.root)
    if where is not None and Path(where).resolve() == root.resolve():
        return (
            f"{meta} was packed from {where} before its files changed (source fingerprint "
            f"{theirs}); {ours}{root} now has fingerprint {src.fingerprint}"
        )
    return (
        f"{meta} was packed from another checkpoint ({where}, source fingerprint {theirs}); "
        f"{ours}{root} has fingerprint {src.fingerprint}"
    )


class ForeignTableError(TableFileError):
    """A table pack would replace is another source's (`why` says whose); `force` names the
    way to replace it anyway in the caller's terms (`force=True`, or the CLI's `--force`)."""

    def __init__(self, why: str, force: str = "force=True") -> None:
        self.why = why
        super().__init__(
            f"{why}. Replacing it would leave processes that have it open serving the old rows: "
            f"pack into another directory, or pass {force} to replace it"
        )


def refuse_foreign(out: Path, sources: list[SourceTable]) -> None:
    """Raise if a table pack would replace is another source's: processes that have it open
    would serve the old rows (pinned, direct) or fail (mapped)."""
    for src in sources:
        why = foreign_table(out, src)
        if why:
            raise ForeignTableError(why)
