"""share="node": the shared segment's life cycle with real processes — a builder killed half-way
(the next opener rebuilds; nobody maps the partial copy), users that die holding the copy (the
others read on; the last one's copy is reused), a foreign file under the segment's name.
(Several processes at once: tests/test_distributed.py.)"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from test_distributed import _bf16_table, _bits

import plestore
from conftest import devices, requires_cuda
from plestore.spec import TableSpec
from plestore.tiers.pinned import PinnedTier


@pytest.fixture
def table(tmp_path, monkeypatch):
    monkeypatch.setenv("PLESTORE_SHM_DIR", str(tmp_path / "shm"))
    spec = TableSpec(name="t", rows=5000, dim=64, format="bf16")
    _bf16_table(tmp_path / "t", spec)
    ids = np.random.default_rng(0).integers(0, spec.rows, (40, 3))
    with plestore.open_table(tmp_path / "t", tier="device", device="cpu") as ref:
        want = _bits(ref.lookup(ids))
    return str(tmp_path / "t"), ids, want, tmp_path / "shm"


def _fork(child) -> tuple[int, int]:
    """Run child(write_fd) in a forked process; returns (pid, read end of its pipe)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            child(w)
        finally:
            os._exit(0)
    os.close(w)
    return pid, r


def _files(shm) -> list[str]:
    return sorted(os.listdir(shm)) if shm.exists() else []


