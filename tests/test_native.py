"""The native host core (plestore.native) against its numpy references: id checks, gathers of
every layout (past 2^31 bytes of offset too), the direct tier's one-call read, the GPU row
cache directory's probe and admission; selection by
TableOptions.native / PLESTORE_NATIVE and the announced fallback. The tier conformance suites
run under both host paths as well (tests/conftest.py: HOST_CORES)."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import plestore
from conftest import assert_bit_identical, requires_native
from plestore import native
from plestore.formats import get_format
from plestore.options import TableOptions
from plestore.spec import RowLayout, TableSpec
from plestore.tablefile import TableWriter

reference = native.load("off")  # the numpy reference
core = native.load("on") if native.available() else None  # the compiled core, where built
#: both host cores, for the calls whose results each must give
CORES = [
    pytest.param(reference, id="reference"),
    pytest.param(core, id="compiled", marks=requires_native),
]


def _make_table(path, fmt_name, dim, rows, block):
    """A real table file of encoded rows; (its dir, every row decoded [rows, dim])."""
    fmt = get_format(fmt_name)
    x = np.random.default_rng(0).standard_normal((rows, dim)).astype(np.float32)
    enc = fmt.encode(x)
    spec = TableSpec(name="t", rows=rows, dim=dim, format=fmt_name, scale=enc.scale, heads=4)
    with TableWriter(path, spec, RowLayout(spec.row_bytes, block_bytes=block)) as w:
        w.write_rows(enc.rows)
        w.commit()
    return path, fmt.decode(enc.rows, scale=enc.scale)


def _run_python(code: str) -> None:
    """Run `code` in a fresh interpreter on this one's path; fail with its stderr."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
    assert run.returncode == 0, run.stderr.decode()[-2000:]


def _want(ref, ids):
    return ref[np.asarray(ids).reshape(-1)].reshape(*np.asarray(ids).shape[:-1], -1)


@pytest.mark.parametrize("host", CORES)
def test_check_ids_finds_the_first_id_out_of_range(host):
    rng = np.random.default_rng(0)
    for n in (0, 1, 17, 70_000):  # (past 65,536: without the GIL)
        ids = rng.integers(0, 1000, n)
        assert host.check_ids(ids, 1000) == -1
        if n:
            for bad in (-1, 1000, np.iinfo(np.int64).min, np.iinfo(np.int64).max):
                ids2 = ids.copy()
                at = sorted(rng.choice(n, min(n, 3), replace=False))
                ids2[at] = bad
                assert host.check_ids(ids2, 1000) == at[0]
    with pytest.raises(ValueError, match="int64"):
        host.check_ids(np.zeros(4, np.int32), 10)


@pytest.mark.parametrize("host", CORES)
@pytest.mark.parametrize("block", [0, 512, 4096])
@pytest.mark.parametrize("row_bytes, stride", [(90, 96), (160, 160), (896, 896)])
@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("streaming", [False, True])
def test_gather_matches_the_layouts_offsets(host, block, row_bytes, stride, threads, streaming):
    """streaming (non-temporal stores) writes the same rows; it zeroes their padding in out."""
    lay = RowLayout(row_bytes, stride, block)
    rows = 3000
    src = np.random.default_rng(1).integers(0, 256, 16 + lay.data_bytes(rows), np.uint8)
    ids = np.random.default_rng(2).integers(0, rows, 5000)
    width = row_bytes + 7  # wider than a row: untouched, or zeroed when streaming
    store = np.full(len(ids) * width + 1, 0xEE, np.uint8)
    out = store[1:].reshape(-1, width)  # (unaligned: the stores' ends are not 16-B chunks)
    want_offs = 16 + lay.offsets(ids)
    want = src[want_offs[:, None] + np.arange(row_bytes)]
    rpb, blk, st = native.layout_rule(lay)
    bad, *_ = host.gather(src, ids, out, width, row_bytes, 0, rpb, blk, st, threads,
                          grain=64, src_offset=16, streaming=streaming)  # fmt: skip
    assert bad == -1
    assert np.array_equal(out[:, :row_bytes], want) and store[0] == 0xEE
    assert (out[:, row_bytes:] == (0 if streaming else 0xEE)).all()
    tight = np.full(len(ids) * width - 7, 0xEE, np.uint8)  # the last row's padding not in out
    host.gather(src, ids, tight, width, row_bytes, 0, rpb, blk, st, threads, streaming=streaming,
                src_offset=16)  # fmt: skip
    assert np.array_equal(tight, out.reshape(-1)[:-7])
    ids[1234] = rows + 10**6  # past the source: named, never read
    bad, *_ = host.gather(src, ids, out, width, row_bytes, 0, rpb, blk, st, threads,
                          streaming=streaming)  # fmt: skip
    assert bad == 1234


