"""One conformance suite for every tier: output bit-identical to a resident gather + decode, for
every format, device (cpu here; cuda on the GPU machine), awkward input and table layout; I/O
faults raise and the table keeps working; concurrent lookups; timeouts; other ranks' ids are
never read; options and tier choice."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import plestore
from conftest import HAS_CUDA, assert_bit_identical, devices, requires_cuda
from plestore import native
from plestore.io.memory import HostBuffer
from plestore.options import TableOptions
from plestore.tiers.base import PooledReading
from tier_tables import FORMATS, ROWS, TIERS, make_table, resident_rows


@pytest.fixture(scope="module", params=list(FORMATS))
def table(request, tmp_path_factory):
    name = request.param
    return make_table(tmp_path_factory.mktemp(name), name, FORMATS[name])


@pytest.fixture(scope="module")
def fp8_table(tmp_path_factory):
    return make_table(tmp_path_factory.mktemp("fp8"), "fp8_e4m3", 160, block=512)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("tier", TIERS)
def test_bit_identical_to_resident_decode(table, tier, device):
    path, ref = table
    rng = np.random.default_rng(1)
    with plestore.open_table(path, tier=tier, device=device, cache_bytes=1 << 20) as t:
        for shape in [(7, 4), (1, 4), (64, 4), (2, 3, 4)]:
            ids = rng.integers(0, ROWS, shape)
            got = t.lookup(ids)
            assert got.shape == (*shape[:-1], shape[-1] * t.dim) and got.dtype == t.dtype
            assert got.device.type == device
            assert_bit_identical(got, resident_rows(ref, ids))
        # the same ids again (warm: caches, page cache) and as a torch tensor on the device
        ids_t = torch.as_tensor(ids).to(device)
        assert_bit_identical(t.lookup(ids_t), resident_rows(ref, ids))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("tier", TIERS)
def test_awkward_inputs(fp8_table, tier, device):
    path, ref = fp8_table
    with plestore.open_table(path, tier=tier, device=device) as t:
        edge = np.array([[0, ROWS - 1, 0, ROWS - 1]])
        assert_bit_identical(t.lookup(edge), resident_rows(ref, edge))
        dup = np.full((16384, 4), 1234)  # one id repeated 65,536 times
        assert_bit_identical(t.lookup(dup), resident_rows(ref, dup))
        mixed = np.random.default_rng(2).integers(0, 20, (500, 4))  # heavy duplication
        assert_bit_identical(t.lookup(mixed), resident_rows(ref, mixed))
        empty = t.lookup(np.zeros((0, 4), np.int64))
        assert empty.shape == (0, 4 * t.dim)
        assert t.lookup(np.array([5], np.int32)).shape == (t.dim,)
        for bad in ([[0, ROWS]], [[-1, 0]]):
            with pytest.raises(IndexError, match="outside table t"):
                t.lookup(np.array(bad))
        with pytest.raises(ValueError, match="must be integers"):
            t.lookup(np.array([[1.0, 2.0]]))
        with pytest.raises(ValueError, match="at least one dimension"):
            t.lookup(np.int64(3))
        assert_bit_identical(t.lookup(edge), resident_rows(ref, edge))  # still fine after errors


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("tier", TIERS)
def test_other_ranks_ids_are_zeros_and_never_read(fp8_table, tier, device):
    path, ref = fp8_table
    start, end = 1000, 2000
    with plestore.open_table(path, tier=tier, device=device, row_start=start, row_end=end) as t:
        seen = []
        if t.tier.can_read_host:
            orig = t.tier.read
            t.tier.read = lambda rows, out: (seen.append(rows.copy()), orig(rows, out))[1]
        ids = np.random.default_rng(3).integers(0, ROWS, (300, 4))
        absent = (ids < start) | (ids >= end)
        got = t.lookup(ids, label="prefill")
        assert_bit_identical(got, resident_rows(ref, ids, absent))
        for rows in seen:
            assert rows.min() >= start and rows.max() < end
        if tier == "direct":  # every block read holds an in-range row
            assert t.tier.blocks_read <= int((~absent).sum())
        if t.stats()["last_call"]["route"] != "device_read":
            assert t.stats()["phases"]["prefill"]["absent"] == int(absent.sum())
        none = np.random.default_rng(4).integers(end, ROWS, (5, 4))  # not one of this rank's
        assert not t.lookup(none).any()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("tier", TIERS)
def test_large_lookups_read_in_chunks_are_exact(fp8_table, tier, device):
    """Past read_chunk_rows ids a host lookup is read and copied a chunk at a time: distinct
    random rows land in their own places, the last chunk partial, waited for at once,
    prefetched, GPU-timed, and with another rank's ids among them."""
    path, ref = fp8_table
    ids = np.random.default_rng(11).integers(0, ROWS, (10000, 4))  # 40,000: 2 chunks + 7,232
    want = resident_rows(ref, ids)
    with plestore.open_table(path, tier=tier, device=device, cache_bytes=1 << 20) as t:
        for _ in range(2):  # (the second: direct's row cache holds some)
            assert_bit_identical(t.lookup(ids), want)
        assert_bit_identical(t.prefetch(ids).result(), want)
        t.metrics.time_gpu = lambda label: True  # (events around the copy and the decode)
        assert_bit_identical(t.lookup(ids), want)
    start, end = 1000, ROWS - 1000
    absent = (ids < start) | (ids >= end)
    with plestore.open_table(path, tier=tier, device=device, row_start=start, row_end=end) as t:
        assert_bit_identical(t.lookup(ids), resident_rows(ref, ids, absent))