def test_a_builder_killed_half_way_leaves_nothing_anyone_maps(table):
    path, ids, want, shm = table

    def half_then_hang(self, array, progress):  # writes garbage into half the copy, then stalls
        array[: array.size // 2] = 0xAB
        progress(array.size // 2)
        os.write(self._signal_fd, b"x")
        time.sleep(600)

    def child(w):
        PinnedTier._fill = half_then_hang
        PinnedTier._signal_fd = w
        plestore.open_table(path, tier="pinned", device="cpu", share="node")

    pid, r = _fork(child)
    try:
        assert os.read(r, 1) == b"x"  # the builder is half-way
        assert not [f for f in _files(shm) if f.endswith(".seg")]  # nothing published
        assert [f for f in _files(shm) if ".seg.tmp-" in f]
        t0 = time.monotonic()  # a second opener waits, bounded: the build makes no progress
        with pytest.raises(TimeoutError, match="no progress"):
            from plestore.io.shm import SharedHostBuffer

            key = next(f for f in _files(shm) if ".seg.tmp-" in f)[9:].split(".seg")[0]
            SharedHostBuffer(key, 1, lambda a, p: None, timeout_s=0.5)
        assert time.monotonic() - t0 < 10
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
    with plestore.open_table(path, tier="pinned", device="cpu", share="node") as t:
        assert t.tier.describe()["built_shared_copy"]  # rebuilt, not the partial copy
        assert np.array_equal(_bits(t.lookup(ids)), want)
        assert not [f for f in _files(shm) if ".tmp-" in f]  # the abandoned build is gone
    assert not [f for f in _files(shm) if f.endswith(".seg")]  # the last closer removed it


def _crash_holding(path):
    """A process that opens the shared copy and is killed holding it (no close, no cleanup)."""

    def child(w):
        plestore.open_table(path, tier="pinned", device="cpu", share="node")
        os.write(w, b"x")
        time.sleep(600)

    pid, r = _fork(child)
    assert os.read(r, 1) == b"x"
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(r)


def test_processes_that_die_holding_the_copy(table):
    path, ids, want, shm = table
    with plestore.open_table(path, tier="pinned", device="cpu", share="node") as t:
        _crash_holding(path)  # another user dies while this one reads
        assert np.array_equal(_bits(t.lookup(ids)), want)
    assert not [f for f in _files(shm) if f.endswith(".seg")]  # the dead one held nothing
    _crash_holding(path)  # the last user dies: its complete copy stays ...
    (seg,) = [shm / f for f in _files(shm) if f.endswith(".seg")]
    with plestore.open_table(path, tier="pinned", device="cpu", share="node") as t:
        assert not t.tier.describe()["built_shared_copy"]  # ... and the next opener maps it
        assert np.array_equal(_bits(t.lookup(ids)), want)
    assert not seg.exists()
    seg.write_bytes(b"not a plestore segment" * 1000)  # a foreign file under the name
    with plestore.open_table(path, tier="pinned", device="cpu", share="node") as t:
        assert t.tier.describe()["built_shared_copy"]  # replaced, not mapped
        assert np.array_equal(_bits(t.lookup(ids)), want)
    assert not seg.exists()


def test_share_option_is_checked(table):
    path = table[0]
    with pytest.raises(ValueError, match="share must be none or node"):
        plestore.open_table(path, tier="pinned", device="cpu", share="host")
    with pytest.raises(ValueError, match="the direct tier holds none to share"):
        plestore.open_table(path, tier="direct", device="cpu", share="node")
    with plestore.open_table(path, tier="mapped", device="cpu", share="node") as t:
        assert t.lookup([[1, 2]]).shape == (1, 128)  # the page cache is shared already


def test_two_last_closers_at_once_still_remove_the_copy(tmp_path):
    """Two last users closing together: A holds the build lock for its check and sees B's shared
    lock; B, closing meanwhile, must not give up on the busy build lock, or nobody removes the
    copy (it would sit in /dev/shm, unused, until some later opener's sweep)."""
    import fcntl

    from plestore.io.shm import SharedHostBuffer

    def fill(array, progress):
        array[:] = 7
        progress(array.size)

    a = SharedHostBuffer("k", 8192, fill, directory=str(tmp_path))
    b = SharedHostBuffer("k", 8192, fill, directory=str(tmp_path))
    assert os.path.exists(a.path)
    a.close()  # (A's own check fails: B still uses the copy)
    # A's check as it stands when B closes: the build lock held, B's shared lock seen.
    held = os.open(str(tmp_path / "plestore-k.build"), os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)

    import threading

    release = threading.Timer(0.2, lambda: os.close(held))  # A's check ends
    release.start()
    b.close()
    release.join()
    assert not os.path.exists(b.path), "no user left, but the copy stays"


@pytest.mark.parametrize("device", devices())
def test_two_tables_of_one_process_share_the_copy(table, device, monkeypatch, tmp_path):
    """A process opening the table twice (two models, or a tier with and without a GPU row
    cache) maps and registers the one copy once."""
    path, ids, want, shm = table
    if device == "cuda":  # CUDA registers shared file mappings of a tmpfs only
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm tmpfs to register a shared copy in")
        shm = Path(f"/dev/shm/plestore-test-{os.getpid()}-{tmp_path.name}")
        monkeypatch.setenv("PLESTORE_SHM_DIR", str(shm))
    a = plestore.open_table(path, tier="pinned", device=device, share="node")
    b = plestore.open_table(path, tier="pinned", device=device, share="node")
    mapping = a.tier.buffer._buffer
    assert b.tier.buffer._buffer is mapping and mapping.pinned == (device == "cuda")
    assert a.tier.describe()["built_shared_copy"]
    assert not b.tier.describe()["built_shared_copy"]
    assert len([f for f in _files(shm) if f.endswith(".seg")]) == 1
    a.close()  # the first opener goes first: b reads on
    assert np.array_equal(_bits(b.lookup(ids)), want)
    b.close()
    assert mapping._map.closed  # (a's views went with a: the last closer unmaps)
    assert _files(shm) == []  # the copy and its .build / .users lock files: nothing left
    if device == "cuda":
        shutil.rmtree(shm, ignore_errors=True)


def test_a_close_while_another_copy_builds_does_not_wait_for_it(table, tmp_path, monkeypatch):
    """Building a copy streams the whole table; a close meanwhile (a garbage-collected model's
    finalizer, run in the builder's thread) must not wait for that build, nor deadlock it."""
    import threading

    path, ids, want, shm = table
    spec = TableSpec(name="t", rows=3000, dim=64, format="bf16")
    _bf16_table(tmp_path / "u", spec)  # another table: another copy
    first = plestore.open_table(path, tier="pinned", device="cpu", share="node")
    fill = PinnedTier._fill

    def fill_closing_the_first(self, array, progress):
        first.close()
        fill(self, array, progress)

    monkeypatch.setattr(PinnedTier, "_fill", fill_closing_the_first)
    opened = []
    t = threading.Thread(
        target=lambda: opened.append(
            plestore.open_table(tmp_path / "u", tier="pinned", device="cpu", share="node")
        ),
        daemon=True,
    )
    t.start()
    t.join(timeout=30)
    assert not t.is_alive() and opened, "the build waited on a close it runs itself"
    opened[0].close()
    assert not [f for f in _files(shm) if f.endswith(".seg")]


def test_a_failed_build_raises_the_fills_own_error(table, monkeypatch):
    path = table[0]

    def failing_fill(self, array, progress):
        array[:8] = 1
        raise OSError("the disk went away")

    monkeypatch.setattr(PinnedTier, "_fill", failing_fill)
    with pytest.raises(OSError, match="the disk went away"):
        plestore.open_table(path, tier="pinned", device="cpu", share="node")


def test_a_forked_child_leaves_the_parents_copy_to_the_parent(table):
    """A child forked while the parent maps a copy: closing the inherited table neither fails
    nor touches the parent's registry; the child maps its own; once the parent closes, the copy
    goes (the child's inherited lock files no longer hold it)."""
    path, ids, want, shm = table
    parent = plestore.open_table(path, tier="pinned", device="cpu", share="node")

    rows = parent.tier.rows.copy()

    def child(w):  # (no torch ops: its thread pool may hang in a forked child)
        parent.close()  # the parent's handle, in the child: let go, nothing more
        with plestore.open_table(path, tier="pinned", device="cpu", share="node") as own:
            attached = not own.tier.describe()["built_shared_copy"]
            ok = attached and np.array_equal(own.tier.rows, rows)
        os.write(w, b"y" if ok else b"n")
        time.sleep(600)  # alive while the parent closes

    pid, r = _fork(child)
    try:
        assert os.read(r, 1) == b"y"
        assert np.array_equal(_bits(parent.lookup(ids)), want)
        parent.close()
        assert not [f for f in _files(shm) if f.endswith(".seg")]
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)


def _shm_cli(*args: str):
    """`plestore shm ARGS --json` in a process of its own (PLESTORE_SHM_DIR: the fixture's)."""
    import json
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "plestore", "shm", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout) if "--json" in args else r.stdout