@pytest.mark.parametrize("host", CORES)
@pytest.mark.parametrize("threads, grain", [(1, 64), (4, 1), (4, 333), (4, 4096)])
@pytest.mark.parametrize("streaming", [False, True])
def test_gather_started_hands_over_rows_in_order(host, threads, grain, streaming):
    """gather_start: each wait(k) returns with out's first k rows written (the later ones may
    still be in flight), finish() with every row and gather()'s result; a bad id is named by
    the first wait that passes it (or an earlier one, found by then), every other row still
    written."""
    lay = RowLayout(90, 96, 512)
    rows = 5000
    src = np.random.default_rng(3).integers(0, 256, lay.data_bytes(rows), np.uint8)
    ids = np.random.default_rng(4).integers(0, rows, 20000)
    want = src[lay.offsets(ids)[:, None] + np.arange(90)]
    rpb, blk, st = native.layout_rule(lay)
    args = (src, ids, None, 96, 90, 0, rpb, blk, st, threads)
    out = np.zeros((ids.size, 96), np.uint8)
    job = host.gather_start(*args[:2], out, *args[3:], grain=grain, streaming=streaming)
    for k in (0, 1, 700, 8191, 8192, 19999, 20000, 10**9):
        assert job.wait(k) == -1
        assert np.array_equal(out[: min(k, ids.size), :90], want[: min(k, ids.size)])
    assert job.finish() == host.gather(src, ids, np.empty_like(out), *args[3:])
    assert job.finish()[0] == -1 and np.array_equal(out[:, :90], want)  # (finished: the same)
    ids[12345] = rows  # past the table
    out[:] = 0
    job = host.gather_start(*args[:2], out, *args[3:], grain=grain, streaming=streaming)
    assert job.wait(12345) in (-1, 12345) and job.wait(12346) == 12345  # (found so far)
    assert job.finish()[0] == 12345
    ok = np.arange(ids.size) != 12345
    assert np.array_equal(out[ok, :90], want[ok]) and not out[12345].any()


@pytest.mark.parametrize("host", CORES)
def test_gathers_started_side_by_side_and_abandoned(host):
    """A second gather started while one runs has no pool: it runs in its caller, as waited
    for; a job dropped unfinished is finished first (no write after its buffers are gone)."""
    src = np.random.default_rng(5).integers(0, 256, 160 * 4000, np.uint8)
    ids = np.random.default_rng(6).integers(0, 4000, 30000)
    want = src.reshape(4000, 160)[ids]
    outs = [np.zeros((ids.size, 160), np.uint8) for _ in range(3)]
    first = host.gather_start(src, ids, outs[0], 160, 160, 0, 1, 160, 160, 4, grain=256)
    second = host.gather_start(src, ids, outs[1], 160, 160, 0, 1, 160, 160, 4, grain=256)
    assert second.wait(5000) == -1 and np.array_equal(outs[1][:5000], want[:5000])
    assert first.finish()[0] == -1 and second.finish()[0] == -1
    assert np.array_equal(outs[0], want) and np.array_equal(outs[1], want)
    third = host.gather_start(src, ids, outs[2], 160, 160, 0, 1, 160, 160, 4, grain=16)
    del third  # finished by its deallocation
    assert np.array_equal(outs[2], want)
    assert host.gather(src, ids, outs[0], 160, 160, 0, 1, 160, 160, 4)[0] == -1  # the pool: free
    with pytest.raises(ValueError, match="too small"):
        host.gather_start(src, ids, outs[0][:10], 160, 160, 0, 1, 160, 160, 4)


@requires_native
def test_gather_started_survives_a_fork_and_any_grain():
    """A child forked while a job runs on the pool finishes it alone (the parent's pool threads
    are not there: every row still written, in the child and the parent); a grain past the
    row count is one piece."""
    src = np.random.default_rng(7).integers(0, 256, 160 * 4000, np.uint8)
    ids = np.random.default_rng(8).integers(0, 4000, 400_000)
    want = src.reshape(4000, 160)[ids]
    out = np.zeros_like(want)
    job = core.gather_start(src, ids, out, 160, 160, 0, 1, 160, 160, 4, grain=256)
    pid = os.fork()
    if pid == 0:  # the child: a hang ends it by SIGALRM, any error by its exit status
        code = 2
        try:
            signal.alarm(30)
            code = 0 if job.finish()[0] == -1 and np.array_equal(out, want) else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert job.finish()[0] == -1 and np.array_equal(out, want)
    for grain in (2**62, 10**6, 0, -5):
        out[:] = 0
        job = core.gather_start(src, ids, out, 160, 160, 0, 1, 160, 160, 4, grain=grain)
        assert job.wait(ids.size) == -1 and np.array_equal(out, want), grain
        job.finish()


