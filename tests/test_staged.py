"""StagedLookup: the same rows as Table.lookup on every tier and format, split into a host
stage() and a GPU decode() at fixed addresses — captured in a CUDA graph on the GPU machine."""

from __future__ import annotations

import os
import shutil
import time

import numpy as np
import pytest
import torch

import plestore
from conftest import assert_bit_identical, devices, requires_cuda
from plestore import native
from tier_tables import FORMATS, ROWS, TIERS, make_table, resident_rows


@pytest.fixture(scope="module", params=["fp8_e4m3", "nvfp4", "bf16"])
def table_file(request, tmp_path_factory):
    name = request.param
    return make_table(tmp_path_factory.mktemp(name), name, FORMATS[name], block=512)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("tier", TIERS)
def test_staged_rows_equal_lookup_step_after_step(table_file, tier, device):
    path, ref = table_file
    rng = np.random.default_rng(5)
    with plestore.open_table(path, tier=tier, device=device) as t:
        staged = t.staged((8, 4))
        for step in range(4):  # fixed buffers reused; a step's repeats included
            ids = rng.integers(0, ROWS, (8, 4))
            ids[1] = ids[0] if step % 2 else ids[1]
            staged.stage(ids)
            got = staged.decode()
            assert got.data_ptr() == staged.out.data_ptr() and got.shape == (8, 4 * t.dim)
            assert_bit_identical(got, resident_rows(ref, ids))
            assert_bit_identical(got, t.lookup(ids))
        assert t.stats()["phases"]["decode"]["calls"] == 4


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("tier", TIERS)
def test_staged_ids_on_the_device(table_file, tier, device):
    """ids given as a device tensor: a tier the GPU reads decodes them where they are (no
    stage(): the ids may be computed inside a captured step); a host tier still stages them."""
    path, ref = table_file
    rng = np.random.default_rng(6)
    with plestore.open_table(path, tier=tier, device=device) as t:
        ids = torch.zeros(4, 4, dtype=torch.int64, device=device)
        staged = t.staged((4, 4), ids=ids)
        assert staged.needs_stage == (tier != "device")  # (pinned: staged on the host, too)
        for _ in range(2):
            want = rng.integers(0, ROWS, (4, 4))
            ids.copy_(torch.from_numpy(want))
            if staged.needs_stage:
                staged.stage(want)
            else:
                staged.replayed()
                with pytest.raises(RuntimeError, match="reads its ids on the device"):
                    staged.stage(want)
            assert_bit_identical(staged.decode(), resident_rows(ref, want))
        assert t.stats()["phases"]["decode"]["calls"] == 2
        for bad in (ids.int(), ids[:2], ids.t()):  # dtype, shape, layout
            with pytest.raises(ValueError, match=r"ids must be a contiguous int64 \(4, 4\)"):
                t.staged((4, 4), ids=bad)


@pytest.mark.parametrize("tier", TIERS)
def test_staged_other_ranks_rows_are_zeros(table_file, tier):
    path, ref = table_file
    start, end = 1000, 2000
    with plestore.open_table(path, tier=tier, device="cpu", row_start=start, row_end=end) as t:
        out = torch.full((16, 4 * t.dim), 7.0, dtype=torch.bfloat16)
        staged = t.staged((16, 4), out=out)
        ids = np.random.default_rng(2).integers(0, ROWS, (16, 4))
        staged.stage(ids)
        assert staged.decode().data_ptr() == out.data_ptr()
        assert_bit_identical(out, resident_rows(ref, ids, (ids < start) | (ids >= end)))
        none = np.random.default_rng(3).integers(2000, ROWS, (16, 4))  # no row of this rank
        staged.stage(none)
        assert not staged.decode().any()