def test_shm_list_and_clean_leave_live_copies_and_remove_the_rest(table, tmp_path):
    path, ids, want, shm = table
    other = tmp_path / "u"
    _bf16_table(other, TableSpec(name="u", rows=3000, dim=64, format="bf16"))
    with plestore.open_table(path, tier="pinned", device="cpu", share="node") as live:
        _crash_holding(str(other))  # its last user died: the unused copy and lock files stay
        (shm / "plestore-gone-0-1-8.build").write_bytes(b"")  # a killed builder's lock files
        (shm / "plestore-gone-0-1-8.users").write_bytes(b"")
        copies = {c["key"].split("-")[0]: c for c in _shm_cli("list", "--json")}
        mine = copies[live.file.data_id]
        assert mine["state"] == "in use" and mine["users"] == [os.getpid()]
        assert mine["table"] == str(live.file.meta_path) and mine["rows"] == [0, 5000]
        assert mine["nbytes"] == 5000 * 128 and mine["age_s"] < 60
        dead = copies[plestore.open_table(other, tier="mapped", device="cpu").file.data_id]
        assert dead["state"] == "unused" and dead["users"] == [] and dead["nbytes"] == 3000 * 128
        assert copies["gone"]["state"] == "lock files only"
        text = _shm_cli("list")
        assert str(live.file.meta_path) in text and "in use" in text and "unused" in text
        cleaned = _shm_cli("clean", "--json")
        assert {c["key"] for c in cleaned["kept"]} == {mine["key"]}
        assert {c["key"] for c in cleaned["removed"]} == {dead["key"], copies["gone"]["key"]}
        left = _files(shm)
        assert not [f for f in left if "gone" in f or dead["key"] in f], left
        assert np.array_equal(_bits(live.lookup(ids)), want)  # the live copy reads on
    assert _files(shm) == []  # the last closer took the copy's lock files too
    assert "removed 0" in _shm_cli("clean")
    with plestore.open_table(path, tier="pinned", device="cpu", share="node") as again:
        assert np.array_equal(_bits(again.lookup(ids)), want)  # new lock files, a new copy


def test_a_lock_file_removed_under_a_waiter_is_not_the_one_it_holds(tmp_path, monkeypatch):
    """`shm clean` removes an unused copy's lock files while holding them; a process that had
    opened the build lock before (and locks it after) must lock the file now under the name,
    or two processes would each hold "the" build lock."""
    from plestore.io import locks

    lock = str(tmp_path / "plestore-k.build")
    stale = locks.open_lock(lock)  # a waiter opened the file ...
    os.unlink(lock)  # ... and the cleaner removed it before the waiter locked it
    opened, real = iter([stale]), locks.open_lock
    monkeypatch.setattr(locks, "open_lock", lambda p, mode: next(opened, None) or real(p, mode))
    fd = locks.try_lock(lock)
    assert os.fstat(fd).st_ino == os.stat(lock).st_ino  # the file under the name ...
    assert locks.try_lock(lock) is None  # ... held: nobody else gets it
    os.close(fd)


def test_the_filesystem_of_a_path_is_read_from_the_mounts(tmp_path):
    from plestore.io.probe import filesystem_type

    if os.path.isdir("/dev/shm"):
        assert filesystem_type("/dev/shm/not/made/yet") == "tmpfs"  # (its nearest parent's)
    assert filesystem_type(tmp_path) not in ("",)


@pytest.mark.gpu
@requires_cuda
def test_a_pinned_node_copy_outside_a_tmpfs_is_a_clear_error(table, tmp_path, monkeypatch):
    """CUDA pins no shared mapping of a disk file: said at open, naming PLESTORE_SHM_DIR."""
    from plestore.io.probe import filesystem_type

    path, _, _, _ = table
    if filesystem_type(tmp_path) in ("tmpfs", "hugetlbfs"):
        pytest.skip(f"{tmp_path} is itself a tmpfs here")
    monkeypatch.setenv("PLESTORE_SHM_DIR", str(tmp_path / "disk-shm"))
    with pytest.raises(ValueError, match="needs a tmpfs.*PLESTORE_SHM_DIR"):
        plestore.open_table(path, tier="pinned", device="cuda", share="node")