@pytest.mark.parametrize("host", CORES)
@pytest.mark.parametrize("block, stride", [(0, 160), (512, 160)])
def test_gather_names_ids_whose_offset_would_wrap_past_2_63(host, block, stride):
    """An id so large that its byte offset wraps int64 into the source is named, never read
    (pinned's Python path raises for it too): 2^59 rows of 160 B is 5 * 2^64 bytes."""
    lay = RowLayout(160, stride, block)
    src = np.arange(lay.data_bytes(300), dtype=np.int64).astype(np.uint8)
    rpb, blk, st = native.layout_rule(lay)
    wrap = 2**59 if not block else 3 * 2**55  # offset = 2^64 * k: row 0's bytes, wrapped
    for ids in ([wrap + 1, 2], [2, wrap], [-wrap, 1], [2, -(2**63)]):
        out = np.zeros((2, 160), np.uint8)
        bad, *_ = host.gather(src, np.array(ids, np.int64), out, 160, 160, 0, rpb, blk, st)
        assert bad == [i for i, x in enumerate(ids) if not 0 <= x < 300][0], ids
    out = np.zeros((1, 160), np.uint8)  # a base above 0: id - base never wraps either
    assert host.gather(src, np.array([-(2**63)], np.int64), out, 160, 160, 5, 1, 160, 160)[0] == 0


