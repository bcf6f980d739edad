"""`plestore rows`: the decoded rows of some ids, where they lie in the file, and whether the
tier delivers the bytes the file holds — the first look when a model's output seems wrong."""

from __future__ import annotations

from plestore.cli.output import add_json_flag, print_json
from plestore.options import TIER_NAMES

#: what `plestore rows` leaves when interrupted (Ctrl-C; see plestore.cli.main)
INTERRUPTED = "nothing was changed"


def register(sub) -> None:
    p = sub.add_parser(
        "rows",
        help="print the decoded rows of some row ids, with the tier and file offsets",
        description="Look the ids up on a tier (default mapped: reads only their pages), as a "
        "model's lookup would, and print each row's file offset, block, packed bytes and "
        "decoded values, and whether they equal the row read from the file and decoded here.",
    )
    p.add_argument("table", help="table metadata (.json), data (.rows) or a directory of tables")
    p.add_argument("--ids", required=True, help="comma-separated row ids, e.g. 3,4,5")
    p.add_argument("--table", dest="name", help="which table of a directory")
    p.add_argument("--tier", default="mapped", choices=TIER_NAMES, help="default: %(default)s")
    p.add_argument("--device", default="cpu", help="where the lookup delivers (default: cpu)")
    p.add_argument(
        "--full", action="store_true", help="every byte and value of a row (default: the first)"
    )
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args) -> int:
    import numpy as np

    import plestore
    from plestore.formats import get_format
    from plestore.tablefile import DATA_OFFSET

    try:
        ids = [int(i) for i in args.ids.split(",") if i.strip()]
    except ValueError:
        raise ValueError(f"--ids takes comma-separated integers, got {args.ids!r}") from None
    if not ids:
        raise ValueError("--ids names no row")
    with plestore.open_table(args.table, args.tier, args.device, table=args.name) as table:
        tf = table.file
        outside = [i for i in ids if not 0 <= i < tf.spec.rows]
        if outside:
            raise ValueError(
                f"--ids: row {outside[0]} is outside table {tf.name}'s {tf.spec.rows:,} rows "
                f"(0 to {tf.spec.rows - 1:,})"
            )
        got = table.lookup(np.array(ids)[:, None]).float().cpu().numpy()  # [n, dim]
        raw = tf.read_rows(ids)  # [n, row_bytes], plain preads
        ref = get_format(tf.spec.format).decode_numpy(raw, tf.spec.scale, tf.spec.dim)
        at = tf.layout.offsets(np.array(ids)).tolist()  # data-region offsets
        block = tf.layout.block_bytes
        res = {
            "table": tf.name,
            "path": str(tf.meta_path),
            "data_file": str(tf.data_path),
            "tier": table.tier.name,
            "format": tf.spec.format,
            "scale": tf.spec.scale,
            "rows": [
                {
                    "id": i,
                    "file_offset": DATA_OFFSET + off,
                    "block": off // block if block else None,
                    "bytes_hex": raw[k].tobytes().hex(),
                    "values": got[k].tolist(),
                    "matches_file": bool(np.array_equal(got[k], ref[k], equal_nan=True)),
                }
                for k, (i, off) in enumerate(zip(ids, at, strict=True))
            ],
        }
    if args.json:
        print_json(res)
    else:
        _print(res, tf.layout.row_bytes, tf.spec.dim, args.full)
    return 0 if all(r["matches_file"] for r in res["rows"]) else 1


#: what a row shows without --full: its first bytes and values
SHORT_BYTES, SHORT_VALUES = 32, 12


def _print(res: dict, row_bytes: int, dim: int, full: bool) -> None:
    import numpy as np

    print(
        f"table {res['table']} ({res['path']}) on tier {res['tier']}: {res['format']} "
        f"(scale {res['scale']:.6g}), {row_bytes} B -> {dim} values a row"
    )
    for r in res["rows"]:
        block = "" if r["block"] is None else f", block {r['block']:,}"
        same = "equals the file's row" if r["matches_file"] else "DIFFERS from the file's row"
        print(f"\nrow {r['id']:,}: {res['data_file']} offset {r['file_offset']:,}{block}; {same}")
        hexes = r["bytes_hex"] if full else r["bytes_hex"][: 2 * SHORT_BYTES]
        more = "" if full or row_bytes <= SHORT_BYTES else f" ... ({row_bytes} B; --full)"
        lines = [hexes[a : a + 88] for a in range(0, len(hexes), 88)]
        print("  bytes  " + "\n         ".join(lines) + more)
        values = np.array(r["values"] if full else r["values"][:SHORT_VALUES], dtype=np.float32)
        text = np.array2string(values, max_line_width=96, threshold=dim + 1, precision=6)
        more = "" if full or dim <= SHORT_VALUES else f" ... ({dim} values; --full)"
        print("  values " + text.replace("\n", "\n        ") + more)
