"""`plestore profile`: the rows real text reads most, written beside a table for its GPU row
cache (`gpu_cache_bytes`): its static hot set, reused like the packed table while the table's
data id matches."""

from __future__ import annotations

from plestore.cli.output import add_json_flag, print_json

#: what `plestore profile` leaves when interrupted (Ctrl-C; see plestore.cli.main)
INTERRUPTED = "the profile was not finished; run profile again"


def register(sub) -> None:
    p = sub.add_parser(
        "profile",
        help="profile a table's hot rows on token streams (for its GPU row cache)",
        description="Hash token streams (plestore text) with the table's own hash, count the "
        "reads of each row, and write the rows read at least --min-count times, most read "
        "first, to TABLE.hot.npy (+ .hot.json with the table's data id and the sources). A "
        "cache smaller than the profile takes its most read rows.",
    )
    p.add_argument("table", help="a packed table (directory or .json)")
    p.add_argument("--table", dest="name", help="which table of a directory")
    p.add_argument("--text", action="append", required=True, help="a token stream (repeatable)")
    # rows read once still serve 5 points of unseen text's reads (RESULTS.md "GPU row cache
    # and cascade on real text")
    p.add_argument("--min-count", type=int, default=1, help="rows read fewer times are left out")
    p.add_argument("--max-rows", type=int, help="keep at most this many rows")
    p.add_argument(
        "--split",
        type=float,
        help="profile only a seeded random share of each stream's documents holding about this "
        "share of its tokens (as `bench hitrate` does); `bench e2e --text-split` with the same "
        "share serves the documents left unseen",
    )
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args) -> int:
    import numpy as np

    from plestore.bench.text import TokenStream
    from plestore.hashing import make_hash
    from plestore.lookup.gpucache import hot_rows, write_profile
    from plestore.tablefile import TableFile

    tf = TableFile.open(args.table, args.name)
    if tf.spec.hash is None:
        raise ValueError(f"table {tf.name} has no hash spec: its rows are not addressed by text")
    if args.min_count < 1:
        raise ValueError(f"--min-count must be >= 1, got {args.min_count}")
    if args.split is not None and not 0 < args.split < 1:
        raise ValueError(f"--split must be a share in (0, 1), got {args.split}")
    hasher = make_hash(tf.spec.hash)
    parts, tokens = [], 0
    for path in args.text:
        stream = TokenStream.load(path)
        if args.split is not None:
            stream = stream.split(args.split)[0]
        tokens += stream.ids.size
        parts.append(stream.row_ids(hasher).reshape(-1))
    rows, counts = hot_rows(np.concatenate(parts), args.min_count)
    if args.max_rows is not None:
        rows, counts = rows[: args.max_rows], counts[: args.max_rows]
    source = {"streams": args.text, "tokens": int(tokens), "min_count": args.min_count}
    if args.split is not None:
        source["split"] = args.split
    out = write_profile(tf, rows, counts, source)
    share = float(counts.sum()) / max(1, sum(p.size for p in parts))
    result = {
        "table": tf.name,
        "profile": str(out),
        "rows": int(rows.size),
        "bytes": int(rows.size) * tf.layout.row_bytes,
        "read_share": share,
        **source,
    }
    if args.json:
        print_json(result)
    else:
        print(
            f"{out}: {rows.size:,} rows ({rows.size * tf.layout.row_bytes / 2**30:.2f} GiB) from "
            f"{tokens:,} tokens; they take {share:.1%} of the streams' row reads"
        )
    return 0
