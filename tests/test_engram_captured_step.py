"""DeepSeek-V4.1's Engram step as the vLLM plugin runs it inside vLLM's decode graph
(`integrations/vllm/engram.py`), without vLLM: one rank's heads of both Engram layers (1 and 14),
both lookups started as soon as the step's ids exist (the graph's own id buffer, vLLM's int32
[T, layers, 24]), layer 1's rows finished first, layer 14's after 13 layers' worth of GPU work;
every replay's rows bit-identical to the resident gather. The plugin's classes over vLLM's run in
the vLLM job (tests/vllm_job/test_engram_plugin.py, CPU: vLLM's DeepSeek-V4.1 has no GPU-less
path there and the vLLM CUDA build is not on the GPU machine)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import plestore
from conftest import assert_bit_identical, requires_cuda
from plestore.distributed.partition import plan_shard
from plestore.integrations.layerlookup import PleLayerLookup
from plestore.integrations.tables import prepare_table

LAYERS = (1, 14)
SLOT, SHARDS = 3, 8  # TP 8: this rank's 3 of 24 hash columns
TOKENS = 8  # a decode step of 8 requests


def _ids(specs, seed: int) -> torch.Tensor:
    """Valid ids of every column of both layers, int32 [T, layers, heads] (vLLM's hash)."""
    rng = np.random.default_rng(seed)
    cols = []
    for spec in specs:
        lo = np.array(spec.hash.head_offsets, dtype=np.int64)
        size = np.array(spec.hash.head_sizes, dtype=np.int64)
        cols.append(lo + rng.integers(0, size, (TOKENS, len(size))))
    return torch.from_numpy(np.stack(cols, axis=1)).int()


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize(
    "tier, extra",
    [
        ("device", {}),
        ("pinned", {}),
        ("mapped", {}),
        ("direct", {}),
        ("cascade", {"device_budget_bytes": 1 << 20, "pinned_budget_bytes": 1 << 20}),
        ("direct", {"gpu_cache_bytes": 1 << 20}),
    ],
)
def test_both_layers_captured_step_exact_across_replays(small_checkpoint, tmp_path, tier, extra):
    ck = small_checkpoint("deepseek-v4.1-flash", "fp8_ue8m0")
    lookups, refs, specs, cols = [], [], [], []
    for lid in LAYERS:
        meta, _ = prepare_table(ck, tmp_path, f"engram.layers.{lid}")
        ref = plestore.open_table(str(meta), tier="device", device="cuda")
        plan = plan_shard(ref.spec, "heads", SLOT, SHARDS)
        table = plestore.open_table(
            str(meta),
            tier=tier,
            device="cuda",
            row_start=plan.rows.start,
            row_end=plan.rows.end,
            timeout_s=3,
            **extra,
        )
        a, b = plan.columns
        lookup = PleLayerLookup(table, b - a, max_tokens=64)
        assert lookup.captures
        lookups.append(lookup)
        refs.append(ref)
        specs.append(ref.spec)
        cols.append((a, b))
    fresh = _ids(specs, 0).cuda()  # what each step's hash writes
    ids = fresh.clone()  # the graph's own id buffer
    x = torch.randn(TOKENS, 1024, device="cuda")
    w = torch.randn(1024, 1024, device="cuda") / 32

    def step() -> list[torch.Tensor]:
        for i, lookup in enumerate(lookups):  # both layers, as soon as the ids exist
            a, b = cols[i]
            lookup.start(ids[:, i, a:b].to(torch.int64))
        out = [lookups[0].finish(TOKENS) * 1]  # layer 1 consumes its rows
        h = x
        for _ in range(13):  # layers 1-13: the GPU work layer 14's reads hide behind
            h = torch.tanh(h @ w)
        out.append(lookups[1].finish(TOKENS) * 1)  # (after the 13 layers, in stream order)
        return out

    step()  # an eager step first, as engines warm up before they capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids.copy_(fresh)
        outs = step()
    for seed in range(1, 4):
        fresh.copy_(_ids(specs, seed).cuda())
        graph.replay()
        torch.cuda.synchronize()
        for i, (ref, out) in enumerate(zip(refs, outs, strict=True)):
            a, b = cols[i]
            assert_bit_identical(out, ref.lookup(fresh[:, i, a:b].long()))
            lookups[i].table.check_feed()
    for obj in (*lookups, *refs):
        obj.close()
