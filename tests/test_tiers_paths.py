"""Which path a lookup takes and where it runs: worker vs caller's thread, lookups run ahead,
streams and events on the GPU, and the per-phase metrics they report."""

from __future__ import annotations

import errno
import threading
import time

import numpy as np
import pytest
import torch

import plestore
from conftest import assert_bit_identical, requires_cuda
from tier_tables import ROWS, make_table, resident_rows


@pytest.fixture(scope="module")
def fp8_table(tmp_path_factory):
    return make_table(tmp_path_factory.mktemp("fp8"), "fp8_e4m3", 160, block=512)


@pytest.mark.parametrize("inline_ids", [0, 1 << 20])
def test_worker_and_inline_paths_agree_and_report_errors_at_result(fp8_table, inline_ids):
    """Small lookups run in the caller's thread, large ones on the worker: same rows, and an
    I/O error surfaces from result() on both."""
    path, ref = fp8_table
    with plestore.open_table(path, tier="mapped", device="cpu", inline_ids=inline_ids) as t:
        ids = np.random.default_rng(9).integers(0, ROWS, (64, 16))
        assert_bit_identical(t.lookup(ids), resident_rows(ref, ids))
        orig = t.tier.read

        def failing(rows, out):
            raise OSError(errno.EIO, "injected")

        t.tier.read = failing
        pending = t.prefetch(ids)
        if inline_ids:
            assert not pending.done()  # deferred: runs in the caller's thread at result()
        with pytest.raises(OSError, match="injected"):
            pending.result(timeout=30)
        t.tier.read = orig
        assert_bit_identical(t.lookup(ids), resident_rows(ref, ids))


@pytest.mark.parametrize("tier", ["pinned", "mapped", "direct"])
def test_deferred_lookups_run_in_the_callers_thread_at_any_size(fp8_table, tier):
    """prefetch(defer=True) leaves even a worker-sized lookup to the caller: nothing happens
    on the worker, run_now() does the host work (errors kept for result()), result() returns
    the rows."""
    path, ref = fp8_table
    with plestore.open_table(path, tier=tier, device="cpu", inline_ids=16) as t:
        ids = np.random.default_rng(3).integers(0, ROWS, (512, 4))
        seen = []
        orig = t.tier.read
        t.tier.read = lambda rows, out: (seen.append(threading.current_thread()), orig(rows, out))[
            1
        ]
        pending = t.prefetch(ids, defer=True)
        assert not pending.done() and not seen
        pending.run_now()
        assert pending.done() and set(seen) == {threading.current_thread()}
        assert_bit_identical(pending.result(), resident_rows(ref, ids))

        def failing(rows, out):
            raise OSError(errno.EIO, "injected")

        t.tier.read = failing
        pending = t.prefetch(ids, defer=True)
        pending.run_now()  # the error waits for result()
        with pytest.raises(OSError, match="injected"):
            pending.result()


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda])]
)
@pytest.mark.parametrize("tier", ["pinned", "mapped", "direct"])
def test_an_inference_tensor_out_is_written_outside_inference_mode(fp8_table, tier, device):
    """A buffer made in inference mode (an engine's) is filled by lookups outside it, on the
    host path of every tier, small (one read; on the GPU a kernel reading pinned staging) and
    large (chunked copies), waited for at once or prefetched (the worker): on the CPU the
    decode's torch ops run in inference mode; on the GPU one kernel writes it, in no mode at
    all. Rows exact; nothing asks for a gradient."""
    path, ref = fp8_table
    rng = np.random.default_rng(5)
    with plestore.open_table(path, tier=tier, device=device, gather="cpu", inline_ids=64) as t:
        for tokens in (8, 2000):  # 128 ids; 32,000 ids (2.9 MB staged: copied, in chunks)
            ids = rng.integers(0, ROWS, (tokens, 16))
            with torch.inference_mode():
                out = torch.empty((tokens, 16 * t.dim), dtype=torch.bfloat16, device=device)
            assert out.is_inference() and not torch.is_inference_mode_enabled()
            for got in (t.lookup_into(ids, out), t.prefetch(ids, out=out).result()):
                assert not got.requires_grad
                assert_bit_identical(got.cpu(), resident_rows(ref, ids))


