"""`plestore inspect-config`: the tables a Hugging Face config describes."""

from __future__ import annotations

from plestore.cli.output import add_json_flag, format_table, human_bytes, print_json
from plestore.formats import FORMATS
from plestore.spec import PRESETS, preset_config, table_specs_from_hf_config

#: what `plestore config` leaves when interrupted (Ctrl-C; see plestore.cli.main)
INTERRUPTED = "nothing was changed"


def register(sub) -> None:
    p = sub.add_parser(
        "inspect-config",
        help="show the tables a Hugging Face config.json describes",
        description="Derive the table specs (rows, dim, heads, shards, bytes per format) from a "
        "Hugging Face config.json or a preset.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("config", nargs="?", help="path to config.json (or its directory)")
    src.add_argument("--preset", choices=sorted(PRESETS), help="a built-in model preset")
    p.add_argument("--format", help="override the table format the config implies")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args) -> int:
    cfg = preset_config(args.preset, args.format) if args.preset else args.config
    specs = table_specs_from_hf_config(cfg, format=args.format)
    out = []
    for s in specs:
        d = s.to_dict()
        d["row_bytes"] = s.row_bytes
        d["nbytes"] = s.nbytes
        d["nbytes_by_format"] = {
            f.name: s.rows * f.row_bytes(s.dim)
            for f in FORMATS.values()
            if s.dim % f.block_size == 0
        }
        out.append(d)
    if args.json:
        print_json(out)
        return 0
    for s, d in zip(specs, out, strict=True):
        shards = f"{s.shards.num_shards} x {s.shards.rows_per_shard:,} rows" if s.shards else "-"
        print(f"table {s.name}  ({s.tensor})")
        print(
            f"  rows {s.rows:,} x dim {s.dim}, {s.heads} row ids per token, format {s.format}"
            f", {s.row_bytes} B/row, {human_bytes(s.nbytes)}; checkpoint shards: {shards}"
        )
        if s.hash is not None:
            print(f"  hash: {s.hash.kind}, {s.hash.heads} heads")
        rows = [[f, b, human_bytes(b)] for f, b in d["nbytes_by_format"].items()]
        print("  " + format_table(["format", "bytes", "size"], rows).replace("\n", "\n  "))
    return 0
