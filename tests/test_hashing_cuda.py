"""CUDA-only properties of the torch path (skipped without a GPU; the lead runs them on an
H200): with check=False the hot path makes no host round trip — it runs under
torch.cuda.set_sync_debug_mode("error") and inside a captured CUDA graph — and with checks on,
bad input still raises a clear ValueError."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import load_golden, requires_cuda
from plestore.hashing import EngramHash, IdentityHash, Qwen4ExpHash
from plestore.spec import preset_config

pytestmark = [requires_cuda, pytest.mark.gpu]


def _qwen_batch(num_tokens=4096, num_requests=17, seed=0):
    rng = np.random.default_rng(seed)
    h = Qwen4ExpHash.from_hf_config(preset_config("qwen3.8-flash-next"))
    cuts = np.sort(rng.choice(np.arange(1, num_tokens), num_requests - 1, replace=False))
    qsl = np.concatenate([[0], cuts, [num_tokens]])
    ids = rng.integers(0, h.vocab_size, num_tokens)
    ids[rng.random(num_tokens) < 0.05] = h.eos_token_id
    ctx = rng.integers(0, h.vocab_size, (num_requests, 2))
    return h, ids, qsl, ctx


class _NoSync:
    """Any synchronising CUDA call inside raises (torch's sync debug mode)."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")


def test_unchecked_paths_never_sync():
    h, ids, qsl, ctx = _qwen_batch()
    args = [torch.from_numpy(a).cuda() for a in (ids, qsl, ctx)]
    want = h.row_ids(ids, qsl, ctx)
    h.row_ids(*args, check=False)  # warm-up: puts the constant tables on the device
    with _NoSync():
        got, nxt = h.row_ids(*args, check=False)
    assert got.cpu().tolist() == want[0].tolist() and nxt.cpu().tolist() == want[1].tolist()

    g = load_golden("engram_hash_tiny.json")
    e = EngramHash.from_hf_config(g["config"], token_map=np.arange(65536) % 64)
    case = g["cases"]["dead_span"]
    a = [
        torch.tensor(case[k], device="cuda")
        for k in (
            "input_ids",
            "query_start_loc",
            "lookback_token_ids",
            "dead_mask",
            "lookback_dead_mask",
            "positions",
        )
    ]
    e.row_ids(*a, check=False)
    state = e.fresh_state(1, "cuda")
    e.step(a[0], a[1], state, check=False, dead_mask=a[3])
    with _NoSync():
        got = e.row_ids(*a, check=False)
        e.step(a[0], a[1], state, check=False, dead_mask=a[3])
        IdentityHash(100, "zero").row_ids(a[0], check=False)
    assert got.cpu().tolist() == case["hash_ids"]


def test_qwen_hash_captures_in_a_cuda_graph():
    h, ids, qsl, ctx = _qwen_batch()
    static = [torch.from_numpy(a).cuda() for a in (ids, qsl, ctx)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        h.row_ids(*static, check=False)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, nxt = h.row_ids(*static, check=False)
    for seed in (1, 2):  # new batches of the same shape, replayed
        _, ids2, qsl2, ctx2 = _qwen_batch(seed=seed)
        for dst, src in zip(static, (ids2, qsl2, ctx2), strict=True):
            dst.copy_(torch.from_numpy(src))
        graph.replay()
        want, want_ctx = h.row_ids(ids2, qsl2, ctx2)
        assert out.cpu().tolist() == want.tolist() and nxt.cpu().tolist() == want_ctx.tolist()


def test_checked_cuda_path_names_the_bad_token():
    h, ids, qsl, ctx = _qwen_batch()
    ids[qsl[3]] = h.vocab_size  # every request has >= 1 token (distinct cuts)
    args = [torch.from_numpy(a).cuda() for a in (ids, qsl, ctx)]
    with pytest.raises(ValueError, match=r"\(request 3, position 0 of its chunk\)"):
        h.row_ids(*args)
