"""`plestore inspect`: what a checkpoint or a table directory holds."""

from __future__ import annotations

from pathlib import Path

from plestore.cli.output import add_json_flag, format_table, human_bytes, print_json

#: what `plestore inspect` leaves when interrupted (Ctrl-C; see plestore.cli.main)
INTERRUPTED = "nothing was changed"


def register(sub) -> None:
    p = sub.add_parser(
        "inspect",
        help="show the tables in a checkpoint or a directory of table files",
        description="For a checkpoint: its files and the tables it holds (rows, format, scale, "
        "shards, fingerprint). For table files: rows, format, bytes, block layout, checksums "
        "and the source fingerprint. Exit status 1 if something does not open.",
    )
    p.add_argument("path", help="checkpoint directory, table directory or table file")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from plestore.checkpoint.reader import INDEX_NAME, SINGLE_NAME
    from plestore.tablefile import find_tables, stale_temps

    path = Path(args.path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    result: dict = {"path": str(path)}
    is_ckpt = path.suffix == ".safetensors" or (
        path.is_dir() and ((path / INDEX_NAME).exists() or (path / SINGLE_NAME).exists())
    )
    metas = (
        find_tables(path)
        if path.is_dir()
        else ([path] if path.suffix in (".json", ".rows") else [])
    )
    if is_ckpt:
        result["checkpoint"] = _checkpoint(path)
    if metas:
        result["tables"] = [_table(m) for m in metas]
    leftovers = stale_temps(path) if path.is_dir() else []
    if leftovers:
        result["leftovers"] = {str(p): p.stat().st_size for p in leftovers}
    if not is_ckpt and not metas:
        if leftovers:
            raise ValueError(f"{path} holds no finished table; {_leftovers(path, leftovers)}")
        raise ValueError(f"{path} is neither a checkpoint nor holds table files")
    ok = "error" not in result.get("checkpoint", {}) and all(
        "error" not in t for t in result.get("tables", [])
    )
    if args.json:
        print_json(result)
    else:
        _print(result)
    return 0 if ok else 1


def _leftovers(path: Path, files: list[Path]) -> str:
    """What an interrupted pack left in `path`, and how to remove it."""
    size = sum(p.stat().st_size for p in files)
    names = ", ".join(p.name for p in files[:3]) + (", ..." if len(files) > 3 else "")
    return (
        f"an interrupted pack left {len(files)} temporary file{'s' * (len(files) != 1)} "
        f"({human_bytes(size)}: {names}); the next `plestore pack CHECKPOINT {path}` deletes "
        f"them, or remove them with: rm {path}/.*.tmp-*"
    )


def _checkpoint(path: Path) -> dict:
    from plestore.checkpoint import Checkpoint, detect_tables

    with Checkpoint.open(path) as ck:
        d = {
            "files": [h.path.name for h in ck.headers],
            "tensors": len(ck.tensors),
            "bytes": ck.nbytes,
            "synthetic": ck.config.get("plestore_synth"),
        }
        try:
            d["tables"] = [t.describe() for t in detect_tables(ck)]
        except ValueError as e:
            d["error"] = str(e)
    return d


def _table(meta: Path) -> dict:
    from plestore.tablefile import TableFile

    try:
        tf = TableFile.open(meta)
    except ValueError as e:
        return {"metadata": str(meta), "error": str(e)}
    d = tf.describe()
    d["rows_per_block"] = tf.layout.rows_per_block
    d["source"] = {
        k: tf.source.get(k)
        for k in ("checkpoint", "source_format", "options", "rows_sha256", "encode_error")
    }
    return d


def _print(r: dict) -> None:
    ck = r.get("checkpoint")
    if ck:
        synth = f" (synthetic, seed {ck['synthetic']['seed']})" if ck.get("synthetic") else ""
        print(
            f"checkpoint {r['path']}{synth}: {len(ck['files'])} files, {ck['tensors']} "
            f"tensors, {human_bytes(ck['bytes'])}"
        )
        if "error" in ck:
            print(f"  tables: error: {ck['error']}")
        rows = [
            [
                t["name"],
                t["rows"],
                t["dim"],
                t["format"],
                f"{t['scale']:.6g}",
                human_bytes(t["nbytes"]),
                t["shards"],
                t["fingerprint"][:12],
            ]
            for t in ck.get("tables", [])
        ]
        if rows:
            head = ["table", "rows", "dim", "format", "scale", "bytes", "shards", "fingerprint"]
            print("  " + format_table(head, rows).replace("\n", "\n  "))
    if r.get("leftovers"):
        print(_leftovers(Path(r["path"]), [Path(p) for p in r["leftovers"]]))
    for t in r.get("tables", []):
        if "error" in t:
            print(f"table {t['metadata']}: error: {t['error']}")
            continue
        s, lay = t["spec"], t["layout"]
        if not lay["block_bytes"]:
            blocks = "rows back to back"
        elif t["rows_per_block"]:
            blocks = f"{lay['block_bytes']} B blocks, {t['rows_per_block']} rows per block"
        else:  # a row longer than a block starts a block and takes whole ones
            span = -(-lay["row_stride"] // lay["block_bytes"])
            blocks = f"{lay['block_bytes']} B blocks, {span} whole blocks per row"
        print(
            f"table {t['name']} ({t['metadata']}): {s['rows']:,} rows x {s['dim']} "
            f"{s['format']} (scale {s['scale']:.6g}), {lay['row_bytes']} B/row, {blocks}; "
            f"{human_bytes(t['data_bytes'])} in {t['chunks']} checksummed "
            f"chunk{'s' * (t['chunks'] != 1)}; "
            f"source fingerprint {t['source_fingerprint']}"
        )
