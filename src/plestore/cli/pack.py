"""`plestore pack`: checkpoint -> table files (streaming, atomic, reused when unchanged)."""

from __future__ import annotations

from pathlib import Path

from plestore.cli.output import add_json_flag, human_bytes, print_json
from plestore.formats import FORMATS

#: what `plestore pack` leaves when interrupted (Ctrl-C; see plestore.cli.main); run() says
#: whether there was a previous table to keep
INTERRUPTED = "the table being packed was not written; tables finished before it are kept"


def register(sub) -> None:
    p = sub.add_parser(
        "pack",
        help="pack a checkpoint's embedding tables into table files",
        description="Stream every table the checkpoint's config describes into OUT/<table>.json "
        "+ .rows with bounded memory. Interrupted packs leave nothing that opens; a table whose "
        "source fingerprint and options match is reused at once; one packed from another "
        "checkpoint is refused unless --force.",
    )
    p.add_argument("checkpoint", help="checkpoint directory (config.json + safetensors)")
    p.add_argument("out", help="output directory")
    p.add_argument(
        "--format",
        choices=sorted(FORMATS) + ["fp8"],
        help="convert to this format (default: keep the checkpoint's)",
    )
    p.add_argument(
        "--block-bytes",
        type=int,
        choices=[512, 4096, 0],
        help="rows never straddle blocks of this size (0: back to back). Default: the smallest "
        "O_DIRECT read of OUT's disk, 512 on most (a cold row then costs a 512-B read, not 4 "
        "KiB), else 4096; a table already packed keeps its block size unless this is given",
    )
    p.add_argument("--table", action="append", help="pack only this table (repeatable)")
    p.add_argument("--scale", type=float, help="table scale when converting (default: from amax)")
    p.add_argument("--batch-mib", type=float, default=16, help="source MiB per batch")
    p.add_argument("--threads", type=int, help="worker threads (default: CPUs, at most 16)")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace tables in OUT packed from another checkpoint (processes that have them "
        "open serve the old rows)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args) -> int:
    global INTERRUPTED
    from plestore.tablefile import find_tables
    from plestore.tablefile.pack import pack_checkpoint
    from plestore.tablefile.reuse import ForeignTableError

    if Path(args.out).is_dir() and find_tables(args.out):
        INTERRUPTED = (
            "the table being packed was not written (the previous one is intact); tables "
            "finished before it are kept"
        )

    try:
        rep = pack_checkpoint(
            args.checkpoint,
            args.out,
            format=args.format,
            block_bytes=args.block_bytes,
            table=args.table,
            scale=args.scale,
            batch_bytes=int(args.batch_mib * (1 << 20)),
            threads=args.threads,
            progress=not args.no_progress,
            force=args.force,
        )
    except ForeignTableError as e:  # in the CLI's terms
        raise ForeignTableError(e.why, "--force") from None
    d = rep.to_dict()
    if args.json:
        print_json(d)
        return 0
    for t in rep.tables:
        if t.reused:
            print(
                f"{t.name}: reused {t.path} (source fingerprint {t.fingerprint[:12]} matches; "
                f"{t.block_bytes}-B blocks)"
            )
            continue
        conv = f" (converted from {t.source_format})" if t.format != t.source_format else ""
        why = "" if t.block_reason == "chosen" else f": {t.block_reason}"
        print(
            f"{t.name}: {_replaced(t.replaced)}packed {t.rows:,} rows {t.format}{conv} -> "
            f"{t.path}: {human_bytes(t.data_bytes)} in {t.seconds:.2f} s "
            f"({human_bytes(t.throughput or 0)}/s), {t.block_bytes}-B blocks{why}"
        )
        if t.encode_error:
            e = t.encode_error
            print(
                f"  encode error: max abs {e['max_abs']:.3g} ({e['max_rel']:.2%} of max |x|), "
                f"rel rmse {e['rel_rmse']:.2%}; scale {t.scale:.6g}"
            )
    print(f"total {rep.seconds:.2f} s, peak RSS {human_bytes(rep.peak_rss_bytes)}")
    return 0


def _replaced(changed: dict | None) -> str:
    """'replaced (block size 4096 → 512): ' for a table of the same source re-packed."""
    if not changed:
        return ""
    names = {"block_bytes": "block size"}
    parts = [f"{names.get(k, k)} {old} → {new}" for k, (old, new) in changed.items()]
    return f"replaced ({', '.join(parts)}): "
