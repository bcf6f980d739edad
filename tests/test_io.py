"""Block reads (io/blockreader.py, io/uring.py): started reads finish with exactly the file's
bytes on both engines, at any count vs queue depth; failures raise from finish() and leave the
reader usable."""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import requires_cuda
from plestore.io.blockreader import BlockReader
from plestore.io.memory import HostBuffer
from plestore.io.uring import uring_available

UNIT = 4096
ENGINES = [
    pytest.param(
        "io_uring",
        marks=pytest.mark.skipif(not uring_available(), reason="io_uring unavailable here"),
    ),
    "threads",
]


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "blocks"
    data = np.random.default_rng(0).integers(0, 256, 64 * UNIT, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    return path, data.reshape(64, UNIT)


def _buffer(n: int) -> tuple[HostBuffer, np.ndarray]:
    buf = HostBuffer(n * UNIT)  # page-aligned, as O_DIRECT needs
    return buf, buf.array.reshape(n, UNIT)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("queue_depth", [1, 4, 128])  # fewer, and more, than the reads
@pytest.mark.parametrize("submit", [True, False])  # reads handed to the kernel now / at finish
def test_started_reads_finish_with_the_files_bytes(data_file, engine, queue_depth, submit):
    path, data = data_file
    blocks = np.array([63, 0, 17, 17, 5, 40, 2, 33, 8, 1])
    with_buf, out = _buffer(len(blocks))
    reader = BlockReader(path, UNIT, engine=engine, queue_depth=queue_depth)
    try:
        handle = reader.start(blocks * UNIT, out, submit)  # the disk may work meanwhile
        reader.finish(handle)
        np.testing.assert_array_equal(out, data[blocks])
        out[:] = 0
        reader.read(blocks[::-1] * UNIT, out)  # read() = start + finish
        np.testing.assert_array_equal(out, data[blocks[::-1]])
    finally:
        reader.close()
        with_buf.close()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("submit", [True, False])
def test_a_short_read_raises_from_finish_and_the_reader_keeps_working(data_file, engine, submit):
    path, data = data_file
    buf, out = _buffer(4)
    reader = BlockReader(path, UNIT, engine=engine)
    try:
        os.truncate(path, 10 * UNIT)  # blocks 10.. are gone
        handle = reader.start(np.array([1, 12, 3, 2]) * UNIT, out, submit)
        with pytest.raises(OSError, match="short read"):
            reader.finish(handle)
        reader.read(np.array([9, 0]) * UNIT, out)  # the ring/pool is free again
        np.testing.assert_array_equal(out[:2], data[[9, 0]])
    finally:
        reader.close()
        buf.close()


@pytest.mark.skipif(not uring_available(), reason="io_uring unavailable here")
def test_a_batch_finishes_once(data_file):
    path, _ = data_file
    buf, out = _buffer(2)
    reader = BlockReader(path, UNIT, engine="io_uring")
    try:
        handle = reader.start(np.array([0, 1]) * UNIT, out)
        reader.finish(handle)
        with pytest.raises(RuntimeError, match="already finished"):
            reader.finish(handle)
    finally:
        reader.close()
        buf.close()


@pytest.mark.skipif(not uring_available(), reason="io_uring unavailable here")
def test_the_ring_wraps_around_its_entries(data_file):
    """Batches that do not fill the ring move its tail past the end of the entry array: each
    one still reads exactly its blocks."""
    path, data = data_file
    buf, out = _buffer(48)
    reader = BlockReader(path, UNIT, engine="io_uring", queue_depth=48)  # a 64-entry ring
    rng = np.random.default_rng(1)
    try:
        for _ in range(10):  # 10 x 48 reads: the tail wraps 7 times, mostly mid-batch
            blocks = rng.integers(0, 64, 48)
            reader.read(blocks * UNIT, out)
            np.testing.assert_array_equal(out, data[blocks])
    finally:
        reader.close()
        buf.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_unit_may_end_past_the_end_of_the_file(tmp_path, engine):
    """A unit the file ends inside returns the bytes there are (a table's last rows: their
    read unit is aligned, the file need not be); a unit that starts outside it is an error."""
    data = np.random.default_rng(2).integers(0, 256, 5 * UNIT + 700, dtype=np.uint8)
    path = tmp_path / "ragged"
    path.write_bytes(data.tobytes())
    buf, out = _buffer(3)
    reader = BlockReader(path, UNIT, engine=engine)
    try:
        reader.read(np.array([5, 0, 4]) * UNIT, out)
        np.testing.assert_array_equal(out[0, :700], data[5 * UNIT :])
        np.testing.assert_array_equal(
            out[1:].reshape(-1), np.r_[data[:UNIT], data[4 * UNIT : 5 * UNIT]]
        )
        with pytest.raises(ValueError, match=f"offset {6 * UNIT} is past the end"):
            reader.start(np.array([1, 6]) * UNIT, out)
    finally:
        reader.close()
        buf.close()


@pytest.mark.skipif(not uring_available(), reason="io_uring unavailable here")
def test_a_failed_io_uring_enter_leaves_the_ring_clean(data_file, monkeypatch):
    """io_uring_enter failing mid-batch (injected EAGAIN): the reads the kernel took are waited
    for and the entries it did not take are dropped, so the next batch reads exactly its own
    blocks (no stale entry submitted with it, no stray completion counted as its own). If even
    that wait fails, the ring refuses further batches rather than risk late writes."""
    import errno

    import plestore.io.uring as uring

    path, data = data_file
    buf, out = _buffer(8)
    reader = BlockReader(path, UNIT, engine="io_uring")
    real, fail = uring._syscall, []  # conditions (to_submit, min_complete) for the next EAGAINs

    def flaky(nr, fd, to_submit, min_complete, *rest):
        if fail and fail[0](to_submit, min_complete):
            fail.pop(0)
            raise OSError(errno.EAGAIN, "injected")
        return real(nr, fd, to_submit, min_complete, *rest)

    monkeypatch.setattr(uring, "_syscall", flaky)
    waits, submits = (lambda s, w: w > 0), (lambda s, w: s > 0)
    try:
        fail[:] = [waits]  # the wait fails with the reads in flight
        with pytest.raises(OSError, match="injected"):
            reader.read(np.arange(8) * UNIT, out)
        fail[:] = [submits]  # the submission fails: the kernel took none
        with pytest.raises(OSError, match="injected"):
            reader.read(np.arange(8, 16) * UNIT, out)
        out[:] = 0
        blocks = np.array([40, 3, 9, 63, 0, 21, 5, 17])
        reader.read(blocks * UNIT, out)
        np.testing.assert_array_equal(out, data[blocks])
        fail[:] = [waits, waits]  # the wait fails, and so does the wait for its reads
        with pytest.raises(OSError, match="injected"):
            reader.read(blocks * UNIT, out)
        with pytest.raises(OSError, match="unusable"):
            reader.read(blocks * UNIT, out)
    finally:
        reader.close()
        buf.close()


@requires_cuda
@pytest.mark.gpu
def test_a_failed_registration_leaves_torch_no_stale_cuda_error():
    """cudaHostRegister's failure is raised here, clearly, and not again by torch's next kernel
    launch (which reads the thread's last CUDA error)."""
    import torch

    buf = HostBuffer(1 << 20, pin=True)
    try:
        with pytest.raises(RuntimeError, match="cudaHostRegister of 1048576 bytes failed"):
            buf._register()  # the same pages again: CUDA refuses
        assert torch.ones(8, device="cuda").sum().item() == 8
    finally:
        buf.close()