@pytest.mark.parametrize("tier", ["mapped", "direct"])
def test_lookups_waited_on_at_once_hint_only_tiers_that_gain(fp8_table, tier):
    """A decode-sized lookup() reads right after it starts: direct's read-ahead would only probe
    its cache twice, while mapped's WILLNEED (when cold) still puts the pages' reads in flight
    together. prefetch() hints both."""
    path, ref = fp8_table
    with plestore.open_table(path, tier=tier, device="cpu") as t:
        hinted = []
        orig = t.tier.prefetch
        t.tier.prefetch = lambda rows: (hinted.append(len(rows)), orig(rows))[1]
        ids = np.arange(32).reshape(2, 16)
        assert_bit_identical(t.lookup(ids), resident_rows(ref, ids))
        assert hinted == ([32] if tier == "mapped" else [])
        assert_bit_identical(t.prefetch(ids).result(), resident_rows(ref, ids))
        assert hinted[-1] == 32


@pytest.mark.parametrize("timeout_s", [None, 30.0])
@pytest.mark.parametrize("tier", ["pinned", "mapped", "direct"])
def test_lookup_runs_in_the_callers_thread_unless_a_timeout_bounds_its_reads(
    fp8_table, tier, timeout_s, monkeypatch
):
    """lookup() waits at once, so its host path skips the worker handoff even for large
    lookups; prefetch() of the same size still hands its host work to the worker. A storage
    tier's large lookup given a timeout (the call's, or the table's timeout_s) keeps the
    worker, where its wait is bounded: a hung read raises TimeoutError, rows stay exact."""
    path, ref = fp8_table
    ids = np.random.default_rng(8).integers(0, ROWS, (2000, 4))  # 8,000 > inline_ids
    want = resident_rows(ref, ids)
    storage = tier != "pinned"
    with plestore.open_table(
        path, tier=tier, device="cpu", inline_ids=4096, timeout_s=timeout_s
    ) as t:
        handed = []
        worker = t.executor.worker
        submit = worker.submit
        monkeypatch.setattr(worker, "submit", lambda *a: handed.append(1) or submit(*a))
        assert_bit_identical(t.lookup(ids), want)
        assert len(handed) == (storage and timeout_s is not None)
        handed.clear()
        assert_bit_identical(t.lookup(ids, timeout=30), want)
        assert len(handed) == storage
        handed.clear()
        assert_bit_identical(t.prefetch(ids).result(), want)
        assert handed
        if storage:
            orig = t.tier.read
            t.tier.read = lambda rows, out: (time.sleep(0.5), orig(rows, out))[1]
            with pytest.raises(TimeoutError, match="did not finish within 0.05 s"):
                t.lookup(ids, timeout=0.05)
            t.tier.read = orig
            assert_bit_identical(t.lookup(ids), want)


class _DoneEvent:
    """A finished CUDA event: any two are 2 ms apart."""

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return 2.0


def test_metrics_read_finished_gpu_timings_without_being_asked():
    """CUDA events of every call used to pile up until stats(); now finished ones are read once
    enough are waiting, so a server that never asks holds a bounded list."""
    from plestore.lookup.metrics import _RESOLVE_AT, CallRecord, Metrics

    m = Metrics("t", "pinned")
    for _ in range(3 * _RESOLVE_AT):
        m.record(
            CallRecord(
                label="decode",
                path="host",
                rows=1,
                events=[("decode_s", _DoneEvent(), _DoneEvent())],
            )
        )
    assert len(m._pending) < _RESOLVE_AT
    assert m.snapshot()["phases"]["decode"]["decode_s"] == pytest.approx(3 * _RESOLVE_AT * 2e-3)


def test_gpu_times_are_sampled_and_scaled_to_every_call():
    """One host-path call in GPU_TIMING_EVERY records timing events (the first of a phase
    always); the phase's GPU time is scaled from the timed calls to all of them."""
    from plestore.lookup.metrics import GPU_TIMING_EVERY, CallRecord, Metrics

    m = Metrics("t", "mapped")
    calls = 3 * GPU_TIMING_EVERY + 1
    timed = []
    for _ in range(calls):
        timed.append(m.time_gpu("decode"))
        events = [("decode_s", _DoneEvent(), _DoneEvent())] if timed[-1] else []
        m.record(CallRecord(label="decode", path="host", rows=1, events=events))
    assert timed[0] and sum(timed) == 4 and m.time_gpu("prefill")  # each phase's first
    ph = m.snapshot()["phases"]["decode"]
    assert ph["calls"] == calls and ph["decode_s"] == pytest.approx(calls * 2e-3)


