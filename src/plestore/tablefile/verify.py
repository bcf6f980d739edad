"""Check a table file: its checksums (`TableFile.verify`), or every row against its source
checkpoint (`verify_against`), streaming with bounded memory like pack."""

from __future__ import annotations

import hashlib
import os
from contextlib import closing
from dataclasses import asdict, dataclass

import numpy as np

from plestore.checkpoint import Checkpoint, detect_tables
from plestore.io.streaming import bounded_map, progress_bar
from plestore.tablefile import TableFile
from plestore.tablefile.convert import Conversion
from plestore.tablefile.pack import DEFAULT_BATCH_BYTES, plan_batches

__all__ = ["AgainstReport", "verify_against"]


@dataclass
class AgainstReport:
    table: str
    ok: bool
    rows: int
    bad_rows: int
    first_bad_row: int | None
    fingerprint_matches: bool  # the checkpoint's headers/sizes/mtimes are those packed
    rows_sha256_matches: bool | None  # the source rows hash to what pack read (None: unknown)
    message: str

    def to_dict(self) -> dict:
        return asdict(self)


def verify_against(
    table: str | os.PathLike | TableFile,
    checkpoint: str | os.PathLike | Checkpoint,
    threads: int | None = None,
    progress: bool = False,
) -> AgainstReport:
    """Compare every row of `table` with the row pack would produce from `checkpoint` now
    (the source row itself, or its conversion with the table's scale)."""
    tf = table if isinstance(table, TableFile) else TableFile.open(table)
    if isinstance(checkpoint, Checkpoint):
        return _against(tf, checkpoint, threads, progress)
    with Checkpoint.open(checkpoint) as ck:
        return _against(tf, ck, threads, progress)


def _against(tf: TableFile, ck: Checkpoint, threads: int | None, progress: bool) -> AgainstReport:
    srcs = {s.name: s for s in detect_tables(ck)}
    if tf.name not in srcs:
        raise ValueError(f"checkpoint {ck.root} has no table {tf.name} (has: {', '.join(srcs)})")
    src, spec = srcs[tf.name], tf.spec
    if (src.spec.rows, src.spec.dim) != (spec.rows, spec.dim):
        return AgainstReport(
            tf.name,
            False,
            spec.rows,
            spec.rows,
            0,
            False,
            None,
            f"shape differs: table [{spec.rows}, {spec.dim}], checkpoint "
            f"[{src.spec.rows}, {src.spec.dim}]",
        )
    conv = Conversion(src.spec, spec) if src.spec.format != spec.format else None
    recorded = tf.source.get("rows_sha256") or {}
    n = (
        recorded.get("batch_rows")
        or plan_batches(
            src.spec, tf.layout, DEFAULT_BATCH_BYTES, conv.batch_values if conv else None
        )[0]
    )

    def check(a: int):
        m = min(n, spec.rows - a)
        raw = src.read_rows(a, m)
        want = conv(raw)[0] if conv else raw
        bad = np.flatnonzero((tf.read_range(a, m) != want).any(axis=1))
        return hashlib.sha256(raw).digest(), m, bad.size, (a + int(bad[0]) if bad.size else None)

    digests, bad_rows, first_bad = [], 0, None
    with (
        progress_bar(tf.data_bytes, f"verify {tf.name} against {ck.root.name}", progress) as bar,
        closing(bounded_map(check, range(0, spec.rows, n), threads)) as batches,
    ):
        for digest, m, nbad, first in batches:
            digests.append(digest)
            bad_rows += nbad
            first_bad = first if first_bad is None else first_bad
            bar.update(m * spec.row_bytes)
    sha = hashlib.sha256(b"".join(digests)).hexdigest()
    sha_ok = sha == recorded["hex"] if recorded.get("batch_rows") == n else None
    fp_ok = tf.source.get("fingerprint") == src.fingerprint
    msg = f"all {spec.rows} rows equal the checkpoint's"
    if bad_rows:
        msg = (
            f"{bad_rows} of {spec.rows} rows differ from the checkpoint; first bad row {first_bad}"
        )
    if not fp_ok:
        msg += " (the checkpoint changed since this table was packed: fingerprint differs)"
    return AgainstReport(tf.name, bad_rows == 0, spec.rows, bad_rows, first_bad, fp_ok, sha_ok, msg)
