"""A small leak test per tier: a few thousand mixed lookups (lookup, prefetch, abandoned
prefetches, run_now, drop_caches); after warm-up, open descriptors and threads exactly flat and
RSS growth under a bound. `python3 tests/soak.py` is the long run (100,000 per tier)."""

from __future__ import annotations

import pytest
from soak import main, run_soak

from plestore.spec import TableSpec
from tier_tables import random_bytes_table


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    root = tmp_path_factory.mktemp("soak")
    spec = TableSpec(name="t", rows=20000, dim=160, format="fp8")
    random_bytes_table(root, spec, seed=5)
    return str(root)


@pytest.mark.parametrize("tier", ["device", "pinned", "mapped", "direct"])
def test_few_thousand_lookups_hold_fds_threads_and_rss(table, tier):
    r = run_soak(
        table,
        tier,
        2400,
        every=120,
        warmup=0.25,
        rss_bound=24 << 20,
        device="cpu",
        max_ids=128,
        threads=4,
        cache_bytes=1 << 20,
    )
    assert r.fds_flat and r.threads_flat, r.verdict
    assert r.rss_growth < 24 << 20, r.verdict
    assert r.flat and len(r.samples) == 21


def test_soak_cli(table, tmp_path, capsys):
    out = tmp_path / "soak.jsonl"
    args = [table, "--tiers", "pinned", "--lookups", "300", "--every", "50", "--max-ids", "64"]
    code = main([*args, "--device", "cpu", "--out", str(out), "--plot", "", "--json"])
    assert code == 0 and '"flat": true' in capsys.readouterr().out
    assert len(out.read_text().splitlines()) == 7
