"""A table opens completely or leaves nothing behind: a failure at any step of its opening (the
tier's load, the GPU row cache's fill, the executor) gives back every fd, thread, host and
pinned byte and /dev/shm copy it took; close() releases in reverse and is idempotent."""

from __future__ import annotations

import errno
import gc
import glob
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import plestore
from conftest import assert_bit_identical, devices
from plestore.io.memory import held_bytes
from plestore.lookup import gpucache, table
from plestore.tablefile import DATA_OFFSET, TableFile
from plestore.tiers import direct, mapped
from tier_tables import ROWS, make_table, resident_rows

TIERS = ["device", "pinned", "mapped", "direct", "cascade"]


@pytest.fixture(scope="module")
def table_file(tmp_path_factory):
    return make_table(tmp_path_factory.mktemp("open"), "fp8_e4m3", 160, block=512)


@pytest.fixture
def shm(tmp_path, monkeypatch):
    """The node copies' directory: a tmpfs (CUDA pins no shared mapping of a disk file)."""
    root = Path("/dev/shm") if os.path.isdir("/dev/shm") else tmp_path
    path = root / f"plestore-test-{os.getpid()}-{tmp_path.name}"
    monkeypatch.setenv("PLESTORE_SHM_DIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def holdings(shm) -> dict:
    """What the process holds now that a table could leak."""
    gc.collect()
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
        **{f"{k}_bytes": v for k, v in held_bytes().items()},
        "shm_copies": sorted(glob.glob(str(shm / "*.seg*"))),
    }


def _corrupt_copy(path, tmp_path):
    """A copy of the table with one byte of row 5 flipped (its block's CRC no longer holds)."""
    dst = tmp_path / "bad"
    shutil.copytree(path, dst)
    tf = TableFile.open(str(dst))
    off = DATA_OFFSET + int(tf.layout.offsets(np.array([5]))[0]) + 3
    with open(tf.data_path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x10]))
    return dst


def _fail(*_a, **_k):
    raise OSError(errno.ENOMEM, "injected")


def _inject(step: str, tier: str, monkeypatch, path, tmp_path):
    """Make opening fail at `step`; returns (path to open, extra options)."""
    if step == "tier":  # the tier's own load fails after it took what it needs
        if tier in ("device", "pinned", "cascade"):  # a bad block while loading
            return _corrupt_copy(path, tmp_path), {"verify_reads": True}
        if tier == "mapped":
            monkeypatch.setattr(mapped.mmap, "mmap", _fail)
        else:
            monkeypatch.setattr(direct.DirectTier, "_open_core", _fail)
        return path, {}
    if step == "gpu_cache":  # device OOM, or a CRC error, while the cache fills
        monkeypatch.setattr(gpucache.GpuRowCache, "_load_static", _fail)
        return path, {"gpu_cache_bytes": 64 << 10}
    monkeypatch.setattr(table, "Executor", _fail)  # the last step: the tier and cache are up
    return path, {"gpu_cache_bytes": 64 << 10} if tier != "device" else {}


def _options(tier: str) -> dict:
    opts = {"share": "node"} if tier == "pinned" else {}
    if tier == "cascade":  # a device part, a pinned part and the file
        opts.update(device_budget_bytes=300 * 160, pinned_budget_bytes=1000 * 160)
    return opts


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("step", ["tier", "gpu_cache", "executor"])
@pytest.mark.parametrize("tier", TIERS)
def test_a_failed_open_leaves_nothing_behind(
    table_file, tier, step, device, shm, tmp_path, monkeypatch
):
    path, ref = table_file
    if step == "gpu_cache" and tier == "device":
        pytest.skip("the device tier has no GPU row cache")
    opts = {**_options(tier), "tier": tier, "device": device}
    ids = np.random.default_rng(1).integers(0, ROWS, (32, 4))
    with plestore.open_table(path, gpu_cache_bytes=64 << 10 if tier != "device" else 0, **opts):
        pass  # warm: the host core's pools, torch's threads
    before = holdings(shm)
    with monkeypatch.context() as m:
        bad_path, extra = _inject(step, tier, m, path, tmp_path)
        with pytest.raises((OSError, plestore.tablefile.checksums.BlockChecksumError)):
            plestore.open_table(bad_path, **opts, **extra)
    assert holdings(shm) == before
    with plestore.open_table(path, **opts) as t:  # and the next open works as ever
        assert_bit_identical(t.lookup(ids).cpu(), resident_rows(ref, ids))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("tier", TIERS)
def test_close_releases_everything_once(table_file, tier, device, shm):
    path, ref = table_file
    opts = {**_options(tier), "tier": tier, "device": device}
    if tier != "device":
        opts["gpu_cache_bytes"] = 64 << 10

    def use(t) -> None:  # a staged lookup, a worker's lookup
        staged = t.staged((8, 4))
        staged.stage(ids[:8])
        assert_bit_identical(staged.decode().cpu(), resident_rows(ref, ids[:8]))
        assert_bit_identical(t.prefetch(ids).result().cpu(), resident_rows(ref, ids))
        return staged

    ids = np.random.default_rng(2).integers(0, ROWS, (3000, 4))
    with plestore.open_table(path, **opts) as t:
        use(t)  # warm: the host core's pools, torch's threads
    before = holdings(shm)
    t = plestore.open_table(path, **opts)
    staged = use(t)
    if tier == "pinned":
        assert holdings(shm)["shm_copies"]  # (the node's copy, while the table holds it)
    t.close()
    assert t.closed and holdings(shm) == before
    t.close()  # again: nothing
    assert holdings(shm) == before
    with pytest.raises(RuntimeError, match="closed"):
        staged.stage(ids[:8])


def test_stats_print_in_units_and_stay_numbers(table_file):
    """A phase's stats print as people read them (times in units, no 2.99e-05 seconds, the
    hit rate in percent) and stay numbers in seconds for programs (and JSON)."""
    import json

    path, _ = table_file
    with plestore.open_table(path, tier="mapped", device="cpu") as t:
        t.lookup(np.arange(64).reshape(16, 4), label="prefill")
        phase = t.stats()["phases"]["prefill"]
    shown = repr(phase)
    assert "e-0" not in shown and ("µs" in shown or "ms" in shown or " ns" in shown), shown
    assert f"rows: {phase['rows']}" in shown and "gpu_cache_hit_rate: 0.0%" in shown
    assert isinstance(phase["total_s"], float) and phase["total_s"] > 0
    assert json.loads(json.dumps(phase)) == dict(phase)
