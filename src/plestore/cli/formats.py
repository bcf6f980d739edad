"""`plestore formats`: the supported row formats and their bytes per row."""

from __future__ import annotations

from plestore.cli.output import add_json_flag, format_table, print_json
from plestore.formats import FORMATS

#: what `plestore formats` leaves when interrupted (Ctrl-C; see plestore.cli.main)
INTERRUPTED = "nothing was changed"


def register(sub) -> None:
    p = sub.add_parser(
        "formats",
        help="list the row formats with bytes per row",
        description="List the supported row formats with their bytes per row.",
    )
    p.add_argument(
        "--dim", type=int, action="append", help="values per row (repeatable; default 160 and 256)"
    )
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args) -> int:
    dims = args.dim or [160, 256]
    rows = []
    for fmt in FORMATS.values():
        sizes = {}
        for d in dims:
            try:
                sizes[d] = fmt.row_bytes(d)
            except ValueError:
                sizes[d] = None  # dim not a multiple of the block size
        rows.append(
            {
                "format": fmt.name,
                "block_size": fmt.block_size,
                "table_scale": fmt.has_table_scale,
                "row_bytes": sizes,
                "description": fmt.description,
            }
        )
    if args.json:
        print_json(rows)
        return 0
    headers = ["format", *[f"bytes/row @{d}" for d in dims], "block", "description"]
    table = [
        [
            r["format"],
            *[("-" if r["row_bytes"][d] is None else r["row_bytes"][d]) for d in dims],
            r["block_size"],
            r["description"],
        ]
        for r in rows
    ]
    print(format_table(headers, table))
    return 0