def test_row_range_for_rank_matches_the_engines():
    from plestore.tiers import RowRange

    assert RowRange.for_rank(16896, 1, 4) == RowRange(4224, 8448)
    assert RowRange.for_rank(10, 3, 4) == RowRange(9, 10)
    with pytest.raises(ValueError):
        RowRange.for_rank(10, 4, 4)


@pytest.mark.parametrize("tier", TIERS)
def test_concurrent_lookups_from_threads(fp8_table, tier):
    path, ref = fp8_table
    errors = []
    with plestore.open_table(path, tier=tier, device="cpu", cache_bytes=64 << 10) as t:

        def worker(seed):
            rng = np.random.default_rng(seed)
            try:
                for _ in range(10):
                    ids = rng.integers(0, ROWS, (rng.integers(1, 200), 4))
                    got = t.prefetch(ids, label=f"w{seed}").result(timeout=60)
                    if not np.array_equal(got.float().numpy(), resident_rows(ref, ids)):
                        errors.append(f"thread {seed}: wrong rows")
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(f"thread {seed}: {e!r}")

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert not errors, errors


@pytest.mark.parametrize(
    "fmt, dim, block",
    [
        ("nvfp4", 160, 0),  # 90-B rows back to back: rows straddle every read unit's boundary
        ("bf16", 448, 512),  # 896-B rows over two 512-B blocks (not a divisor of 4 KiB)
        ("fp8_e4m3", 160, 512),  # rows within 512-B blocks
    ],
)
@pytest.mark.parametrize(  # O_DIRECT alignment as probed (512 here), or a 4 KiB device's
    "tier, align", [(t, None) for t in TIERS] + [("direct", 4096)]
)
def test_exact_rows_of_every_layout(tmp_path, monkeypatch, fmt, dim, block, tier, align):
    """Every tier returns exact rows whether rows share blocks, span them or run back to back;
    the direct tier reads, for each row, an aligned unit that holds all of it (the last rows'
    units may end past the end of the file), through read() and through reads started at
    prefetch."""
    import plestore.tiers.direct as direct

    if align:
        monkeypatch.setattr(direct, "o_direct_alignment", lambda *a: align)
    path, ref = make_table(tmp_path, fmt, dim, rows=5000, block=block)
    every = np.arange(5000).reshape(-1, 4)
    with plestore.open_table(path, tier=tier, device="cpu", cache_bytes=1 << 20) as t:
        assert tier != "direct" or t.tier.unit % (align or 512) == 0
        assert_bit_identical(t.lookup(every), resident_rows(ref, every))  # cold: all from the disk
        t.drop_caches()
        few = np.array([[4999, 0, 4998, 4997], [500, 1, 4999, 3]])  # the file's ends, repeats
        assert_bit_identical(t.prefetch(few).result(), resident_rows(ref, few))
        t.drop_caches()  # scattered rows: the units read are not each other's neighbours
        scattered = np.random.default_rng(5).integers(0, 4900, (16, 4))
        assert_bit_identical(t.lookup(scattered), resident_rows(ref, scattered))
        assert_bit_identical(t.lookup(every[::-1]), resident_rows(ref, every[::-1]))  # warm


