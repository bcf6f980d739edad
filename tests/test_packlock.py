"""One packer per output directory: concurrent packs of a table wait for the first and reuse
its table, or refuse it if it came from another checkpoint; a holder that makes no progress is a
TimeoutError naming it; a killed holder's lock is free at once."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
from slow_pack import slow_pack

import plestore.tablefile.pack as pack_module
from plestore.tablefile import TableFile, TableFileError
from plestore.tablefile.pack import pack_checkpoint
from plestore.tablefile.packlock import LOCK_NAME, pack_lock

QWEN = "qwen3.8-flash-next"

_HOLD = """
import sys, time
from plestore.tablefile.packlock import pack_lock
with pack_lock(sys.argv[1], 60):
    print("held", flush=True)
    time.sleep(60)
"""


def _holder(out):
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(out)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_pack_waits_for_the_first_and_reuses_its_table(small_checkpoint, tmp_path):
    ck_dir = small_checkpoint(QWEN, "bf16")
    cmd = slow_pack(ck_dir, tmp_path, 0.02, "--batch-mib", "0.25")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 30
        while not list(tmp_path.glob(".ple.layers.1.rows.tmp-*")):  # the first is packing
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
            time.sleep(0.01)
        rep = pack_checkpoint(ck_dir, tmp_path, lock_timeout_s=10)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == 0, proc.stderr.read()
    assert rep.reused and rep.bytes_written == 0  # it waited, then found the table done
    assert TableFile.open(tmp_path).verify().ok


def test_a_table_another_checkpoint_packed_while_waiting_is_refused(
    small_checkpoint, tmp_path, monkeypatch
):
    """The refusal is checked under the lock: a table that landed while this pack waited (the
    holder's, from another checkpoint) is not replaced."""
    a, b = small_checkpoint(QWEN, "bf16"), small_checkpoint(QWEN, "bf16", seed=1)
    packed_a, out = tmp_path / "a", tmp_path / "out"
    pack_checkpoint(a, packed_a)
    waiting = threading.Event()

    @contextlib.contextmanager
    def lock(*args):
        waiting.set()  # past everything pack does before it takes the lock
        with pack_lock(*args):
            yield

    monkeypatch.setattr(pack_module, "pack_lock", lock)
    out.mkdir()
    holder, errors = _holder(out), []
    try:

        def pack_b():
            try:
                pack_checkpoint(b, out, lock_timeout_s=30)
            except TableFileError as e:
                errors.append(e)

        thread = threading.Thread(target=pack_b)
        thread.start()
        assert waiting.wait(30)
        for suffix in (".rows", ".crc", ".json"):  # the holder's table lands (metadata last)
            shutil.copy(packed_a / f"ple.layers.1{suffix}", out)
    finally:
        holder.kill()
        holder.wait()
    thread.join(60)
    assert len(errors) == 1 and "another checkpoint" in str(errors[0]), errors
    mine = TableFile.open(packed_a).source["fingerprint"]
    assert TableFile.open(out).source["fingerprint"] == mine and TableFile.open(out).verify().ok


def test_a_holder_without_progress_times_out_naming_it(small_checkpoint, tmp_path):
    ck_dir = small_checkpoint(QWEN, "bf16")
    proc = _holder(tmp_path)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=f"pid {proc.pid}.*no progress for 0.3 s"):
            pack_checkpoint(ck_dir, tmp_path, lock_timeout_s=0.3)
        assert time.monotonic() - t0 < 5
        assert not list(tmp_path.glob("*.json"))  # nothing written while waiting
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_holders_lock_is_free(tmp_path):
    proc = _holder(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    t0 = time.monotonic()
    with pack_lock(tmp_path, 0.2):
        assert (tmp_path / LOCK_NAME).read_text() == str(os.getpid())
    assert time.monotonic() - t0 < 1


def test_the_lock_file_goes_with_its_holder_and_a_waiter_locks_a_new_one(tmp_path):
    """No pack leaves .plestore-pack.lock behind; a waiter that had opened the removed file
    does not hold a lock no one else sees (try_lock checks the name)."""
    import fcntl

    from plestore.io.locks import open_lock, try_lock

    path = str(tmp_path / LOCK_NAME)
    with pack_lock(tmp_path, 1.0):
        assert os.path.exists(path) and try_lock(path) is None
        early = open_lock(path)  # a waiter between its open and its flock
    assert not os.path.exists(path)
    fcntl.flock(early, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (a lock on the removed file)
    fd = try_lock(path)
    assert fd is not None and os.fstat(fd).st_ino != os.fstat(early).st_ino
    os.close(fd)
    os.close(early)
