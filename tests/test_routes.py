"""Every route a lookup can take (lookup/plan.py's `Route`) and every place its host work can
run (`Runs`), each forced by a case below and checked for exact rows against the resident
gather, and for the route and place the table reports (`stats()["last_call"]`); a route or
place without a case fails `test_every_route_and_place_has_a_case`, so none goes untested.
GPU-only ones (copies to the device, the table's stream) are marked gpu."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
import torch

import plestore
from conftest import HOST_CORES, assert_bit_identical, requires_cuda
from plestore.lookup.plan import Place, Route, RowSource, Runs
from tier_tables import ROWS, make_table, resident_rows

SHARD = {"row_start": 1000, "row_end": 2000}  # this rank's rows: others come back zeros


class Case(NamedTuple):
    tier: str
    device: str
    how: str  # lookup | prefetch | defer | ahead (defer + run_now) | staged | staged_ids
    tokens: int = 16  # ids [tokens, 4]
    options: dict = {}


ROUTES = {
    Route.DEVICE_READ: Case("device", "cpu", "lookup"),
    Route.TIER_ONE_READ: Case("pinned", "cpu", "lookup"),
    Route.TIER_IN_PLACE: Case("mapped", "cpu", "lookup", options=SHARD),
    Route.TIER_COPY: Case("mapped", "cuda", "lookup", 2000),  # 1.3 MB staged: past UVA
    Route.TIER_CHUNKED_COPY: Case("pinned", "cuda", "lookup", 5000, {"gather": "cpu"}),
    Route.GPU_CACHE: Case("pinned", "cpu", "lookup", options={"gpu_cache_bytes": 64 << 10}),
    Route.STAGED_DEVICE_READ: Case("device", "cpu", "staged"),
    Route.STAGED_DEVICE_IDS: Case("device", "cpu", "staged_ids"),
    Route.STAGED_IN_PLACE: Case("direct", "cpu", "staged", options=SHARD),
    Route.STAGED_COPY: Case("mapped", "cuda", "staged", 512),
    Route.STAGED_GPU_CACHE: Case("mapped", "cpu", "staged", options={"gpu_cache_bytes": 1 << 16}),
    Route.STAGED_GPU_CACHE_COPY: Case(
        "pinned", "cuda", "staged", 512, {"gpu_cache_bytes": 1 << 16}
    ),
}
PLACES = {
    Runs.NOW: Case("direct", "cpu", "lookup"),
    Runs.AT_RESULT: Case("mapped", "cpu", "prefetch"),
    Runs.AHEAD: Case("pinned", "cpu", "ahead", 2000),
    Runs.WORKER: Case("direct", "cpu", "prefetch", 2000, {"inline_ids": 16}),
    Runs.SIDE: Case("device", "cuda", "prefetch"),
}
#: where a deferred prefetch runs when result() comes before run_now()
DEFERRED_AT_RESULT = Case("mapped", "cpu", "defer", 2000)


@pytest.fixture(scope="module")
def table_file(tmp_path_factory):
    return make_table(tmp_path_factory.mktemp("routes"), "fp8_e4m3", 160, block=512)


def _param(key, case: Case):
    marks = [pytest.mark.gpu, requires_cuda] if case.device == "cuda" else []
    return pytest.param(case, id=key.value, marks=marks)


def run_case(table_file, case: Case) -> tuple[dict, torch.Tensor, np.ndarray]:
    """(the call's record, its rows on the CPU, the resident gather's)"""
    path, ref = table_file
    ids = np.random.default_rng(case.tokens).integers(0, ROWS, (case.tokens, 4))
    absent = None
    if "row_start" in case.options:
        absent = (ids < case.options["row_start"]) | (ids >= case.options["row_end"])
    want = resident_rows(ref, ids, absent)
    with plestore.open_table(path, tier=case.tier, device=case.device, **case.options) as t:
        if case.how == "lookup":
            got = t.lookup(ids)
        elif case.how in ("prefetch", "defer", "ahead"):
            pending = t.prefetch(ids, defer=case.how != "prefetch")
            if case.how == "ahead":
                pending.run_now()
            got = pending.result()
        else:
            dev = torch.from_numpy(ids).to(case.device)
            staged = t.staged(ids.shape, ids=dev if case.how == "staged_ids" else None)
            staged.stage(ids) if staged.needs_stage else staged.replayed()
            got = staged.decode()
        if t.device.type == "cuda":
            torch.cuda.synchronize()
        return t.stats()["last_call"], got.cpu(), want


@pytest.mark.parametrize("host_core", HOST_CORES, indirect=True)
@pytest.mark.parametrize("case", [_param(r, c) for r, c in ROUTES.items()])
def test_each_route_gives_the_resident_rows(table_file, case, host_core):
    if host_core == "native" and case.tier == "device":
        pytest.skip("the device tier has no host path")
    route = next(r for r, c in ROUTES.items() if c is case)
    call, got, want = run_case(table_file, case)
    assert call["route"] == route.value
    assert_bit_identical(got, want)


@pytest.mark.parametrize("case", [_param(r, c) for r, c in PLACES.items()])
def test_each_place_gives_the_resident_rows(table_file, case):
    runs = next(r for r, c in PLACES.items() if c is case)
    call, got, want = run_case(table_file, case)
    assert call["runs"] == runs.value
    assert_bit_identical(got, want)


def test_a_deferred_prefetch_without_run_now_runs_at_result(table_file):
    call, got, want = run_case(table_file, DEFERRED_AT_RESULT)
    assert call["runs"] == Runs.AT_RESULT.value
    assert_bit_identical(got, want)


def test_every_route_and_place_has_a_case():
    assert set(ROUTES) == set(Route), set(Route) - set(ROUTES)
    assert set(PLACES) == set(Runs), set(Runs) - set(PLACES)
    assert {r.source for r in Route} == set(RowSource) and {r.place for r in Route} == set(Place)
    for r, c in ROUTES.items():  # a route's fields say what its case makes it
        assert r.staged == c.how.startswith("staged"), r
        device = c.tier == "device"
        assert (r.place is Place.IDS) == (r.source is RowSource.DEVICE_READ) == device, r


def test_the_routes_table_in_the_docs_names_every_route_and_its_test():
    """docs/architecture.md's table: condition -> route -> test, a row per route and place."""
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    table = text[text.index("### Routes") :].split("\n\n")[1]
    for name in [r.value for r in Route] + [r.value for r in Runs]:
        assert f"`{name}`" in table, name
    assert "test_routes.py" in table