def test_metrics_json_and_prometheus(fp8_table):
    path, _ = fp8_table
    with plestore.open_table(path, tier="direct", device="cpu") as t:
        t.lookup(np.arange(64).reshape(16, 4), label="prefill")
        t.lookup(np.arange(4).reshape(1, 4), label="decode")
        snap = t.stats()
        assert set(snap["phases"]) == {"prefill", "decode"}
        assert snap["phases"]["prefill"]["rows"] == 64 and snap["phases"]["decode"]["calls"] == 1
        assert snap["tier"] == "direct" and snap["tier_detail"]["io_engine"] in (
            "io_uring",
            "threads",
        )
        text = t.metrics.prometheus()
        assert 'plestore_rows_total{table="t",tier="direct",phase="prefill"} 64' in text
        assert "plestore_host_bytes" in text


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["device", "pinned"])
def test_device_path_survives_allocator_churn(fp8_table, tier):
    """The device path reads ids and writes out on the table's stream while the caller's stream
    allocates: both tensors must be recorded on the table's stream (regression: run-to-run drift
    of a batch-64 decoder on the H200, 2026-11-29)."""
    path, ref = fp8_table
    rng = np.random.default_rng(5)
    with plestore.open_table(path, tier=tier, device="cuda", gather="gpu") as t:
        for _ in range(40):
            ids = rng.integers(0, ROWS, (4096, 4))
            pending = t.prefetch(torch.from_numpy(ids).cuda())
            junk = torch.full((1 << 20,), -1, dtype=torch.int64, device="cuda")  # reuse bait
            got = pending.result()
            del junk
            assert_bit_identical(got, resident_rows(ref, ids))


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["mapped", "direct", "pinned"])
@pytest.mark.parametrize("n", [4, 1000, 5000])  # inline: UVA read / copy; worker
def test_result_on_another_stream_than_prefetch(fp8_table, tier, n):
    """Rows are ordered on the stream that asks for them, even when prefetch ran on another
    (with GPU work queued on both, so a missing wait would show)."""
    path, ref = fp8_table
    ids = np.random.default_rng(7).integers(0, ROWS, (n, 4))
    opts = {"gather": "cpu"} if tier == "pinned" else {}
    with plestore.open_table(path, tier=tier, device="cuda", **opts) as t:
        a = torch.randn(2048, 2048, device="cuda")
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(s1):
            pending = t.prefetch(ids)
            for _ in range(20):
                a = a @ a / 2048
        with torch.cuda.stream(s2):
            got = pending.result()  # [n, 4 * dim] bf16
        torch.cuda.synchronize()
        assert_bit_identical(got, resident_rows(ref, ids))


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["pinned", "mapped", "direct"])
def test_a_lookup_run_ahead_goes_beside_the_step_queued_before_it(fp8_table, tier):
    """prefetch(defer=True) + run_now() after the caller queued a step: the rows are written on
    the table's stream while that step still runs (not after it, on the caller's stream), into
    memory the caller's later allocations do not take (pinned, gather=auto: the host gathers
    them, as it does every lookup run ahead). Every row is cached first: a cold read of 20,000
    blocks outlasts the step."""
    path, ref = fp8_table
    rng = np.random.default_rng(8)
    with plestore.open_table(path, tier=tier, device="cuda") as t:
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        warm = t.prefetch(np.arange(20000).reshape(5000, 4) % ROWS, defer=True)
        warm.run_now()  # (the first also makes the device iota and the staging: a sync)
        warm.result()
        for _ in range(4):
            ids = rng.integers(0, ROWS, (5000, 4))
            for _ in range(300):  # the step (~60 ms on an H200: longer than any read here)
                a @ a
            step_done = torch.cuda.Event()
            step_done.record()
            pending = t.prefetch(ids, defer=True)
            pending.run_now()
            pending._ready.synchronize()  # the rows are written ...
            beside = not step_done.query()  # ... while the step still runs
            junk = torch.full((1 << 20,), -1, dtype=torch.int64, device="cuda")  # reuse bait
            got = pending.result()
            del junk
            assert_bit_identical(got, resident_rows(ref, ids))
            assert beside and t.stats()["last_call"]["path"] == "host"


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["pinned", "mapped", "direct"])
def test_a_deferred_lookup_run_at_result_waits_for_the_tables_stream(fp8_table, tier):
    """prefetch(defer=True) makes `out` on the table's stream (where run_now() would write it);
    result() without run_now() writes it on the caller's stream, which must first wait for what
    the table's stream still has queued in that memory: here a slow fill of a buffer freed just
    before, whose block `out` takes. Without the wait the fill lands after the rows."""
    path, ref = fp8_table
    ids = np.random.default_rng(4).integers(0, ROWS, (64, 4))
    with plestore.open_table(path, tier=tier, device="cuda", gather="cpu") as t:
        t.lookup(ids)  # warm: the device iota and the staging
        side = t.executor.stream
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            bait = torch.empty((ids.size, t.dim), dtype=t.dtype, device="cuda")
            for _ in range(200):  # ~40 ms on an H200: the caller's stream is idle meanwhile
                a @ a
            bait.fill_(7)
        taken = bait.data_ptr()
        del bait  # its block goes back to the table stream's pool, the fill still queued
        pending = t.prefetch(ids, defer=True)
        assert pending._out.data_ptr() == taken, "out did not take the freed block: no test"
        got = pending.result()
        torch.cuda.synchronize()
        assert_bit_identical(got, resident_rows(ref, ids))


