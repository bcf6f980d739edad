"""Write-behind: ranges are flushed behind a sequential writer without changing what it wrote."""

from __future__ import annotations

import os
import sys

import pytest

from plestore.io.writeback import WriteBehind


@pytest.mark.skipif(sys.platform != "linux", reason="sync_file_range is Linux-only")
def test_flushes_behind_and_keeps_the_bytes(tmp_path):
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    wb = WriteBehind(fd, start=0, chunk_bytes=8192, depth=2)
    assert wb.enabled
    data = os.urandom(100_000)
    for off in range(0, len(data), 3000):
        os.pwrite(fd, data[off : off + 3000], off)
        wb.written(min(off + 3000, len(data)))
        assert len(wb._inflight) <= 2
    assert wb._flushed > len(data) - 8192  # writeback was started for all but the last chunk
    os.close(fd)
    assert path.read_bytes() == data


def test_unsupported_file_turns_it_off():
    r, w = os.pipe()  # sync_file_range on a pipe: ESPIPE
    try:
        wb = WriteBehind(w, chunk_bytes=1)
        os.write(w, b"xy")
        wb.written(2)
        assert not wb.enabled
    finally:
        os.close(r)
        os.close(w)
