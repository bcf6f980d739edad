"""Every fallback is announced, once: io_uring refused (the direct tier's reference reads) and
Triton missing (the decode kernel's torch reference on the GPU). The host core's own fallback,
no compiled core: tests/test_native.py."""

from __future__ import annotations

import errno
import logging

import numpy as np
import pytest
import torch

import plestore
from conftest import assert_bit_identical, requires_cuda
from plestore import kernels, native
from plestore.kernels import gather_decode as gd
from tier_tables import ROWS, make_table, resident_rows


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    return make_table(tmp_path_factory.mktemp("fb"), "fp8_e4m3", 160, block=512)


class _NoRing:
    """A host core whose io_uring the kernel refuses."""

    reference = native.load("off")

    def __getattr__(self, name):
        return getattr(self.reference, name)

    def DirectCore(self, *args, **kw):  # noqa: N802 - the core's class
        raise OSError(errno.ENOSYS, "Function not implemented")


def test_io_uring_refused_falls_back_to_threads_announced_once(table, monkeypatch, caplog):
    path, ref = table
    import plestore.tiers.direct as direct

    monkeypatch.setattr(
        direct.native, "load", lambda mode="auto": _NoRing() if mode != "off" else _NoRing.reference
    )
    direct._announce_threads.cache_clear()
    ids = np.random.default_rng(1).integers(0, ROWS, (16, 4))
    with caplog.at_level(logging.WARNING, logger="plestore"):
        for _ in range(2):
            with plestore.open_table(path, tier="direct", device="cpu") as t:
                assert t.tier.engine == "threads"
                assert_bit_identical(t.lookup(ids), resident_rows(ref, ids))
    said = [r for r in caplog.records if "io_uring unavailable" in r.getMessage()]
    assert len(said) == 1 and "preadv on threads" in said[0].getMessage()
    with pytest.raises(OSError, match="io_uring unavailable .*io_engine='threads'"):
        plestore.open_table(path, tier="direct", device="cpu", io_engine="io_uring")


def test_io_uring_asked_of_the_reference_core_is_refused(table):
    path, _ = table
    with pytest.raises(OSError, match="reads through the compiled host core"):
        plestore.open_table(path, tier="direct", device="cpu", io_engine="io_uring", native="off")


def test_triton_missing_is_announced_once(caplog):
    kernels.announce_reference.cache_clear()
    with caplog.at_level(logging.WARNING, logger="plestore"):
        for _ in range(3):
            kernels.announce_reference("gather_decode")
    said = [r for r in caplog.records if "Triton is not installed" in r.getMessage()]
    assert len(said) == 1 and "gather_decode runs its torch reference" in said[0].getMessage()


@requires_cuda
@pytest.mark.gpu
def test_a_cuda_lookup_without_triton_runs_the_reference_announced(table, monkeypatch, caplog):
    path, ref = table
    monkeypatch.setattr(gd, "triton_available", lambda: False)
    kernels.announce_reference.cache_clear()
    ids = np.random.default_rng(2).integers(0, ROWS, (64, 4))
    with (
        caplog.at_level(logging.WARNING, logger="plestore"),
        plestore.open_table(path, tier="device", device="cuda") as t,
    ):
        for _ in range(2):
            assert_bit_identical(t.lookup(torch.from_numpy(ids).cuda()), resident_rows(ref, ids))
    assert sum("Triton is not installed" in r.getMessage() for r in caplog.records) == 1
