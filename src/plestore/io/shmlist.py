"""The node's shared copies (`share="node"`, io/shm.py) as a person sees them: what each holds,
its size, its live users and its age (`plestore shm list`), and removing those no live process
uses, with their lock files (`plestore shm clean`).

A copy outlives its users only when the last one died without closing it (killed, OOM): the
next open of the same table maps it again, an open of another table removes it, and until then
it holds its size of the tmpfs. Users are the processes holding the copy's `.users` lock
shared, read from /proc/locks (a dead process holds none).
"""

from __future__ import annotations

import contextlib
import glob
import os
import time
from dataclasses import asdict, dataclass, field

from plestore.io.shm import read_header, remove_if_unused, segment_dir

__all__ = ["NodeCopy", "clean_copies", "list_copies"]

_SUFFIXES = (".seg", ".build", ".users")


@dataclass
class NodeCopy:
    """One copy's files in the segment directory, and who uses them."""

    key: str  # the table's data id, its row range and row stride
    path: str  # the published copy (plestore-KEY.seg), which may be missing
    table: str = ""  # what it holds: the table's metadata path (copies since it is recorded)
    rows: tuple[int, int] | None = None  # [start, end) of the table's rows
    nbytes: int = 0
    users: list[int] = field(default_factory=list)  # live processes using it
    state: str = ""  # in use | unused | building | abandoned build | lock files only | foreign
    age_s: float = 0.0  # since the copy (or its newest file) was written
    files: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def list_copies(directory: str | None = None) -> list[NodeCopy]:
    """Every copy (or leftover of one) in the segment directory, by key."""
    directory = directory or segment_dir()
    keys: dict[str, list[str]] = {}
    for path in glob.glob(os.path.join(glob.escape(directory), "plestore-*")):
        name = os.path.basename(path)[len("plestore-") :]
        key = next((name[: name.index(s)] for s in _SUFFIXES if s in name), None)
        if key:
            keys.setdefault(key, []).append(path)
    held = _flock_holders()
    return [_describe(directory, key, sorted(paths), held) for key, paths in sorted(keys.items())]


def clean_copies(directory: str | None = None) -> tuple[list[NodeCopy], list[NodeCopy]]:
    """(removed, kept): every copy that no live process uses or builds is removed with its
    temporary and lock files; the others are kept as they are."""
    removed, kept = [], []
    for copy in list_copies(directory):
        try:
            gone = copy.state not in ("in use", "building") and remove_if_unused(
                copy.path, lock_files=True
            )
        except OSError:  # another user's files (no permission): theirs to remove
            gone = False
        (removed if gone else kept).append(copy)
    return removed, kept


def _describe(directory: str, key: str, paths: list[str], held: dict) -> NodeCopy:
    seg = os.path.join(directory, f"plestore-{key}.seg")
    copy = NodeCopy(key, seg, files=[os.path.basename(p) for p in paths])
    with contextlib.suppress(ValueError):
        start, end = key.rsplit("-", 3)[1:3]
        copy.rows = (int(start), int(end))
    head = None
    with contextlib.suppress(OSError):
        fd = os.open(seg, os.O_RDONLY)
        try:
            head = read_header(fd)
        finally:
            os.close(fd)
    if head is not None:
        copy.table, copy.nbytes = head["label"], head["nbytes"]
    copy.users = sorted(held.get(_inode(seg[: -len(".seg")] + ".users"), {}).get("READ", []))
    builder = held.get(_inode(seg[: -len(".seg")] + ".build"), {}).get("WRITE", [])
    building = any(".seg.tmp-" in p for p in paths)
    with contextlib.suppress(OSError):
        copy.age_s = time.time() - max(os.stat(p).st_mtime for p in paths)
    if copy.users:
        copy.state = "in use"
    elif builder:
        copy.state = "building"
    elif head is not None and head["complete"]:
        copy.state = "unused"
    elif os.path.exists(seg):
        copy.state = "foreign"
    else:
        copy.state = "abandoned build" if building else "lock files only"
    return copy


def _inode(path: str) -> str | None:
    """The file as /proc/locks names it: MAJOR:MINOR:INODE (device numbers in hex)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"


def _flock_holders() -> dict[str, dict[str, list[int]]]:
    """/proc/locks' flocks: file -> {"READ" | "WRITE": holder pids} (waiters left out)."""
    out: dict[str, dict[str, list[int]]] = {}
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) < 6 or parts[1] != "FLOCK":  # ("->" marks a waiter: parts[1])
            continue
        with contextlib.suppress(ValueError):
            out.setdefault(parts[5], {}).setdefault(parts[3], []).append(int(parts[4]))
    return out
