"""plestore's Qwen4-Exp hash against SGLang's own: `_prepare_ple_batch` (the batch layout and
each request's n-gram history from its state pool) + the n-gram module's `compute_ngram_ids`,
for a ragged extend batch (EOS inside prompts, an empty request, carried history) and a decode
step (the general path and the fused Triton hash SGLang takes for decode). The pool and the
forward batch are small stand-ins holding what those functions read."""

from __future__ import annotations

import types

import pytest
import torch


class _Pool:
    """SGLang's request-to-token pool as the PLE batch reads it: each request's mamba state
    slot and the n-gram history stored there."""

    def __init__(self, history: torch.Tensor) -> None:
        self.history, self.ple_window_cache = history, None

    def get_mamba_indices(self, req_pool_indices: torch.Tensor) -> torch.Tensor:
        return req_pool_indices + 1  # (slot 0 is SGLang's reserved dummy)

    def get_ngram_context(self, state_indices: torch.Tensor) -> torch.Tensor:
        return self.history[state_indices]


def _forward_batch(mode, lengths: list[int]):
    return types.SimpleNamespace(
        tbo_parent_token_range=None, spec_algorithm=None, spec_info=None,
        _original_forward_mode=None, forward_mode=mode, global_num_token_non_padded_cpu=None,
        extend_seq_lens=torch.tensor(lengths), extend_seq_lens_cpu=lengths,
        req_pool_indices=torch.arange(len(lengths)), out_cache_loc=None,
    )  # fmt: skip


def _sglang_ids(module, cfg, pool, monkeypatch, tokens, mode, lengths, fused=False):
    """SGLang's ids of a step; fused: its decode fast path and fused Triton hash (which SGLang
    takes for CUDA tensors only: allowed here for CPU ones, the kernel interpreted)."""
    from sglang.kernels.ops.embeddings import qwen4_ngram
    from sglang.srt.models import qwen4_exp

    kernel, calls = qwen4_ngram.fused_qwen4_ngram_hash, []

    def counted(*args):
        calls.append(args[0].shape)
        return kernel(*args)

    monkeypatch.setattr(qwen4_ngram, "can_fuse_qwen4_ngram_hash", lambda *a: fused)
    monkeypatch.setattr(qwen4_ngram, "fused_qwen4_ngram_hash", counted)

    monkeypatch.setattr(qwen4_exp, "get_req_to_token_pool", lambda: pool)
    monkeypatch.setenv("SGLANG_ENABLE_QWEN4_PLE_FUSION", "1" if fused else "0")
    monkeypatch.setattr(module, "enable_ple_fusion", fused)
    pool.ple_window_cache = None
    batch = qwen4_exp._prepare_ple_batch(
        tokens, _forward_batch(mode, lengths),
        ngram_size=int(cfg.ngram_size), ngram_eos_token_id=int(cfg.eos_token_id),
    )  # fmt: skip
    assert batch.use_decode_fast_path == (fused and mode.is_decode())
    ids = module.compute_ngram_ids(batch)
    assert len(calls) == (fused and mode.is_decode())  # (the fused kernel ran, or did not)
    return ids


@pytest.fixture
def hashing(stock):
    from plestore.hashing import Qwen4ExpHash

    model_dir, cfg, module = stock["bf16"]
    return cfg, module, Qwen4ExpHash.from_hf_config(model_dir / "config.json")


def _history(cfg, requests: int, gen) -> torch.Tensor:
    """Each request's carried history (slot r + 1), EOS in some: [slots, n - 1]."""
    history = torch.randint(
        0, int(cfg.vocab_size), (requests + 1, cfg.ngram_size - 1), generator=gen
    )
    history[1] = int(cfg.eos_token_id)  # a fresh request
    history[3, -1] = int(cfg.eos_token_id)
    return history


def test_a_ragged_extend_batch_hashes_as_sglang(hashing, monkeypatch):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    cfg, module, ours = hashing
    gen = torch.Generator().manual_seed(11)
    lengths = [7, 0, 12, 1, 20]
    tokens = torch.randint(0, int(cfg.vocab_size), (sum(lengths),), generator=gen)
    tokens[[2, 3, 15, 30]] = int(cfg.eos_token_id)
    history = _history(cfg, len(lengths), gen)
    want = _sglang_ids(
        module, cfg, _Pool(history), monkeypatch, tokens, ForwardMode.EXTEND, lengths
    )
    qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    got, _ = ours.row_ids(tokens, qsl, history[1:])
    assert torch.equal(got, want)


@pytest.mark.parametrize("fused", [False, True], ids=["general", "fused-triton"])
def test_a_decode_step_hashes_as_sglang(hashing, monkeypatch, fused):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    cfg, module, ours = hashing
    gen = torch.Generator().manual_seed(5)
    requests = 9
    tokens = torch.randint(0, int(cfg.vocab_size), (requests,), generator=gen)
    tokens[4] = int(cfg.eos_token_id)
    history = _history(cfg, requests, gen)
    pool = _Pool(history)
    want = _sglang_ids(
        module, cfg, pool, monkeypatch, tokens, ForwardMode.DECODE, [1] * requests, fused
    )
    got, _ = ours.row_ids(tokens, torch.arange(requests + 1), history[1:])
    assert torch.equal(got, want)
