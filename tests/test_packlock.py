"""One packer per output directory: concurrent packs of a table wait for the first and reuse
its table; a holder that makes no progress is a TimeoutError naming it; a killed holder's lock
is free at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from slow_pack import slow_pack

from plestore.tablefile import TableFile
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
