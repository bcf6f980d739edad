"""The vLLM plugin's engine-agnostic parts, without vLLM: its settings, its tables (packed from a
checkpoint, reused, another checkpoint's refused) and its per-layer lookup (every tier, exact;
vocab-parallel parts combined exactly). The parts that need a vLLM engine run in the vLLM job
(tests/vllm_job)."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import torch

import plestore
from conftest import assert_bit_identical, requires_cuda
from plestore.integrations.layerlookup import PleLayerLookup
from plestore.integrations.tables import TableMismatchError, ple_table_name, prepare_table
from plestore.integrations.vllm.config import (
    ALLOW_UNTESTED,
    PlestoreSettings,
    UnsupportedVllm,
    check_vllm_version,
)

QWEN = "qwen3.8-flash-next"
TIERS = ["device", "pinned", "mapped", "direct"]
LAYER = 1  # the preset's one PLE layer (ple_layer_ids [2])


def _settings(**conf) -> PlestoreSettings:
    return PlestoreSettings.from_additional_config({"plestore": conf})


def test_no_entry_is_no_settings():
    for additional in (None, {}, {"other": 1}, {"plestore": None}):
        assert PlestoreSettings.from_additional_config(additional) is None


def test_settings_map_onto_table_options(tmp_path):
    s = _settings(tier="direct", cache_bytes=1 << 20, table_dir=str(tmp_path), pack_timeout_s=5)
    with plestore.defaults.set(threads=7):  # (as PLESTORE_THREADS=7 would)
        opts = s.table_options(row_start=10, row_end=20, device="cpu")
    assert (opts.tier, opts.cache_bytes, opts.threads) == ("direct", 1 << 20, 7)
    assert (opts.row_start, opts.row_end, s.pack_timeout_s) == (10, 20, 5.0)
    assert s.tables_in("/m") == tmp_path and _settings().tables_in("/m") == type(tmp_path)(
        "/m/plestore"
    )


@pytest.mark.parametrize(
    "conf, message",
    [
        ({"tierr": "x"}, "unknown key 'tierr'; known keys: cache_bytes, check_ids"),
        ({"row_end": 5}, "row_end is set by vLLM"),
        ({"device": "cpu"}, "device is set by vLLM"),
        ({"tier": "nvme"}, "tier must be one of"),
        ({"threads": 0}, "threads must be >= 1"),
        ({"pack_timeout_s": "soon"}, "pack_timeout_s must be a finite number > 0"),
        ({"pack_timeout_s": float("nan")}, "pack_timeout_s must be a finite number > 0"),
        ({"pack_timeout_s": float("inf")}, "pack_timeout_s must be a finite number > 0"),
        ({"table_dir": 3}, "table_dir must be a path"),
    ],
)
def test_bad_settings_name_the_key(conf, message):
    with pytest.raises(ValueError, match=message):
        _settings(**conf)
    with pytest.raises(ValueError, match="must be an object"):
        PlestoreSettings.from_additional_config({"plestore": "mapped"})


def test_vllm_release_check(monkeypatch):
    """Each tested release gets its own adapter; another is refused naming the tested range and
    the one setting that runs it anyway, which then runs the nearest tested adapter."""
    monkeypatch.delenv(ALLOW_UNTESTED, raising=False)
    for ok, line in (("0.32.0", "0.32"), ("0.32.3+cpu", "0.32"), ("0.33.0", "0.33")):
        assert check_vllm_version(ok).version == line
    assert check_vllm_version("0.34.1.dev4+cu130").nvfp4
    for bad in ("0.31.2", "0.35.0", "1.0.0"):
        with pytest.raises(
            UnsupportedVllm,
            match=rf"tested with vLLM 0\.32\.x to 0\.34\.x; this is vLLM {bad}\..*"
            rf"set {ALLOW_UNTESTED}=1 to run it anyway at your own risk",
        ):
            check_vllm_version(bad)
    monkeypatch.setenv(ALLOW_UNTESTED, "1")
    assert check_vllm_version("0.35.0").version == "0.34"
    assert check_vllm_version("0.31.2").version == "0.32"


def test_tables_are_packed_once_then_reused(small_checkpoint, tmp_path):
    ck = small_checkpoint(QWEN, "bf16")
    meta, reused = prepare_table(ck, tmp_path, ple_table_name(LAYER))
    assert not reused and meta == tmp_path / "ple.layers.1.json"
    stat = meta.with_suffix(".rows").stat()
    meta2, reused = prepare_table(ck, tmp_path, ple_table_name(LAYER))
    assert reused and meta2 == meta
    assert meta.with_suffix(".rows").stat().st_mtime_ns == stat.st_mtime_ns
    f32, _ = prepare_table(ck, tmp_path, ple_table_name(LAYER), "fp32")  # another dtype
    assert plestore.TableSpec.from_dict(_spec(f32)).format == "fp32"


def _spec(meta):
    from plestore.tablefile import TableFile

    return TableFile.open(meta).spec.to_dict()


def test_another_checkpoints_tables_are_refused(small_checkpoint, tmp_path):
    prepare_table(small_checkpoint(QWEN, "bf16"), tmp_path, ple_table_name(LAYER))
    other = small_checkpoint(QWEN, "bf16", seed=1)
    with pytest.raises(TableMismatchError, match=r"fingerprint \w+\); this engine's checkpoint"):
        prepare_table(other, tmp_path, ple_table_name(LAYER))


def test_missing_table_and_unscaled_fp8_are_refused(small_checkpoint, tmp_path):
    with pytest.raises(ValueError, match=r"has no table ple\.layers\.7 \(its tables: ple"):
        prepare_table(small_checkpoint(QWEN, "bf16"), tmp_path, ple_table_name(7))
    with pytest.raises(ValueError, match="shards are F8_E4M3 but the engine loads this table"):
        prepare_table(small_checkpoint(QWEN, "fp8_e4m3"), tmp_path, ple_table_name(LAYER), "bf16")


def test_a_filesystem_without_o_direct_is_named(small_checkpoint, tmp_path, monkeypatch):
    meta, _ = prepare_table(small_checkpoint(QWEN, "bf16"), tmp_path, ple_table_name(LAYER))
    real = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    with pytest.raises(OSError, match="does not support O_DIRECT"):
        plestore.open_table(meta, tier="direct", device="cpu")


@pytest.fixture(scope="module")
def table_meta(tmp_path_factory, small_checkpoint):
    out = tmp_path_factory.mktemp("tables")
    return prepare_table(small_checkpoint(QWEN, "fp8_e4m3"), out, ple_table_name(LAYER))[0]


def _ids(table, tokens, heads, seed=0):
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, table.spec.rows, (tokens, heads), dtype=np.int64))


@pytest.mark.parametrize("tier", TIERS)
def test_a_layers_lookup_equals_the_resident_gather(table_meta, tier):
    ref = plestore.open_table(table_meta, tier="device", device="cpu")
    table = plestore.open_table(table_meta, tier=tier, device="cpu")
    heads = table.spec.heads
    lookup = PleLayerLookup(table, heads, max_tokens=64)
    try:
        assert not lookup.captures  # (on CPU nothing is captured)
        for step, tokens in enumerate([64, 1, 7, 1]):
            ids = _ids(table, tokens, heads, seed=step)
            lookup.start(ids)
            rows = lookup.finish(tokens - step % 3)  # (the engine may take fewer than it hashed)
            assert rows.shape == (tokens - step % 3, heads * table.dim)
            assert_bit_identical(rows, ref.lookup(ids)[: tokens - step % 3])
        fed = table.stats()["phases"].get("graph", {}).get("calls", 0)
        assert fed == (0 if table.tier.can_read_device else 4)  # (host tiers: the feed's thread)
        with pytest.raises(ValueError, match="65 tokens in one step, more than the 64"):
            lookup.start(_ids(table, 65, heads))
        with pytest.raises(ValueError, match=f"ids must be \\[tokens, {heads}\\]"):
            lookup.start(_ids(table, 3, heads + 1))
    finally:
        lookup.close()
        ref.close()


@pytest.mark.parametrize("tier", ["mapped", "direct"])
def test_a_fed_steps_failure_surfaces_at_its_finish(table_meta, tier):
    """On CPU a host tier's step runs through the graph feed: a step whose host read failed
    raises at its own finish, naming the table; the next step runs again."""
    from plestore.lookup.graphfeed import FeedError

    ref = plestore.open_table(table_meta, tier="device", device="cpu")
    table = plestore.open_table(table_meta, tier=tier, device="cpu", timeout_s=5)
    heads = table.spec.heads
    lookup = PleLayerLookup(table, heads, max_tokens=8)
    try:
        lookup.start(torch.full((2, heads), table.spec.rows, dtype=torch.int64))
        with pytest.raises(FeedError, match=f"table {table.spec.name}: step 1's host read"):
            lookup.finish(2)
        ids = _ids(table, 2, heads)
        lookup.start(ids)
        assert_bit_identical(lookup.finish(2), ref.lookup(ids))
    finally:
        lookup.close()
        ref.close()


def test_finish_without_start_is_an_error(table_meta):
    lookup = PleLayerLookup(plestore.open_table(table_meta, tier="mapped", device="cpu"), 16, 8)
    with pytest.raises(RuntimeError, match="finish\\(\\) without a start\\(\\)"):
        lookup.finish(1)
    lookup.close()


@pytest.mark.parametrize("tier", ["device", "mapped", "direct"])
def test_vocab_parallel_parts_sum_to_the_full_rows(table_meta, tier):
    """Two ranks' tables (vLLM's split of the rows), their parts summed as floats, as any
    communicator sums them (bf16 pairwise, or in float32): the full rows bit for bit, their
    -0.0 values included (other ranks' rows are -0.0); without `summed` a part's +0.0 rows
    would turn them into +0.0."""
    full = plestore.open_table(table_meta, tier="device", device="cpu")
    rows, heads = full.spec.rows, full.spec.heads
    ids = _ids(full, 40, heads)
    want = full.lookup(ids)
    assert ((want == 0) & torch.signbit(want)).any()  # (-0.0 values: the sum must keep them)
    parts = {}
    for summed in (True, False):
        for start, end in ((0, rows // 2), (rows // 2, rows)):
            t = plestore.open_table(
                table_meta, tier=tier, device="cpu", row_start=start, row_end=end
            )
            lookup = PleLayerLookup(t, heads, 40, summed=summed)
            lookup.start(ids)
            parts.setdefault(summed, []).append(lookup.finish(40).clone())
            lookup.close()
    a, b = parts[True]
    assert_bit_identical(a + b, want)
    assert_bit_identical((a.float() + b.float()).to(a.dtype), want)
    a, b = parts[False]
    assert not torch.equal((a + b).view(torch.int16), want.view(torch.int16))
    full.close()


def test_negative_zero_is_the_identity_of_a_float_sum():
    """What `summed` relies on: x + -0.0 is x, bit for bit, for every finite or infinite bf16
    (-0.0 and +0.0 included), however many -0.0 parts and in any order; +0.0 is not."""
    words = np.array([0x8000, 0x0000, 0x3F80, 0xFF80, 0x7F7F, 0x0001, 0x8001], np.uint16)
    x = torch.from_numpy(words.view(np.int16)).view(torch.bfloat16)  # -0, +0, 1, -inf, max, ...
    neg = torch.full_like(x, -0.0)
    for total in (x + neg, neg + x + neg, (neg.float() + x.float() + neg.float()).to(x.dtype)):
        assert torch.equal(total.view(torch.int16), x.view(torch.int16))
    assert (x + torch.zeros_like(x)).view(torch.int16)[0] == 0  # +0.0 loses the -0.0


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("beside", [True, False])
@pytest.mark.parametrize(
    "tier, gather",
    [
        ("device", "auto"),
        ("pinned", "auto"),
        ("pinned", "cpu"),
        ("mapped", "auto"),
        ("direct", "auto"),
    ],
)
def test_a_captured_decode_step_reads_the_graphs_own_ids(table_meta, tier, gather, beside):
    """As vLLM's captured decode step runs every tier: the ids hashed into a fixed buffer
    inside the graph, the lookup captured with them (a GPU-read tier's kernel; a host tier's
    post to the table's host thread and the wait for its rows), on a side stream beside the
    layer between start and finish or in the caller's; every replay's rows exact."""
    ref = plestore.open_table(table_meta, tier="device", device="cuda")
    table = plestore.open_table(table_meta, tier=tier, device="cuda", gather=gather, timeout_s=3)
    heads, tokens = table.spec.heads, 8
    lookup = PleLayerLookup(table, heads, max_tokens=64, beside=beside)
    assert lookup.captures
    fresh = _ids(table, tokens, heads).cuda()  # what each step's hash produces
    ids = fresh.clone()  # the graph's own id buffer
    layer = torch.randn(2048, 2048, device="cuda")  # layer 0, between start and finish
    lookup.start(ids)  # an eager step first, as engines warm up before they capture
    lookup.finish(tokens)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids.copy_(fresh)
        lookup.start(ids)
        for _ in range(4):
            layer = layer @ layer.T * 1e-3
        out = lookup.finish(tokens) * 1  # the layer consuming the rows
    for step in range(3):
        fresh.copy_(_ids(table, tokens, heads, seed=step + 1).cuda())
        graph.replay()
        assert_bit_identical(out, ref.lookup(fresh))
        table.check_feed()
    lookup.close()
    ref.close()


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["device", "pinned", "mapped", "direct"])
def test_a_captured_per_token_lookup_reads_ids_the_graph_masks(table_meta, tier):
    """As the plugin's Gemma 3n runs inside vLLM's graph: one row a token (heads 1), its ids
    vLLM's int32 input ids masked and widened inside the graph; every replay's rows exact."""
    ref = plestore.open_table(table_meta, tier="device", device="cuda")
    table = plestore.open_table(table_meta, tier=tier, device="cuda", timeout_s=3)
    rows, tokens = table.spec.rows, 8
    lookup = PleLayerLookup(table, 1, max_tokens=64)
    assert lookup.captures
    fresh = torch.zeros(tokens, dtype=torch.int32, device="cuda")  # the runner's input ids

    def step() -> torch.Tensor:
        flat = torch.where(fresh < rows, fresh, 0).reshape(-1, 1).long()  # [T, 1]
        lookup.start(flat)
        return lookup.finish(tokens) * 1

    step()  # an eager step first, as engines warm up before they capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in range(3):
        want = _ids(table, tokens, 1, seed=seed + 1).cuda()  # [T, 1]
        fresh.copy_(want[:, 0].int())
        graph.replay()
        assert_bit_identical(out, ref.lookup(want))
        table.check_feed()
    lookup.close()
    ref.close()


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["mapped", "direct"])
def test_more_captures_than_torchs_stream_pool_each_make_their_feed(table_meta, tier):
    """As vLLM captures a decode graph a batch size, all on one capture stream of torch's pool,
    each step's ids widened inside the graph (Gemma's, Engram's): a fed lookup made inside every
    capture, its buffers on a side stream. torch hands its 32 pool streams out in turn, so
    past 32 captures a new side stream is the capture's own (its sync would end the capture):
    every capture must still succeed and every graph's replay be exact."""
    ref = plestore.open_table(table_meta, tier="device", device="cuda")
    table = plestore.open_table(table_meta, tier=tier, device="cuda", timeout_s=3)
    sizes = range(1, 41)
    lookup = PleLayerLookup(table, 1, max_tokens=max(sizes))
    fresh = torch.zeros(max(sizes), dtype=torch.int32, device="cuda")  # the runner's input ids
    capture = torch.cuda.Stream()  # (vLLM's graph_capture stream: one of the pool)
    graphs = []
    for n in sizes:

        def step(n=n) -> torch.Tensor:
            lookup.start(fresh[:n].reshape(-1, 1).long())  # [n, 1]: new inside each graph
            return lookup.finish(n) * 1

        step()  # an eager step first, as engines warm up before they capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=capture):
            out = step()
        graphs.append((n, graph, out))
    for n, graph, out in graphs:
        want = _ids(table, n, 1, seed=n).cuda()  # [n, 1]
        fresh[:n].copy_(want[:, 0].int())
        graph.replay()
        assert_bit_identical(out, ref.lookup(want))
        table.check_feed()
    lookup.close()
    ref.close()


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["pinned", "mapped", "direct"])
def test_a_host_tier_runs_between_graph_segments(table_meta, tier):
    """capture=False (as without Triton): between two graph segments (vLLM's eager break) the
    lookup reads the ids the first segment wrote, and the second reads its rows."""
    ref = plestore.open_table(table_meta, tier="device", device="cuda")
    table = plestore.open_table(table_meta, tier=tier, device="cuda", gather="cpu")
    heads, tokens = table.spec.heads, 8
    lookup = PleLayerLookup(table, heads, max_tokens=64, capture=False)
    assert not lookup.captures
    fresh = _ids(table, tokens, heads).cuda()
    ids = torch.zeros_like(fresh)
    rows = torch.zeros(tokens, heads * table.dim, dtype=table.dtype, device="cuda")
    first, second = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(first):
        ids.copy_(fresh)
    with torch.cuda.graph(second):
        out = rows * 1
    for step in range(3):
        fresh.copy_(_ids(table, tokens, heads, seed=step + 1).cuda())
        first.replay()
        lookup.start(ids)  # the eager break
        rows.copy_(lookup.finish(tokens))
        second.replay()
        assert_bit_identical(out, ref.lookup(fresh))
    torch.cuda.synchronize()
    with torch.cuda.graph(torch.cuda.CUDAGraph()), pytest.raises(RuntimeError, match="outside"):
        lookup.start(ids)  # refused before any CUDA work, inside a capture
    lookup.close()
    ref.close()


def test_the_docs_install_from_a_clone_and_capture_is_no_setting():
    """docs/vllm.md and the README install from a clone (plestore is not on PyPI), say what the
    CPU build's install removes, and call `capture` an argument of PleLayerLookup: as a setting
    it is refused naming the key."""
    from pathlib import Path

    from plestore.integrations.settings import PlestoreSettings

    root = Path(__file__).resolve().parents[1]
    docs = (root / "docs" / "vllm.md").read_text() + (root / "README.md").read_text()
    assert '"plestore[vllm]"' not in docs and '-e ".[vllm]"' in docs
    assert "pip uninstall -y torchaudio torchcodec" in docs
    assert "`PleLayerLookup(..., capture=False)`" in docs
    with pytest.raises(ValueError, match="unknown key 'capture'"):
        PlestoreSettings.parse({"capture": False}, "additional_config.plestore", "vLLM")