@pytest.mark.parametrize("tier", ["mapped", "direct"])
def test_truncated_or_replaced_file_raises_and_table_recovers(tmp_path, tier):
    path, ref = make_table(tmp_path, "fp8_e4m3", 160, block=4096)
    data = next(tmp_path.glob("*.rows"))
    saved = data.read_bytes()
    ids = np.array([[0, 1, ROWS - 1, ROWS - 2]])
    with plestore.open_table(path, tier=tier, device="cpu", cache_bytes=0) as t:
        assert_bit_identical(t.lookup(ids), resident_rows(ref, ids))
        os.truncate(data, len(saved) // 2)
        with pytest.raises(OSError, match="truncated|short read") as e:
            t.lookup(ids)
        assert str(data) in str(e.value)  # which file
        data.write_bytes(saved)  # restored in place (same inode)
        assert_bit_identical(t.lookup(ids), resident_rows(ref, ids))
        if tier == "mapped":
            tmp = data.with_suffix(".new")
            tmp.write_bytes(saved)
            os.replace(tmp, data)  # a different file now
            with pytest.raises(OSError, match="replaced"):
                t.lookup(ids)


@pytest.mark.parametrize("how", ["renamed away", "hard-linked, then renamed over", "touched"])
def test_mapped_tier_sees_its_file_renamed_away_or_relinked(tmp_path, how):
    """The mapped tier's one-fstat check: the open file's link count or change time moved, so
    its path is looked up: another file there (the old one renamed away, or one of its two
    names replaced) raises "replaced"; the same file, only touched, reads on."""
    path, ref = make_table(tmp_path, "fp8_e4m3", 160, block=512)
    data = next(tmp_path.glob("*.rows"))
    ids = np.array([[0, 1, ROWS - 1, ROWS - 2]])
    with plestore.open_table(path, tier="mapped", device="cpu") as t:
        assert_bit_identical(t.lookup(ids), resident_rows(ref, ids))
        if how == "touched":
            os.chmod(data, 0o640)
            assert_bit_identical(t.lookup(ids), resident_rows(ref, ids))
            return
        if how == "renamed away":
            os.rename(data, data.with_suffix(".old"))
        else:
            os.link(data, data.with_suffix(".link"))
            os.replace(data.with_suffix(".link"), data.with_suffix(".spare"))
            tmp = data.with_suffix(".new")
            tmp.write_bytes(data.read_bytes())
            os.replace(tmp, data)  # the path names a new file; the old one keeps a name
        if how == "renamed away":
            data.write_bytes(data.with_suffix(".old").read_bytes())
        with pytest.raises(OSError, match="replaced"):
            t.lookup(ids)


@pytest.mark.parametrize("tier", ["pinned", "mapped", "direct"])
def test_injected_eio_raises_and_next_lookup_works(fp8_table, tier):
    path, ref = fp8_table
    with plestore.open_table(path, tier=tier, device="cpu", cache_bytes=0) as t:
        orig = t.tier.read
        calls = {"n": 0}

        def failing(rows, out):
            calls["n"] += 1
            if calls["n"] == 1:
                raise OSError(errno.EIO, "injected I/O error")
            return orig(rows, out)

        t.tier.read = failing
        ids = np.arange(40).reshape(10, 4)
        with pytest.raises(OSError, match="injected"):
            t.lookup(ids)
        assert_bit_identical(t.lookup(ids), resident_rows(ref, ids))


def test_timeout_raises_and_later_lookups_complete(fp8_table):
    path, ref = fp8_table
    # inline_ids=0: every lookup goes through the worker, the path whose wait can time out
    with plestore.open_table(path, tier="mapped", device="cpu", inline_ids=0) as t:
        orig = t.tier.read
        t.tier.read = lambda rows, out: (time.sleep(0.5), orig(rows, out))[1]
        ids = np.arange(8).reshape(2, 4)
        pending = t.prefetch(ids)
        assert not pending.done()  # prefetch returned while the tier is still working
        with pytest.raises(TimeoutError, match="did not finish within 0.05 s"):
            pending.result(timeout=0.05)
        assert_bit_identical(pending.result(timeout=30), resident_rows(ref, ids))
        t.tier.read = orig
        assert_bit_identical(t.lookup(ids, timeout=30), resident_rows(ref, ids))


def test_auto_picks_a_tier_and_says_why(fp8_table):
    path, _ = fp8_table
    with plestore.open_table(path, device="cpu") as t:
        assert t.tier.name == "pinned" and "fits" in t.tier_choice.reason


def test_options_from_environment_and_errors(fp8_table):
    """PLESTORE_* are read once, by the process's first table (here a fresh process's), under
    explicit arguments; plestore.defaults sets one back."""
    path, _ = fp8_table
    code = (
        "import plestore\n"
        "def opened(**kw):\n"
        f"    with plestore.open_table({str(path)!r}, device='cpu', **kw) as t:\n"
        "        return t.tier.name, t.options.cache_bytes\n"
        "print(opened(), opened(tier='mapped'))\n"
        "with plestore.defaults.reset('tier', 'cache_bytes'):\n"
        "    print(opened())\n"
    )
    env = {**os.environ, "PLESTORE_TIER": "direct", "PLESTORE_CACHE_BYTES": "2M"}
    env["PYTHONPATH"] = str(Path(plestore.__file__).parents[1])
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.split("\n")
    assert lines[0] == "('direct', 2097152) ('mapped', 2097152)"  # explicit wins
    assert lines[1] == f"('pinned', {256 << 20})"  # the built-ins, whatever the variables say
    with pytest.raises(ValueError, match="PLESTORE_THREADS='many'"):
        TableOptions.from_env({"PLESTORE_THREADS": "many"})
    with pytest.raises(ValueError, match="tier must be one of"):
        plestore.open_table(path, tier="floppy", device="cpu")
    with pytest.raises(TypeError, match="unknown table options: colour"):
        plestore.open_table(path, colour="red")
    with pytest.raises(ValueError, match="row range ends at 99999"):
        plestore.open_table(path, device="cpu", row_start=0, row_end=99999)
    if not HAS_CUDA:
        with pytest.raises(ValueError, match="CUDA is not available"):
            plestore.open_table(path, device="cuda")


def test_closed_table_refuses_lookups(fp8_table):
    path, _ = fp8_table
    t = plestore.open_table(path, tier="pinned", device="cpu")
    t.close()
    t.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        t.lookup(np.zeros((1, 4), np.int64))


def test_lookup_into_caller_buffer(fp8_table):
    path, ref = fp8_table
    ids = np.arange(32).reshape(8, 4)
    with plestore.open_table(path, tier="pinned", device="cpu") as t:
        out = torch.empty(8, 4 * t.dim, dtype=torch.bfloat16)
        got = t.lookup_into(ids, out)
        assert got.data_ptr() == out.data_ptr()
        assert_bit_identical(out, resident_rows(ref, ids))
        with pytest.raises(ValueError, match="contiguous tensor of shape"):
            t.lookup_into(ids, torch.empty(8, 5, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="must be bf16"):
            t.lookup_into(ids, torch.empty(8, 4 * t.dim))


@pytest.mark.parametrize("tier", ["pinned", "mapped", "direct", "cascade"])
def test_streaming_stores_read_the_same_rows(fp8_table, tier):
    """A GPU table's host tiers gather into staging with non-temporal stores; on CPU too, asked:
    the same rows, small gathers and pooled ones."""
    path, ref = fp8_table
    opts = {"cascade": {"pinned_budget_bytes": 1 << 15, "device_budget_bytes": 0}}.get(tier, {})
    opts["cache_bytes"] = 1 << 18  # (direct: some rows from its row cache, some from the file)
    with plestore.open_table(path, tier=tier, device="cpu", **opts) as t:
        for part in (t.tier, getattr(t.tier, "pinned", None), getattr(t.tier, "file", None)):
            if part is not None:
                part.stream_stores = True
        for n in (5, 300, 9000, 9000):  # (the second 9,000: direct's cache hits them)
            ids = np.random.default_rng(n).integers(0, ROWS, (n, 4))
            assert_bit_identical(t.lookup(torch.from_numpy(ids)), resident_rows(ref, ids))


@pytest.mark.parametrize("tier", ["pinned", "mapped", "direct"])
def test_a_read_handed_over_in_chunks(fp8_table, tier, host_core):
    """start_read: the rows of read(), each prefix ready when asked; a row outside the table
    raises read()'s error by done() at the latest, and close() leaves nothing writing out."""
    path, _ = fp8_table
    with plestore.open_table(path, tier=tier, device="cpu", cache_bytes=1 << 20) as t:
        tr = t.tier
        rows = np.random.default_rng(7).integers(0, ROWS, 40000)
        want = np.zeros((rows.size, tr.staging_stride), np.uint8)
        for _ in range(3):  # (mapped: warm after two reads in a row that needed no disk)
            tr.read(rows, want)
        out = np.zeros_like(want)
        reading = tr.start_read(rows, out)
        pooled = tier != "direct"  # (one gather of the host core, either one)
        assert isinstance(reading, PooledReading) == pooled
        for k in (1, 16384, 20000):
            reading.ready(k)
            assert np.array_equal(out[:k], want[:k])
        assert reading.done().rows == rows.size and np.array_equal(out, want)
        rows[30000] = ROWS + 5
        reading = tr.start_read(rows, out)
        with pytest.raises((IndexError, ValueError, OSError), match=r"row 3005|range|offset"):
            reading.ready(20000)  # (a pooled read may find it already)
            reading.done()
        reading.close()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("tier", ["pinned", "mapped", "direct"])
def test_a_read_copied_to_the_device_in_chunks(fp8_table, tier, device, host_core, monkeypatch):
    """Reading.copy_to: each chunk of the staged rows queued for its copy as it is read (on
    CUDA, a pooled read queues them in one native call): the device holds read()'s bytes; a row
    outside the table raises by done() at the latest."""
    path, _ = fp8_table
    if device == "cpu":  # a host buffer is copied by torch, CUDA's driver found or not
        monkeypatch.setattr(native, "cuda_h2d", lambda: 1)
    with plestore.open_table(path, tier=tier, device=device, cache_bytes=1 << 20) as t:
        tr = t.tier
        rows = np.random.default_rng(8).integers(0, ROWS, 40000)
        want = np.zeros((rows.size, tr.staging_stride), np.uint8)
        for _ in range(3):
            tr.read(rows, want)
        staged = HostBuffer(want.size, pin=device == "cuda", hugepages=False)
        out = staged.array.reshape(want.shape)
        raw = torch.zeros(want.shape, dtype=torch.uint8, device=device)
        reading = tr.start_read(rows, out)
        if device == "cuda" and isinstance(reading, PooledReading):
            assert native.cuda_h2d() is not None  # (the native copies, not the fallback)
        reading.copy_to(raw, staged.tensor, 16384)
        assert reading.done().rows == rows.size
        assert np.array_equal(raw.cpu().numpy(), want)
        rows[30000] = ROWS + 5
        reading = tr.start_read(rows, out)
        with pytest.raises((IndexError, ValueError, OSError), match=r"row 3005|range|offset"):
            reading.copy_to(raw, staged.tensor, 16384)
            reading.done()
        reading.close()
        if device == "cuda":
            torch.cuda.synchronize()  # (copies queued before the bad row read the staging)
        staged.close()
        if device == "cuda":
            assert native.cuda_error(1) == "CUDA_ERROR_INVALID_VALUE"


@pytest.mark.parametrize("tier", ["pinned", "device"])
def test_a_range_larger_than_the_memory_to_hold_it_is_refused_before_any_load(
    fp8_table, monkeypatch, tier
):
    """One line naming the table, the need and what to do — never a fill killed part-way."""
    from plestore.tiers import device, pinned

    path, _ = fp8_table
    module = pinned if tier == "pinned" else device
    monkeypatch.setattr(module, "mem_available", lambda: 4096)
    want = rf"table t: the {tier} tier needs .* of host memory .* choose tier 'direct'"
    with pytest.raises(MemoryError, match=want):
        plestore.open_table(path, tier=tier, device="cpu")
    monkeypatch.setattr(module, "mem_available", lambda: 0)  # (unknown: nothing to refuse by)
    plestore.open_table(path, tier=tier, device="cpu").close()


def test_a_cascade_budget_larger_than_the_memory_is_refused_naming_it(fp8_table, monkeypatch):
    """The pinned budget asked for, not the pinned tier, is what the user set: the line says so."""
    from plestore.tiers import cascade

    path, _ = fp8_table
    monkeypatch.setattr(cascade, "mem_available", lambda: 4096)
    opts = dict(device_budget_bytes=0, pinned_budget_bytes=1 << 30)
    want = r"table t: the cascade tier needs .* of host memory .* lower pinned_budget_bytes"
    with pytest.raises(MemoryError, match=want):
        plestore.open_table(path, tier="cascade", device="cpu", **opts)
    opts["pinned_budget_bytes"] = 2048  # (what fits is served)
    with plestore.open_table(path, tier="cascade", device="cpu", **opts) as t:
        assert t.stats()["tier_detail"]["pinned_bytes"] > 0


@requires_cuda
@pytest.mark.gpu
def test_a_device_range_larger_than_the_gpus_free_memory_is_refused(fp8_table, monkeypatch):
    from plestore.tiers import cascade, device

    monkeypatch.setattr(device, "gpu_available", lambda dev: 4096)
    with pytest.raises(MemoryError, match=r"the device tier needs .* of GPU memory"):
        plestore.open_table(fp8_table[0], tier="device", device="cuda")
    monkeypatch.setattr(cascade, "gpu_available", lambda dev: 4096)
    opts = dict(device_budget_bytes=1 << 30, pinned_budget_bytes=0)
    with pytest.raises(MemoryError, match=r"GPU memory .* lower device_budget_bytes"):
        plestore.open_table(fp8_table[0], tier="cascade", device="cuda", **opts)
