"""Many threads on one table: lookup / prefetch / close from everywhere at once. Results stay
exact, nothing deadlocks, and a close while lookups are in flight ends each of them either with
its exact rows or with a RuntimeError saying the table was closed (never a hang, a crash, or
other rows). Every tier, on CPU, in bounded time."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import plestore
from plestore.formats import get_format
from plestore.spec import TableSpec
from tier_tables import random_bytes_table

TIERS = ["device", "pinned", "mapped", "direct"]
JOIN_S = 60  # a deadlock detector: the threads' work takes ~1 s


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    root = tmp_path_factory.mktemp("conc")
    spec = TableSpec(name="t", rows=5000, dim=160, format="nvfp4")
    data = random_bytes_table(root, spec, seed=3)
    want = torch.from_numpy(get_format("nvfp4").decode_numpy(data, 1.0)).to(torch.bfloat16)
    return root, want.view(torch.int16)


def _open(root, tier):
    # inline_ids small: lookups of more ids go through the worker thread too
    return plestore.open_table(root, tier=tier, device="cpu", inline_ids=64, cache_bytes=1 << 18)


def _one(t, rng, want, held):
    """One random call; checks the rows it returns. `held`: prefetches left for later."""
    n = int(rng.choice([1, 16, 100, 700]))
    ids = rng.integers(0, want.shape[0], (n, 1))
    op = rng.random()
    if op < 0.4:
        got = t.lookup(ids)
    elif op < 0.8:
        got = t.prefetch(ids).result(timeout=JOIN_S)
    else:
        held.append((ids, t.prefetch(ids)))  # collected later, or abandoned
        return
    assert torch.equal(got.view(torch.int16), want[ids[:, 0]]), "rows differ"


def _run_threads(target, n):
    errors: list[BaseException] = []

    def guard(i):
        try:
            target(i)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=guard, args=(i,), daemon=True) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(JOIN_S)
    assert not any(th.is_alive() for th in threads), "a thread hung (deadlock?)"
    return errors


@pytest.mark.parametrize("tier", TIERS)
def test_many_threads_get_exact_rows(table, tier):
    root, want = table
    with _open(root, tier) as t:

        def work(i):
            rng, held = np.random.default_rng(i), []
            for _ in range(40):
                _one(t, rng, want, held)
            for ids, p in held[::2]:  # half collected, half abandoned
                got = p.result(timeout=JOIN_S)
                assert torch.equal(got.view(torch.int16), want[ids[:, 0]])

        errors = _run_threads(work, 8)
        assert not errors, errors[0]
        assert t.stats()["tier"] == tier


@pytest.mark.parametrize("tier", TIERS)
def test_close_while_lookups_are_in_flight(table, tier):
    root, want = table
    t = _open(root, tier)
    started = threading.Barrier(7)
    outcomes: list[str] = []

    def work(i):
        rng, held = np.random.default_rng(100 + i), []
        started.wait()
        try:
            while True:
                _one(t, rng, want, held)
        except RuntimeError as e:
            assert "closed" in str(e), e
            outcomes.append("closed")
        for ids, p in held:  # prefetched before the close: exact rows, or the clear error
            try:
                got = p.result(timeout=JOIN_S)
            except RuntimeError as e:
                assert "closed" in str(e), e
                continue
            assert torch.equal(got.view(torch.int16), want[ids[:, 0]])

    def closer(i):
        if i == 6:
            started.wait()
            threading.Event().wait(0.2)
            t.close()
            t.close()  # twice is fine
        else:
            work(i)

    errors = _run_threads(closer, 7)
    assert not errors, repr(errors[0])
    assert outcomes == ["closed"] * 6
    with pytest.raises(RuntimeError, match="closed"):
        t.lookup(np.array([[1]]))