@requires_cuda
@pytest.mark.gpu
def test_prefetch_overlaps_gpu_work_issued_meanwhile(tmp_path):
    """A prefetch's host work (here the pinned tier's host path on the worker thread) runs while
    the GPU executes work the caller queued after it: prefetch, queue matmuls, result() takes
    about the longer of the two, not their sum. Generous bound (0.8 of the sum; perfect overlap
    of equal halves is 0.5): it checks that overlap happens, not how fast anything is."""
    path, _ = make_table(tmp_path, "fp8_e4m3", 160, rows=200_000)
    ids = np.random.default_rng(6).integers(0, 200_000, (4096, 16))
    opts = dict(tier="pinned", device="cuda", gather="cpu", inline_ids=0)
    with plestore.open_table(path, **opts) as t:
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

        def timed(fn) -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        def gpu_work(reps: int) -> None:
            for _ in range(reps):
                a @ a

        def alone() -> None:  # the same path as below (lookup() would run it inline)
            t.prefetch(ids).result()

        for _ in range(3):  # warm: kernels, staging, pools
            timed(alone)
            timed(lambda: gpu_work(4))
        lookup_s = min(timed(alone) for _ in range(5))
        one_s = min(timed(lambda: gpu_work(1)) for _ in range(5))
        reps = max(1, round(lookup_s / one_s))  # about as much GPU time as the lookup takes
        gpu_s = min(timed(lambda: gpu_work(reps)) for _ in range(3))

        def both() -> None:
            pending = t.prefetch(ids)  # host work starts on the worker thread
            gpu_work(reps)  # queued after it, on the caller's stream
            pending.result()

        both_s = min(timed(both) for _ in range(5))
        assert both_s < 0.8 * (lookup_s + gpu_s), (both_s, lookup_s, gpu_s, reps)


def test_the_lookup_shape_contract_is_stated_and_holds(fp8_table):
    """ids [..., k] -> [..., k * dim]: 1-D ids are one token's heads ([k * dim]); ids[..., None]
    give a row per id ([k, dim], as nn.Embedding) — in lookup's docstring and the README."""
    from pathlib import Path

    path, ref = fp8_table
    ids = np.array([3, 7, 11])
    with plestore.open_table(path, tier="mapped", device="cpu") as t:
        flat, rows = t.lookup(ids), t.lookup(ids[:, None])
        assert flat.shape == (3 * 160,) and rows.shape == (3, 160)
        assert torch.equal(flat.view(3, 160), rows)
        assert_bit_identical(rows, resident_rows(ref, ids[:, None]))
    said = "1-D ids [k] give [k * dim]"
    assert said in " ".join(plestore.Table.lookup.__doc__.split())
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert "1-D ids `[k]` give `[k * dim]`" in readme and "`ids[..., None]`" in readme
