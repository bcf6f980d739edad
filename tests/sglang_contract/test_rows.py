"""The plugin's embedding inside SGLang's own `Qwen4ExpNGramEmbedding` (built on CPU tensors by
SGLang's constructor, the plugin loaded by SGLang's `load_plugins()`) against SGLang's own
module over its `file` backend loaded with the same checkpoint's rows: every row of the table
through SGLang's gather kernel (Triton's interpreter) and `* weight_scale`, bf16 and FP8, every
tier a CPU serves, a TP rank's part, and the PLE layer's prefetch one layer ahead."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from .conftest import PREFIX, build_ngram

TIERS = ["device", "pinned", "mapped", "direct"]


def _bits(rows: torch.Tensor) -> torch.Tensor:
    return rows.contiguous().view(torch.int16)


def _rows(emb, ids: torch.Tensor) -> torch.Tensor:
    """What SGLang's n-gram module computes from a lookup: reduce(gather(ids)) * weight_scale."""
    return emb(ids) * emb.weight_scale


def _ours(plugin, stock, fmt, tier, tmp_path, rank_rows=None):
    """SGLang's n-gram module built with the plugin loaded, its table opened (on rank_rows,
    a TP rank's vocab range of two, where given)."""
    from plestore.integrations.settings import PlestoreSettings

    model_dir, cfg, theirs = stock[fmt]
    cfg.ple_offload_embedding = False  # (the plugin builds its table whatever the flag says)
    module = build_ngram(cfg)
    assert cfg.ple_offload_embedding is False  # (restored after the build)
    emb = module.ngram_embedding
    assert isinstance(emb, plugin) and not list(emb.parameters())  # no host table, no file
    emb.weight_scale.copy_(theirs.ngram_embedding.weight_scale)  # (as load_weights does)
    if rank_rows is not None:
        start, end = rank_rows
        emb.shard_indices = types.SimpleNamespace(
            org_vocab_start_index=start, org_vocab_end_index=end
        )
        emb.tp_size = 2
    raw = {"tier": tier, "table_dir": str(tmp_path / "tables")}
    emb.open(str(model_dir), PlestoreSettings.parse(raw, "PLESTORE_SGLANG", "SGLang"))
    return module


def _all_ids(emb, heads: int) -> torch.Tensor:
    rows = emb.org_vocab_size
    return torch.arange(-(-rows // heads) * heads).remainder(rows).view(-1, heads)  # [T, heads]


@pytest.fixture(scope="module")
def sglang_rows(stock):
    """{format: every row of the table as SGLang's own module gives it, [T, 16, dim]}."""
    return {
        fmt: _rows(stock[fmt][2].ngram_embedding, _all_ids(stock[fmt][2].ngram_embedding, 16))
        for fmt in ("bf16", "fp8_e4m3")
    }


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("tier", TIERS)
def test_every_row_equals_sglangs_own_gather(plugin, stock, sglang_rows, fmt, tier, tmp_path):
    ours = _ours(plugin, stock, fmt, tier, tmp_path).ngram_embedding
    assert ours.lookup.table.tier.name == tier
    want = sglang_rows[fmt]
    got = _rows(ours, _all_ids(ours, ours.heads))
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.equal(_bits(got), _bits(want)), (fmt, tier)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
def test_two_ranks_parts_sum_to_sglangs_rows(plugin, stock, fmt, tmp_path, monkeypatch):
    """Each TP rank's table holds its vocab range; its part gives other ranks' ids -0.0 (the
    identity of SGLang's float all-reduce, here a plain sum), and the parts' sum times
    weight_scale is SGLang's rows, bitwise."""
    from sglang.srt.models import qwen4_exp

    monkeypatch.setattr(qwen4_exp, "tensor_model_parallel_all_reduce", lambda x: x)
    theirs = stock[fmt][2].ngram_embedding
    rows = theirs.org_vocab_size
    ids = _all_ids(theirs, 16)[::7]  # [T, 16]
    parts = []
    for rank, rank_rows in enumerate([(0, rows // 2), (rows // 2, rows)]):
        emb = _ours(plugin, stock, fmt, "mapped", tmp_path / str(rank), rank_rows).ngram_embedding
        assert (emb.lookup.table.row_range.start, emb.lookup.table.row_range.end) == rank_rows
        part = emb(ids)  # [T, 16, dim]
        absent = (ids < rank_rows[0]) | (ids >= rank_rows[1])
        assert bool((_bits(part[absent]) == _bits(torch.tensor(-0.0, dtype=part.dtype))).all())
        parts.append(part)
    want = _rows(theirs, ids)
    assert torch.equal(_bits((parts[0] + parts[1]) * theirs.weight_scale), _bits(want))


class _Stream:
    """A stand-in for SGLang's prefetch stream on a CPU (ordering is program order here)."""

    def wait_stream(self, other) -> None:
        pass


@pytest.mark.parametrize("tier", ["pinned", "direct"])
def test_the_layers_prefetch_one_layer_ahead_gives_sglangs_rows(
    plugin, stock, tier, tmp_path, monkeypatch
):
    """SGLang's PLE layer starts the next layer's lookup (`start_prefetch`: gather on its
    prefetch stream) and consumes it where the layer runs (`_consume_prefetched_embeddings`:
    reduce, * weight_scale): the rows equal SGLang's own for a decode batch. Only the CUDA
    stream calls are stubbed."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.models import qwen4_exp

    from plestore.integrations.settings import PlestoreSettings

    model_dir, cfg, theirs = stock["fp8_e4m3"]
    pool = types.SimpleNamespace(ple_window_cache=None)
    monkeypatch.setattr(qwen4_exp, "get_req_to_token_pool", lambda: pool)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    cfg.ple_offload_embedding = False
    layer = qwen4_exp.Qwen4ExpPLELayer(cfg, None, PREFIX.rsplit(".", 1)[0], 1, 0)
    emb = layer.ple_embedding.ngram_embedding
    assert isinstance(emb, plugin)
    emb.weight_scale.copy_(theirs.ngram_embedding.weight_scale)
    raw = {"tier": tier, "table_dir": str(tmp_path / "tables")}
    emb.open(str(model_dir), PlestoreSettings.parse(raw, "PLESTORE_SGLANG", "SGLang"))
    layer._prefetch_stream = _Stream()  # (on CUDA the plugin's hook gives it a real one)
    gen = torch.Generator().manual_seed(3)
    for tokens in (1, 8, 64):
        context = torch.randint(0, int(cfg.vocab_size), (tokens, cfg.ngram_size), generator=gen)
        context[::5, 1] = int(cfg.eos_token_id)
        positions = torch.arange(tokens)
        batch = qwen4_exp._PLEBatch(
            mode=ForwardMode.DECODE, use_decode_fast_path=False, physical_tokens=tokens,
            processed_tokens=tokens, lengths=torch.ones(tokens, dtype=torch.long), row_width=1,
            req_indices=positions, token_offsets=torch.zeros_like(positions),
            valid_tokens=torch.ones(tokens, dtype=torch.bool), state_indices=positions,
            ngram_context=context, ngram_eos_token_id=int(cfg.eos_token_id),
        )  # fmt: skip
        pool.ple_window_cache = None
        want = _rows(theirs.ngram_embedding, theirs.compute_ngram_ids(batch)).flatten(1)
        pool.ple_window_cache = None
        layer.start_prefetch(batch, forward_batch=None)
        got = layer._consume_prefetched_embeddings(forward_batch=None)
        assert got.shape == want.shape == (tokens, cfg.ple_embed_dim)
        assert torch.equal(_bits(got), _bits(want)), (tier, tokens)