def test_staged_bad_input_is_a_clear_error(table_file):
    path, _ = table_file
    with plestore.open_table(path, tier="direct", device="cpu") as t:
        staged = t.staged((2, 4))
        with pytest.raises(ValueError, match=r"row ids of shape \(2, 4\) expected, got \(3, 4\)"):
            staged.stage(np.zeros((3, 4), np.int64))
        with pytest.raises(IndexError, match="outside table t"):
            staged.stage(np.array([[0, 1, 2, ROWS], [0, 1, 2, 3]]))
        with pytest.raises(ValueError, match="non-empty shape"):
            t.staged(())
        with pytest.raises(ValueError, match="out must be"):
            t.staged((2, 4), out=torch.zeros(2, 3, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="closed"):
        staged.stage(np.zeros((2, 4), np.int64))
    with pytest.raises(RuntimeError, match="closed"):
        t.staged((2, 4))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("n", [16, 4096])  # UVA staging, and one copied to the device first
@pytest.mark.parametrize("gpu_cache", [0, 64 << 10])
def test_staged_decode_replays_in_a_cuda_graph(table_file, tier, n, gpu_cache):
    """decode() captured once; each replay decodes whatever stage() put there last — through
    the GPU row cache too, with lookups admitting rows between stage() and the replay."""
    path, ref = table_file
    rng = np.random.default_rng(8)
    with plestore.open_table(path, tier=tier, device="cuda", gpu_cache_bytes=gpu_cache) as t:
        if gpu_cache and t.gpu_cache is None:
            pytest.skip("the device tier has no host path (no GPU row cache)")
        staged = t.staged((n // 4, 4))
        staged.stage(rng.integers(0, ROWS, (n // 4, 4)))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            staged.decode()  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            staged.decode()
        for _ in range(3):
            ids = rng.integers(0, ROWS, (n // 4, 4))
            staged.stage(ids)
            for _ in range(3 if gpu_cache else 0):  # admissions (and evictions) meanwhile
                t.lookup(rng.integers(0, ROWS, (64, 4)))
            graph.replay()
            assert_bit_identical(staged.out, resident_rows(ref, ids))
            torch.cuda.synchronize()  # the next stage() waits for this replay's reads


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("gpu_cache", [0, 64 << 10])
@pytest.mark.parametrize("tier", TIERS)
def test_device_readable_says_whether_the_gpu_reads_the_tier_itself(
    table_file, tier, gpu_cache, device
):
    """Table.device_readable (what an engine asks before capturing a lookup in a graph) is
    exactly whether a staged lookup may read the tier on the device (device_read=True)."""
    path, ref = table_file
    with plestore.open_table(path, tier=tier, device=device, gpu_cache_bytes=gpu_cache) as t:
        want = tier == "device" or (tier == "pinned" and device == "cuda" and not gpu_cache)
        assert t.device_readable == want
        ids = torch.zeros(2, 4, dtype=torch.int64, device=device)
        if not want:
            with pytest.raises(ValueError, match="the GPU cannot read"):
                t.staged((2, 4), ids=ids, device_read=True)
            return
        staged = t.staged((2, 4), ids=ids, device_read=True)
        assert not staged.needs_stage
        ids.copy_(torch.arange(8).view(2, 4))
        assert_bit_identical(staged.decode(), resident_rows(ref, np.arange(8).reshape(2, 4)))


#: host tiers by name: a cascade (a device part: the GPU row cache's resident rows, a pinned
#: part, the file), a GPU row cache in front of direct
STEP_TIERS = {
    "pinned": {},
    "mapped": {},
    "direct": {},
    "cascade": dict(device_budget_bytes=500 * 90, pinned_budget_bytes=1000 * 96),
    "direct+gpu-cache": dict(gpu_cache_bytes=32 << 10),
}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("tier", list(STEP_TIERS))
def test_stage_is_the_host_cores_step_on_every_host_tier(table_file, tier, device):
    """stage() on a host tier runs the host core's step (a graph feed's: native, or its numpy
    reference where the core is off), its record counting the step (rows, other ranks' ids,
    the direct tier's row cache, the GPU row cache's hits) and the tier hearing of its reads;
    rows exact on a rank's range, ids repeated."""
    path, ref = table_file
    start, end = 0, ROWS // 2
    kw = STEP_TIERS[tier]
    with plestore.open_table(path, tier=tier.partition("+")[0], device=device, row_start=start,
                             row_end=end, **kw) as t:  # fmt: skip
        reference = native.load(t.options.tuning.native) is native.load("off")
        core = "reference" if reference else "native"
        staged = t.staged((8, 4))
        ids = np.random.default_rng(7).integers(0, ROWS, (8, 4))
        for _ in range(2):  # the second: the direct tier's row cache hits
            staged.stage(ids)
            assert_bit_identical(staged.decode(), resident_rows(ref, ids, ids >= end))
        st = t.stats()
        last = st["last_call"]
        assert last["host_step"] == core and last["route"] == staged.plan.route.value
        assert last["rows"] == ids.size and last["absent"] == int((ids >= end).sum())
        if tier.startswith("direct"):
            assert last["cache_hits"] == int((ids < end).sum())  # every row read on the first
            assert st["tier_detail"]["cache_hits"] == last["cache_hits"]
        assert (last["gpu_cache_hits"] > 0) == (tier == "cascade")  # (its resident rows)
        assert st["phases"]["decode"]["calls"] == 2


@pytest.mark.parametrize("tier", ["mapped"])
def test_stage_is_the_step_with_block_checks_and_a_changed_file(table_file, tier, tmp_path):
    """Mapped with block checks stages by the host step too; a step the core refuses as its
    file changed (truncated under the mapping) raises by name, the tier saying what changed;
    a file only touched is still the tier's: the step runs again and serves."""
    path, ref = table_file
    ids = np.random.default_rng(8).integers(0, ROWS, (2, 4))
    with plestore.open_table(path, tier=tier, device="cpu", verify_reads=True) as t:
        reference = native.load(t.options.tuning.native) is native.load("off")
        core = "reference" if reference else "native"
        staged = t.staged((2, 4))
        staged.stage(ids)
        assert_bit_identical(staged.decode(), resident_rows(ref, ids))
        assert t.stats()["last_call"]["host_step"] == core
    copy = shutil.copytree(path, tmp_path / "copy")  # (touched, then truncated below)
    with plestore.open_table(copy, tier=tier, device="cpu") as t:
        staged = t.staged((2, 4))
        data = t.tier.path
        time.sleep(0.01)
        os.utime(data)  # (its change time moves: the core refuses, the tier takes it)
        staged.stage(ids)
        assert_bit_identical(staged.decode(), resident_rows(ref, ids))
        os.truncate(data, os.path.getsize(data) // 2)
        with pytest.raises(OSError, match="truncated"):
            staged.stage(ids)


def test_a_failed_read_of_a_step_names_the_table_and_the_file(table_file, tmp_path):
    """The direct tier's read of a step failing (its file truncated under it: a short read) is
    raised from the step's state: the table, the file, the cause."""
    path, _ = table_file
    copy = shutil.copytree(path, tmp_path / "copy")
    with plestore.open_table(copy, tier="direct", device="cpu") as t:
        staged = t.staged((1, 2))
        os.truncate(t.tier.table.data_path, 4096)
        with pytest.raises(OSError, match=rf"table {t.spec.name}: reading .* failed: "):
            staged.stage(np.array([[ROWS - 1, ROWS - 2]]))
