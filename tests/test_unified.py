"""Unified-memory GPUs (DGX Spark, GH200), with the device probe's answers injected (no such
device here): AUTO keeps the table out of the GPU's memory pool, an explicit pinned tier is
warned about naming direct, both said in stats() and the log; a discrete GPU changes nothing."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest
import torch

import plestore
from plestore.io import unified
from plestore.io.probe import Capabilities
from plestore.io.unified import MemoryKind, memory_of, unified_choice
from tier_tables import make_table

SPARK = MemoryKind(
    "NVIDIA GB10", integrated=True, pageable_memory_access=True, host_page_tables=True
)
GH200 = MemoryKind(
    "NVIDIA GH200", integrated=False, pageable_memory_access=True, host_page_tables=True
)
H100 = MemoryKind(
    "NVIDIA H100", integrated=False, pageable_memory_access=False, host_page_tables=False
)


@pytest.mark.parametrize("kind", [SPARK, GH200])
def test_auto_on_a_unified_part_picks_direct_else_mapped(kind):
    name, why = unified_choice(kind, "auto", 3 << 30, lambda: True, "none")
    assert name == "direct" and "share one memory pool" in why and "3.00 GiB" in why
    name, why = unified_choice(kind, "auto", 3 << 30, lambda: False, "none")
    assert name == "mapped" and "rss_budget_bytes" in why and "no O_DIRECT" in why
    name, why = unified_choice(kind, "auto", 3 << 30, lambda: True, "node")  # a shared copy
    assert name == "mapped" and "share='node'" in why


def test_an_explicit_pool_tier_is_kept_with_a_warning_naming_direct(caplog):
    for tier in unified.POOL_TIERS:
        with caplog.at_level(logging.WARNING, logger="plestore"):
            name, why = unified_choice(SPARK, tier, 1 << 30, lambda: True, "none")
        assert name == tier and why.startswith("requested; ") and "tier='direct'" in why
        (record,) = [r for r in caplog.records if tier in r.getMessage()]
        assert "tier='direct'" in record.getMessage() and "GB10" in record.getMessage()
        caplog.clear()


@pytest.mark.parametrize("tier", ["auto", "pinned", "mapped", "direct"])
def test_a_discrete_gpu_or_the_cpu_keeps_the_usual_choice(tier):
    assert unified_choice(H100, tier, 1 << 30, lambda: True, "none") is None
    assert unified_choice(None, tier, 1 << 30, lambda: True, "none") is None
    assert unified_choice(SPARK, "mapped", 1, lambda: True, "none") is None  # (asked for)


def test_the_probe_answers_become_the_memory_kind(monkeypatch):
    caps = Capabilities(
        cuda=True,
        device_name="NVIDIA GB10",
        integrated=True,
        pageable_memory_access=True,
        pageable_uses_host_page_tables=True,
        stream_mem_ops=True,
        host_register_supported=True,
        io_uring=True,
        transparent_hugepages="madvise",
    )
    monkeypatch.setattr(unified, "capabilities", lambda index: caps)
    assert memory_of(torch.device("cuda", 0)) == SPARK
    monkeypatch.setattr(unified, "capabilities", lambda index: replace(caps, integrated=False))
    assert memory_of(torch.device("cuda", 0)) == replace(SPARK, integrated=False)
    assert memory_of(torch.device("cpu")) is None


def test_open_table_on_a_unified_part_says_its_choice_in_stats_and_the_log(
    tmp_path, monkeypatch, caplog
):
    path, ref = make_table(tmp_path, "fp8_e4m3", 160, block=512)
    monkeypatch.setattr(unified, "memory_of", lambda device: SPARK)
    with caplog.at_level(logging.INFO, logger="plestore"):
        auto = plestore.open_table(path, tier="auto", device="cpu")
    with auto as t:
        assert t.tier.name == "direct"
        assert "share one memory pool" in t.stats()["tier_reason"]
        rows = t.lookup(torch.tensor([[1, 2, 3, 4]])).float().numpy()
        np.testing.assert_array_equal(rows.reshape(4, -1), ref[[1, 2, 3, 4]])
    assert any("tier direct" in r.getMessage() and "GB10" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="plestore"):
        pinned = plestore.open_table(path, tier="pinned", device="cpu")
    with pinned as t:
        assert t.tier.name == "pinned" and "tier='direct'" in t.stats()["tier_reason"]
    assert any("tier='direct'" in r.getMessage() for r in caplog.records)
