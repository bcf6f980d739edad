"""`plestore shm list | clean`: the node's shared copies (`share="node"`) and their leftovers."""

from __future__ import annotations

from plestore.cli.output import add_json_flag, format_table, human_bytes, print_json

#: what `plestore shm` leaves when interrupted (Ctrl-C; see plestore.cli.main)
INTERRUPTED = "copies already removed are gone; the others are as they were"


def register(sub) -> None:
    p = sub.add_parser(
        "shm",
        help="list the node's shared table copies, or remove those no live process uses",
        description="share='node' keeps one pinned copy of a table per node in the segment "
        "directory (PLESTORE_SHM_DIR, default /dev/shm). A copy outlives its users only when "
        "the last one died without closing it; the next open of that table reuses it. `list` "
        "shows every copy (table, rows, size, live users, age, state); `clean` removes those "
        "no live process uses or builds, with their lock files.",
    )
    p.add_argument("action", choices=["list", "clean"])
    p.add_argument("--dir", help="segment directory (default: PLESTORE_SHM_DIR or /dev/shm)")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from plestore.io.shmlist import clean_copies, list_copies

    if args.action == "list":
        copies = list_copies(args.dir)
        if args.json:
            print_json([c.to_dict() for c in copies])
        else:
            print(_table(copies) if copies else "no shared copies")
        return 0
    removed, kept = clean_copies(args.dir)
    if args.json:
        print_json({"removed": [c.to_dict() for c in removed], "kept": [c.to_dict() for c in kept]})
        return 0
    freed = human_bytes(sum(c.nbytes for c in removed))
    print(f"removed {len(removed)} copies or leftovers ({freed}); kept {len(kept)} in use")
    if removed or kept:
        print(_table(removed + kept, [c in removed for c in removed + kept]))
    return 0


def _table(copies, removed: list[bool] | None = None) -> str:
    head = ["table", "rows", "size", "users", "age", "state"]
    rows = [
        [
            c.table or f"? (key {c.key})",
            f"{c.rows[0]:,}..{c.rows[1]:,}" if c.rows else "?",
            human_bytes(c.nbytes),
            ", ".join(map(str, c.users)) or "none",
            _age(c.age_s),
            ("removed: " if removed and removed[i] else "") + c.state,
        ]
        for i, c in enumerate(copies)
    ]
    return format_table(head, rows)


def _age(s: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{s / n:.1f} {unit}"
    return f"{s:.0f} s"
