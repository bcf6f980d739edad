"""`plestore verify`: recompute a table file's checksums, or compare it with its checkpoint."""

from __future__ import annotations

from pathlib import Path

from plestore.cli.output import add_json_flag, print_json

#: what `plestore verify` leaves when interrupted (Ctrl-C; see plestore.cli.main)
INTERRUPTED = "nothing was changed; nothing was checked to the end"


def register(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="check a table file's checksums (or every row against its checkpoint)",
        description="Recompute every chunk's CRC32 and every block's CRC-32 (the .crc sidecar) "
        "and name every bad block and its rows (--json: all of them); with --against, also "
        "compare every row with the checkpoint it was packed from. Exit status 1 on any "
        "failure.",
    )
    p.add_argument("table", help="table metadata (.json), data (.rows) or a directory of tables")
    p.add_argument("--table", dest="name", help="which table of a directory (default: all)")
    p.add_argument("--against", metavar="CHECKPOINT", help="compare every row with this source")
    p.add_argument(
        "--threads",
        type=int,
        help="worker threads (default: 8; with --against, the CPUs, at most 16)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from plestore.io.streaming import progress_bar
    from plestore.tablefile import TableFile, TableFileError, find_tables, no_tables_message
    from plestore.tablefile.verify import verify_against

    path = Path(args.table)
    if path.is_dir() and args.name is None:
        metas = find_tables(path)
        if not metas:
            raise TableFileError(no_tables_message(path))
    else:
        metas = [TableFile.open(path, args.name).meta_path]
    results, ok = [], True
    for meta in metas:
        tf = TableFile.open(meta)
        with progress_bar(tf.data_bytes, f"checksums {tf.name}", not args.no_progress) as bar:
            rep = tf.verify(threads=args.threads or 8, progress=bar.update)
        r = {
            "table": tf.name,
            "path": str(meta),
            "checksums_ok": rep.ok,
            "chunks": rep.chunks,
            "bad_chunks": rep.bad_chunks,
            "blocks": rep.blocks,
            "bad_blocks": rep.bad_blocks,
            "bad_runs": rep.bad_runs,
            "first_bad_rows": rep.first_bad_rows,
            "message": rep.message,
        }
        ok &= rep.ok
        if args.against:
            a = verify_against(tf, args.against, args.threads, not args.no_progress)
            r["against"] = a.to_dict()
            ok &= a.ok
        results.append(r)
        if not args.json:
            print(f"{tf.name}: checksums {'OK' if rep.ok else 'FAILED'}: {rep.message}")
            if "against" in r:
                print(
                    f"{tf.name}: rows vs {args.against}: {'OK' if a.ok else 'FAILED'}: {a.message}"
                )
    if args.json:
        print_json({"ok": ok, "tables": results})
    return 0 if ok else 1