@pytest.mark.parametrize("host", CORES)
def test_gather_reads_past_2_31_bytes_of_a_mapping(host, tmp_path):
    """int64 offsets all the way: rows of a sparse 3 GiB file, beyond 2^31 and 2^32 bytes."""
    f = tmp_path / "big.rows"
    size, rb = 3 << 30, 96
    at = np.array([0, (1 << 31) - rb // 2, (1 << 31) + 4096, (1 << 32) - 8, size - rb], np.int64)
    at -= at % rb
    with open(f, "wb") as fh:
        fh.truncate(size)
        for k, off in enumerate(at.tolist()):
            fh.seek(off)
            fh.write(bytes([k + 1]) * rb)
    fd = os.open(f, os.O_RDONLY)
    try:
        m = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
        ids = at // rb  # rows back to back: offset = id * rb
        out = np.zeros((len(ids), rb), np.uint8)
        bad, *_ = host.gather(m, ids, out, rb, rb, 0, 1, rb, rb, 2, grain=1, count_faults=True)
        assert bad == -1
        assert np.array_equal(out, np.repeat(np.arange(1, 6, dtype=np.uint8)[:, None], rb, 1))
        m.close()
    finally:
        os.close(fd)


@pytest.mark.parametrize("host", CORES)
def test_check_file_sees_truncation_removal_and_replacement(host, tmp_path):
    """The mapped tier's per-read file check in the core: each state as one fstat sees it (its
    size, link count and change time against those last seen); through the tier, each raises
    its message under both host paths."""
    f = tmp_path / "data"
    f.write_bytes(bytes(8192))
    fd = os.open(f, os.O_RDONLY)
    try:

        def seen():
            st = os.fstat(fd)
            return st.st_nlink, st.st_ctime_ns

        assert host.check_file(fd, 8192, *seen()) == 0
        assert host.check_file(fd, 8193, *seen()) == 1
        nlink, ctime = seen()
        assert host.check_file(fd, 8192, nlink + 1, ctime) == 3
        assert host.check_file(fd, 8192, nlink, ctime + 1) == 3
        os.truncate(f, 4096)
        assert host.check_file(fd, 8192, *seen()) == 1
        os.truncate(f, 16384)  # longer than mapped: still readable
        assert host.check_file(fd, 8192, *seen()) == 0
        (tmp_path / "new").write_bytes(bytes(8192))
        os.replace(tmp_path / "new", f)
        assert host.check_file(fd, 8192, *seen()) == 2
        assert host.check_file(-1, 0, 0, 0) == -errno.EBADF
    finally:
        os.close(fd)
    for mode in ("on", "off"):
        path, ref = _make_table(tmp_path / mode, "fp8_e4m3", 160, rows=3000, block=512)
        data = next((tmp_path / mode).glob("*.rows"))
        ids = np.array([[0, 2999]])
        with plestore.open_table(path, tier="mapped", device="cpu", native=mode) as t:
            assert_bit_identical(t.lookup(ids), _want(ref, ids))
            saved = data.read_bytes()
            os.truncate(data, len(saved) - 1)
            with pytest.raises(OSError, match="truncated"):
                t.lookup(ids)
            data.unlink()
            with pytest.raises(OSError, match="removed"):
                t.lookup(ids)


def _resident(m: mmap.mmap, pages: np.ndarray) -> np.ndarray:
    """Whether each page of mapping m is in the page cache (mincore)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    base = np.frombuffer(m, np.uint8).ctypes.data
    vec = ctypes.c_ubyte()
    out = []
    for p in pages.tolist():
        at = ctypes.c_void_p(base + p * mmap.PAGESIZE)
        assert libc.mincore(at, mmap.PAGESIZE, ctypes.byref(vec)) == 0
        out.append(bool(vec.value & 1))
    return np.array(out)


@pytest.mark.parametrize("host", CORES)
def test_willneed_advises_the_rows_pages_or_nothing_when_a_sample_is_resident(host, tmp_path):
    """The mapped tier's cold hint in the core: after it every page the rows touch is in the
    page cache (evicted first where the file system lets go); with a probe, rows whose sample
    is resident get -1 and nothing more; rows outside the mapping are left out (the read
    raises for them), and bad layouts or ids are refused."""
    f = tmp_path / "data"
    f.write_bytes(np.random.default_rng(0).bytes(64 * mmap.PAGESIZE))
    fd = os.open(f, os.O_RDONLY)
    m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    try:
        rb, off = 90, 4096  # 90-B rows in 512-B blocks of 5, after a 4 KiB header
        args = (rb, 0, 5, 512, 96, off)
        ids = np.array([3, 41, 42, 300, 301, 7 * 5 + 4, 10**12, -1, 2**62], np.int64)
        lay = [(i // 5) * 512 + (i % 5) * 96 + off for i in ids[:6]]
        pages = np.unique([p // mmap.PAGESIZE for o in lay for p in (o, o + rb - 1)])
        os.fsync(fd)  # (dirty pages stay in the page cache)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        evicted = not _resident(m, pages).any()  # (some file systems keep them)
        assert host.willneed(m, ids, *args, 4 if evicted else 0) >= 0  # a cold sample: advised
        for _ in range(200):  # the reads are in flight: wait for them
            if _resident(m, pages).all():
                break
            time.sleep(0.01)
        assert _resident(m, pages).all()
        assert host.willneed(m, ids[:6], *args, 4) == -1  # sample resident: nothing advised
        assert host.willneed(m, ids[6:], *args, 4) == -1  # nothing in range
        for bad in (
            (0, 512, 96),
            (5, 512, 2**62),
            (5, 512, 64),
            (6, 512, 96),
        ):  # rpb, block, stride
            with pytest.raises(ValueError, match="layout"):
                host.willneed(m, ids, rb, 0, *bad, off, 0)
            with pytest.raises(ValueError, match="layout"):
                host.gather(m, ids, np.empty((ids.size, rb), np.uint8), rb, rb, 0, *bad)
        with pytest.raises(ValueError, match="int64"):
            host.willneed(m, ids.astype(np.int32), *args, 0)
    finally:
        m.close()
        os.close(fd)


@requires_native
@pytest.mark.parametrize("block", [512, 0])
def test_direct_core_matches_the_python_path_cold_warm_and_ahead(tmp_path, block):
    """The direct tier's one-call read returns the Python path's rows and counts: cold (every
    block read, each once), after a prefetch (read there, collected here), and warm (cache)."""
    path, ref = _make_table(tmp_path, "nvfp4", 160, rows=5000, block=block)
    rng = np.random.default_rng(3)
    seen = {}
    for mode in ("off", "on"):
        with plestore.open_table(path, tier="direct", device="cpu", native=mode) as t:
            compiled = not isinstance(t.tier._core, reference.DirectCore)
            assert compiled == (mode == "on" and t.tier.engine == "io_uring")
            calls = []  # (cache hits, blocks read) per lookup
            for step in range(6):
                ids = rng.integers(0, 5000, (4, 16)) if step % 3 else np.arange(64).reshape(4, 16)
                label = f"s{step}"
                if step % 2:  # started at prefetch, collected at result()
                    got = t.prefetch(ids, label=label).result()
                else:
                    got = t.lookup(ids, label=label)
                assert_bit_identical(got, _want(ref, ids))
                ph = t.stats()["phases"][label]
                calls.append((ph["cache_hits"], ph["blocks_read"]))
            seen[mode] = calls
        rng = np.random.default_rng(3)
    assert seen["on"] == seen["off"]


@pytest.mark.parametrize("mode", ["off", pytest.param("on", marks=requires_native)])
def test_a_read_of_cached_rows_collects_the_prefetch_in_flight(tmp_path, mode):
    """Both cores: a read whose rows all hit the row cache still collects the reads a prefetch
    started (none stays in flight into the buffers), and the prefetched rows read exact."""
    path, ref = _make_table(tmp_path, "nvfp4", 160, rows=5000, block=512)
    cached, ahead = np.arange(64).reshape(4, 16), np.arange(3000, 3064).reshape(4, 16)
    with plestore.open_table(path, tier="direct", device="cpu", native=mode) as t:
        t.lookup(cached)  # admitted
        t.tier.prefetch(ahead.reshape(-1))
        assert_bit_identical(t.lookup(cached), _want(ref, cached))
        assert t.stats()["last_call"]["cache_hits"] == 64
        assert not t.tier.reads_in_flight
        assert_bit_identical(t.lookup(ahead), _want(ref, ahead))


def test_the_reference_direct_read_prefetches_on_one_thread_without_deadlock(tmp_path):
    """The reference's prefetch on a pool of one thread and a queue of one: its reads are the
    pool's own tasks, never a task waiting on another (a fresh process: a deadlock would
    leave a pool thread behind)."""
    path, _ = _make_table(tmp_path, "nvfp4", 160, rows=5000, block=512)
    code = f"""
import numpy as np, plestore, torch
with plestore.open_table({str(path)!r}, tier="direct", device="cpu", native="off", threads=1,
                         queue_depth=1) as t:
    ids = np.arange(100, 164).reshape(4, 16)
    assert torch.equal(t.prefetch(ids).result(), t.lookup(ids))
    t.tier.prefetch(ids.reshape(-1) + 1000)
    t.lookup(ids + 2000)
"""
    _run_python(code)


@requires_native
@pytest.mark.parametrize("tier", ["pinned", "mapped", "direct"])
def test_lookup_of_strided_ids_reads_the_rows_under_the_native_core(tmp_path, tier):
    """Ids as a strided 1-D view (numpy or torch: reshape(-1) keeps the view) are the same
    lookup as their contiguous copy, not a 'C-contiguous buffer' error from the core."""
    path, ref = _make_table(tmp_path, "fp8_e4m3", 160, rows=3000, block=512)
    base = np.arange(2900, 2980)
    with plestore.open_table(path, tier=tier, device="cpu", native="on") as t:
        for ids in (base[::2], base[::-3], torch.from_numpy(base)[::2]):
            assert_bit_identical(t.lookup(ids), _want(ref, np.asarray(ids)[None])[0])


@requires_native
def test_direct_core_reports_short_reads_and_recovers(tmp_path):
    path, ref = _make_table(tmp_path, "fp8_e4m3", 160, rows=3000, block=512)
    data = next(tmp_path.glob("*.rows"))
    saved = data.read_bytes()
    ids = np.array([[0, 1, 2999, 2998]])
    with plestore.open_table(path, tier="direct", device="cpu", cache_bytes=0, native="on") as t:
        if t.tier._core is None:
            pytest.skip("io_uring unavailable here")
        os.truncate(data, len(saved) // 2)
        with pytest.raises(OSError, match="short read at offset") as e:
            t.lookup(ids)
        assert e.value.errno == errno.EIO
        data.write_bytes(saved)
        assert_bit_identical(t.lookup(ids), _want(ref, ids))
    path, ref = _make_table(tmp_path / "u", "fp8_e4m3", 160, rows=3000, block=0)
    data = next((tmp_path / "u").glob("*.rows"))
    saved = data.read_bytes()
    with plestore.open_table(path, tier="direct", device="cpu", cache_bytes=0, native="on") as t:
        os.truncate(data, len(saved) - 100)  # inside the last unit, which the file ends in
        with pytest.raises(OSError, match="short read") as e:
            t.lookup(np.array([[2999]]))
        at, got, want = map(int, re.search(r"offset (\d+): (\d+) of (\d+)", str(e.value)).groups())
        assert (got, want) == (len(saved) - 100 - at, min(t.tier.unit, len(saved) - at))
        data.write_bytes(saved)
        assert_bit_identical(t.lookup(ids), _want(ref, ids))


@requires_native
def test_direct_core_closed_by_another_thread_mid_read_raises_not_crashes(tmp_path):
    """close() racing read() on another thread: the read runs before the close or finds the
    core closed (RuntimeError); never a freed ring (this crashed the process: its own one)."""
    path, _ = _make_table(tmp_path, "fp8_e4m3", 160, rows=3000, block=512)
    code = f"""
import threading, numpy as np, plestore
for _ in range(150):
    t = plestore.open_table({str(path)!r}, tier="direct", device="cpu", native="on",
                            cache_bytes=0)
    core, ids = t.tier._core, np.arange(0, 3000, 7)
    if core is None:
        break  # io_uring unavailable here
    out = np.zeros((len(ids), t.tier.staging_stride), np.uint8)
    def reader():
        for _ in range(50):
            try:
                core.read(ids, out, out.shape[1], 1)
            except RuntimeError:
                return
    th = threading.Thread(target=reader)
    th.start()
    core.close()
    th.join()
    t.close()
"""
    _run_python(code)


@pytest.mark.parametrize("host", CORES)
@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("rows", [0, 1, 37])
def test_recode_nvfp4_maps_each_symbol_and_counts_it(host, width, rows):
    """Symbol (block-scale byte << 8 | code byte) r, b * 8 + k -> lut[symbol]; counts add up."""
    rng = np.random.default_rng(width * 100 + rows)
    dim = 32
    raw = rng.integers(0, 256, (rows, dim // 2 + dim // 16), dtype=np.uint8)
    lut = rng.integers(0, 256, (65536, width), dtype=np.uint8)
    codes, scales = raw[:, : dim // 2].reshape(rows, 2, 8), raw[:, dim // 2 :]
    sym = ((scales.astype(np.int64)[:, :, None] << 8) | codes).reshape(rows, dim // 2)
    out = np.zeros((rows, dim // 2 * width), np.uint8)
    counts = np.full(65536, 3, np.int64)  # added to, not replaced
    host.recode_nvfp4(raw, dim, lut, out, counts)
    assert_bit_identical(out, lut[sym].reshape(rows, dim // 2 * width))
    assert_bit_identical(counts, 3 + np.bincount(sym.reshape(-1), minlength=65536))


@pytest.mark.parametrize("host", CORES)
def test_recode_nvfp4_refuses_buffers_of_other_sizes(host):
    raw, lut = np.zeros((2, 18), np.uint8), np.zeros((65536, 2), np.uint8)
    out, counts = np.zeros((2, 32), np.uint8), np.zeros(65536, np.int64)
    host.recode_nvfp4(raw, 16, lut, out, counts)  # (the sizes that fit)
    bad = [
        (raw[:, :17].copy(), 16, lut, out, counts),  # not rows of dim 16
        (raw, 24, lut, out, counts),  # dim not a multiple of 16
        (raw, 16, lut[:, :1].repeat(3, 1), out, counts),  # 3 B symbols
        (raw, 16, lut, out[:, :31].copy(), counts),
        (raw, 16, lut, out, counts.astype(np.int32)),
        (raw, 16, lut, out, counts[:100].copy()),
    ]
    for args in bad:
        with pytest.raises(ValueError):
            host.recode_nvfp4(*args)


@requires_native
@pytest.mark.parametrize("static, resident", [(0, (0, 0)), (3000, (0, 0)), (3000, (100, 400))])
# 512 / 8,192 sets of 8 ways; 3,001 of 6 (a set count no power of two, ways no multiple of 4)
@pytest.mark.parametrize("dynamic, ways, admit_min", [(4096, 8, 2), (65536, 8, 1), (18006, 6, 2)])
def test_cache_directory_probe_matches_numpy(static, resident, dynamic, ways, admit_min):
    """Slots, recency stamps, frequency counts (saturating, aged) and so every admission: the
    native probe (on one thread, and past 2,048 ids on the pool) and the reference's (numpy),
    step for step over
    a Zipf stream (admitted at a second or a first miss; sets sorted in one radix pass or two)."""
    from plestore.lookup.gpudirectory import GpuCacheDirectory

    rng = np.random.default_rng(5)
    hot = rng.permutation(200_000)[:static]
    dirs = [
        GpuCacheDirectory(hot, dynamic, ways, admit_min, resident=resident, core=c, threads=k)
        for c, k in ((reference, 1), (core, 1), (core, 4))
    ]
    for d in dirs:
        d.age_every = 50_000  # several halvings within the test
        d.sketch[d._sketch_index(np.arange(3))] = 29_999  # rows 0-2: at the saturation point
    clamped = False
    for step in range(60):
        rows = np.minimum(rng.zipf(1.2, 9000 if step % 4 == 0 else 128), 200_000) - 1
        rows[:3] = [0, 1, 2]  # (and Zipf repeats them: counted past it, on the pool too)
        touch = step % 5 != 0
        got = [d.locate(rows, touch=touch) for d in dirs]
        assert np.array_equal(got[0], got[1]) and np.array_equal(got[0], got[2])
        clamped |= rows.size > 2048 and bool((dirs[2].sketch == 30_000).any())
        missed = rows[got[0] < 0]  # repeats and all, or distinct
        missed = missed if step % 2 else np.unique(missed)
        admitted = [d.admit(missed) for d in dirs]
        for a, *others in zip(*admitted, strict=True):
            assert all(np.array_equal(a, b) for b in others)
        slots, which = admitted[1]
        assert np.unique(missed[which]).size == which.size == np.unique(slots).size  # once each
        _, first = np.unique(missed, return_index=True)
        assert np.isin(which, first).all()  # a repeated row's first position
    assert clamped  # (a counter reached the saturation point on the pool)
    for name in ("tags", "stamp", "sketch"):
        for d in dirs[1:]:
            assert np.array_equal(getattr(dirs[0], name), getattr(d, name)), name
    with pytest.raises(ValueError, match="negative"):
        dirs[1].admit(np.array([5, -3]))
    assert dirs[2].dynamic_tags().max() >= 0 and dirs[2].sketch.max() <= 30_000
    with pytest.raises(ValueError, match="do not agree"):
        core.cache_locate(
            rows,
            np.empty(1, np.int64),
            *[np.zeros(0, np.int64)] * 3,
            np.zeros(0, np.int32),
            np.zeros(3, np.int64),
            0,
            0,
            0,
            1,
            8,
            True,
            1023,
            30_000,
            50_000,
        )


@requires_native
@pytest.mark.parametrize("static_sets, sets", [(1, 1), (3, 7), (187, 999_983), (65_537, 2)])
def test_cache_directory_sets_match_numpy_for_any_set_count(static_sets, sets):
    """A row's static and dynamic set (the core's remainder by multiplies, core.h's mod32) is
    numpy's `%` for set counts that are not powers of two and rows over the whole int64 range."""
    from plestore.native.rowsets import set_of

    rng = np.random.default_rng(7)
    rows = np.concatenate([rng.integers(0, 1 << 62, 20_000), np.arange(5000), [(1 << 63) - 1]])
    stags = np.full((static_sets, 16), -1, np.int64)
    tags = np.full((sets, 1), -1, np.int64)
    stags[set_of(rows[::3], static_sets), 0] = rows[::3]  # (a later row of a set replaces it)
    tags[set_of(rows[1::3], sets), 0] = rows[1::3]
    got = []
    for c in (reference, core):
        slot = np.empty(rows.size, np.int64)
        args = (stags, tags, np.zeros_like(tags), np.zeros(1024, np.int32), np.zeros(3, np.int64))
        c.cache_locate(rows, slot, *args, 0, 0, static_sets, sets, 1, False, 1023, 30_000, 1)
        got.append(slot)
    assert np.array_equal(got[0], got[1])
    assert (got[1] >= 0).sum() >= min(static_sets + sets, rows.size // 4)  # (found: set right)


@pytest.mark.parametrize(
    "fake",
    [
        "",  # an older interface (version 1)
        "m.ABI_VERSION = 15; m.CONSTANTS = {'ABI_VERSION': 15}",  # other constants.h values
    ],
)
def test_a_core_built_from_other_sources_is_refused_as_not_built(fake):
    """An in-place build left from other sources (another interface version, or other values
    of constants.h) is not used: auto takes the numpy reference, on fails saying to rebuild (it
    would lack calls, return fewer values, or disagree on a state or threshold)."""
    code = f"""
import sys, types
m = sys.modules["plestore.native._core"] = types.ModuleType("plestore.native._core")
{fake}
from plestore import native
assert not native.available() and "other sources" in native._missing, native._missing
assert native.load("off") is native.load("auto") is native.reference
try:
    native.load("on")
except RuntimeError as e:
    assert "build_ext --inplace" in str(e), e
else:
    raise SystemExit("a stale core was loaded")
"""
    _run_python(code)
    assert core is None or core.ABI_VERSION == native.ABI_VERSION


def test_native_option_from_env_and_errors(monkeypatch):
    for raw, want in (("0", "off"), ("1", "on"), ("auto", "auto"), ("ON", "on"), ("false", "off")):
        assert TableOptions.from_env({"PLESTORE_NATIVE": raw}).native == want
    assert TableOptions(native=1).native == "on" and TableOptions(native=False).native == "off"
    with pytest.raises(ValueError, match="native must be auto, on or off"):
        TableOptions(native="fast")


def test_missing_core_falls_back_with_one_warning_or_fails_when_required(monkeypatch, caplog):
    monkeypatch.setattr(native, "_core", None)
    monkeypatch.setattr(native, "_missing", "no module named _core")
    monkeypatch.setattr(native, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="plestore"):
        assert native.load("auto") is reference and native.load("auto") is reference
    warned = [r for r in caplog.records if "native host core not built" in r.getMessage()]
    assert len(warned) == 1 and "numpy reference" in warned[0].getMessage()
    assert native.load("off") is reference
    with pytest.raises(RuntimeError, match="native=on but plestore's native core is not built"):
        native.load("on")


def test_bench_variants_open_the_python_path_and_time_the_read_alone(tmp_path):
    """`plestore bench` variants: plestore-<tier>:native=off is the reference host core beside
    the compiled one; read_alone times the tier's read() by itself (the host's part)."""
    from plestore.bench.methods import make_method, split_labels, tier_options
    from plestore.tablefile import TableFile

    assert tier_options("direct:native=off,queue_depth=64") == (
        "direct",
        {"native": "off", "queue_depth": 64},
    )
    assert split_labels("device,direct:native=off,queue_depth=64,mapped,pinned:share=node") == [
        "device",
        "direct:native=off,queue_depth=64",
        "mapped",
        "pinned:share=node",
    ]
    path, ref = _make_table(tmp_path, "fp8_e4m3", 160, rows=1000, block=512)
    tf = TableFile.open(path)
    ids = np.random.default_rng(4).integers(0, 1000, 300)
    for name in ("plestore-direct:native=off", "plestore-direct", "plestore-pinned"):
        m = make_method(name, tf, torch.device("cpu"))
        try:
            tier = m.table.tier
            if tier.name == "direct":
                python = name.endswith("native=off") or core is None
                assert isinstance(tier._core, reference.DirectCore) == python
                assert (tier.engine == "threads") >= python
            assert_bit_identical(m.lookup(ids), ref[ids])
            m.read_alone(ids)
        finally:
            m.close()
    m = make_method("plestore-device", tf, torch.device("cpu"))
    assert m.read_alone is None
    m.close()


@requires_native
def test_an_unlocked_probe_sees_an_admission_whole_or_not_at_all():
    """GpuRowCache.misses probes without the host lock while a large admission runs (its GIL
    let go): the probe keeps the GIL, and the admission writes its slots with the GIL held."""
    import threading

    from plestore.lookup.gpudirectory import GpuCacheDirectory

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        d = GpuCacheDirectory(None, 1 << 21, 8, admit_min=1, core=core)
        rows = np.random.default_rng(0).integers(0, 1 << 40, 400_000)
        d.locate(rows)  # counted once: admitted at the first miss
        probe, done, seen = rows[::400].copy(), threading.Event(), []

        def hint():
            while not done.is_set():
                seen.append(int((d.locate(probe, touch=False) >= 0).sum()))

        t = threading.Thread(target=hint)
        t.start()
        d.admit(rows)
        done.set()
        t.join()
    finally:
        sys.setswitchinterval(switch)
    final = int((d.locate(probe, touch=False) >= 0).sum())
    assert final > 0 and len(seen) > 1 and set(seen) <= {0, final}


@pytest.mark.parametrize("host", CORES)
def test_publish_writes_a_word_or_refuses(host):
    """publish (a feed's READY or FAILED after rows Python staged: a release store in C)."""
    words = np.zeros(40, np.int64)
    host.publish(words, 8, 7)
    assert words[8] == 7 and words.sum() == 7
    with pytest.raises(IndexError, match="outside words"):
        host.publish(words, 40, 1)
    with pytest.raises(ValueError, match="int64"):
        host.publish(np.zeros(40, np.int32), 0, 1)


def test_python_writes_a_feed_word_only_by_publish():
    """No Python source stores READY or FAILED itself (a plain store is not ordered after the
    rows on a weakly ordered host); the reference's publish is the one place."""
    src = Path(native.__file__).parents[1]
    plain = re.compile(r"\[\s*(W_)?(READY|FAILED)\s*\]\s*=[^=]")
    found = [
        str(p.relative_to(src))
        for p in src.rglob("*.py")
        if plain.search(p.read_text()) and "integrations" not in p.parts
    ]
    assert not found, found
