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
    from plestore.lookup.profile import profile_streams
    from plestore.tablefile import TableFile

    tf = TableFile.open(args.table, args.name)
    result = profile_streams(tf, args.text, args.min_count, args.max_rows, args.split)
    if args.json:
        print_json(result)
    else:
        rows, gib = result["rows"], result["bytes"] / 2**30
        print(
            f"{result['profile']}: {rows:,} rows ({gib:.2f} GiB) from {result['tokens']:,} "
            f"tokens; they take {result['read_share']:.1%} of the streams' row reads"
        )
    return 0
