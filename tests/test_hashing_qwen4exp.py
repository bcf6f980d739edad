"""Qwen4Exp n-gram hash: every golden case (batch, per request, chunked, decode) on numpy and
torch, the constants, the constructors, and a clear error for every kind of bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hash_reference import qwen_row_ids

from conftest import devices, load_golden
from plestore.hashing import Qwen4ExpHash, make_hash
from plestore.spec import preset_config, table_specs_from_hf_config

GOLDEN = ["qwen4exp_hash_small_n3.json", "qwen4exp_hash_qwen3_8_flash_next.json"]


def _hasher(golden: str) -> Qwen4ExpHash:
    c = load_golden(golden)["config"]
    return Qwen4ExpHash(
        vocab_size=c["vocab_size"],
        eos_token_id=c["eos_token_id"],
        ngram_size=c["ngram_size"],
        heads_per_ngram=c["heads_per_ngram"],
        ngram_vocab_size_base=c["ngram_vocab_size_base"],
        seed=c["seed"],
        layer_index=c["ple_dense_layer_id"],
        pad_multiple=c["make_ngram_vocab_size_divisible_by"],
    )


def _t(x, device) -> torch.Tensor:
    """torch tensor of a nested list; an empty list is int64 (torch would make it float)."""
    a = np.array(x)
    return torch.from_numpy(a.astype(np.int64) if a.size == 0 else a).to(device)


def _run(h: Qwen4ExpHash, device, input_ids, qsl, context):
    """row_ids on numpy (device None) or torch on `device`; returns python lists."""
    if device is None:
        ids, nxt = h.row_ids(np.array(input_ids), np.array(qsl), np.array(context))
        assert isinstance(ids, np.ndarray) and ids.dtype == np.int64
    else:
        ids, nxt = h.row_ids(*(_t(x, device) for x in (input_ids, qsl, context)))
        assert ids.device.type == device and ids.dtype == torch.int64
    return ids.tolist(), nxt.tolist()


def _batch_cases(golden: str) -> list[tuple[str, dict]]:
    out = []
    for name, case in load_golden(golden)["cases"].items():
        if "input_ids" in case:
            out.append((name, case))
        elif "chunk1" in case:
            out += [(f"{name}.chunk1", case["chunk1"]), (f"{name}.chunk2", case["chunk2"])]
        else:
            out.append((f"{name}.prefill", case["prefill"]))
            out += [(f"{name}.decode{i}", c) for i, c in enumerate(case["decode_steps"])]
    return out


BACKENDS = [None, *devices()]  # None = numpy


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("golden", GOLDEN)
def test_golden_batches_and_requests(golden, device):
    h = _hasher(golden)
    cases = _batch_cases(golden)
    assert len(cases) >= 9
    for name, case in cases:
        ids, nxt = _run(
            h, device, case["input_ids"], case["query_start_loc"], case["ngram_context"]
        )
        assert ids == case["row_ids_flat"], name
        assert nxt == [r["history_after"] for r in case["requests"]], name
        for r in case["requests"]:  # each request alone gives the same ids
            ids, nxt = _run(h, device, r["tokens"], [0, len(r["tokens"])], [r["history_before"]])
            assert ids == r["row_ids"] and nxt == [r["history_after"]], name


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("golden", GOLDEN)
def test_golden_chunked_prefill_and_decode_equal_unsplit(golden, device):
    h = _hasher(golden)
    cases = load_golden(golden)["cases"]
    chunked = cases["chunked_prefill_7_plus_5"]
    fresh = h.fresh_context(1).tolist()
    ids, _ = _run(h, device, chunked["full_tokens"], [0, len(chunked["full_tokens"])], fresh)
    assert ids == chunked["unsplit_row_ids"]
    ids1, ctx = _run(h, device, chunked["chunk1"]["input_ids"], [0, 7], fresh)
    assert ctx == chunked["chunk2"]["ngram_context"]
    ids2, _ = _run(h, device, chunked["chunk2"]["input_ids"], [0, 5], ctx)
    assert ids1 + ids2 == chunked["unsplit_row_ids"]

    dec = cases["prefill_then_5_decode_steps"]
    ids, ctx = _run(h, device, dec["prefill"]["input_ids"], [0, 6], fresh)
    for step in dec["decode_steps"]:  # carry our own context, not the golden one
        assert ctx == step["ngram_context"]
        more, ctx = _run(h, device, step["input_ids"], [0, 1], ctx)
        ids += more
    assert ids == dec["unsplit_row_ids"]
    all_ids, _ = _run(h, device, dec["all_tokens"], [0, len(dec["all_tokens"])], fresh)
    assert all_ids == dec["unsplit_row_ids"]


def test_constants_constructors_and_factory():
    g = load_golden("qwen4exp_hash_qwen3_8_flash_next.json")["config"]
    h = Qwen4ExpHash.from_hf_config(preset_config("qwen3.8-flash-next"))
    assert list(h.multipliers) == g["multipliers"]
    assert list(h.head_sizes) == g["sizes"] and list(h.head_offsets) == g["offsets"]
    assert h.num_rows == g["padded_total_rows"] and h.heads == 16
    (table,) = table_specs_from_hf_config(preset_config("qwen3.8-flash-next"))
    assert h.spec == table.hash
    assert Qwen4ExpHash.from_spec(table.hash).spec == h.spec
    assert isinstance(make_hash(table.hash), Qwen4ExpHash)
    second = load_golden("qwen4exp_hash_qwen3_8_flash_next.json")[
        "hypothetical_second_ple_layer_dense_id_1"
    ]
    cfg = preset_config("qwen3.8-flash-next")
    cfg["text_config"]["ple_layer_ids"] = [2, 5]
    h1 = Qwen4ExpHash.from_hf_config(cfg, layer_index=1)
    assert list(h1.multipliers) == second["multipliers"] and h1.num_rows == 320_005_120
    with pytest.raises(ValueError, match="layer_index 2 is not a dense PLE index"):
        Qwen4ExpHash.from_hf_config(cfg, layer_index=2)
    with pytest.raises(ValueError, match="no Qwen4Exp PLE layers"):
        Qwen4ExpHash.from_hf_config(preset_config("gemma3n-e2b"))
    ctx = h.fresh_context(3)
    assert ctx.shape == (3, 2) and (ctx == 248044).all() and ctx.dtype == np.int64
    assert h.fresh_context(2, device="cpu").tolist() == [[248044] * 2] * 2


def test_real_constants_match_the_reference_on_a_random_batch():
    h = _hasher("qwen4exp_hash_qwen3_8_flash_next.json")
    rng = np.random.default_rng(3)
    toks = rng.choice([0, 1, h.vocab_size - 1, h.eos_token_id, 12345, 248043], 300)
    qsl, ctx = np.array([0, 100, 100, 300]), np.array([[7, 248044], [248044, 9], [0, 248319]])
    ids, _ = h.row_ids(toks, qsl, ctx)
    chunks = [toks[qsl[r] : qsl[r + 1]].tolist() for r in range(3)]
    want = [row for c, t in zip(ctx.tolist(), chunks, strict=True) for row in qwen_row_ids(h, t, c)]
    assert ids.tolist() == want


def test_checkpoint_constants_are_checked():
    h = _hasher("qwen4exp_hash_small_n3.json")
    h.check_checkpoint_constants(
        layer_multipliers=torch.tensor(h.multipliers),
        ngram_heads_vocab_sizes=h.head_sizes,
        ngram_heads_offsets=np.array(h.head_offsets),
    )
    bad = list(h.head_offsets)
    bad[5] += 1
    with pytest.raises(ValueError, match="ngram_heads_offsets disagrees .* at index 5"):
        h.check_checkpoint_constants(ngram_heads_offsets=bad)
    with pytest.raises(ValueError, match="layer_multipliers disagrees"):
        h.check_checkpoint_constants(layer_multipliers=list(h.multipliers[::-1]))


@pytest.mark.parametrize("device", BACKENDS)
def test_edge_batches(device):
    h = _hasher("qwen4exp_hash_small_n3.json")
    ids, nxt = _run(h, device, [], [0], np.zeros((0, 2), dtype=np.int64))
    assert ids == [] and nxt == []
    ids, nxt = _run(h, device, [], [0, 0, 0], [[7, 8], [2, 2]])  # only empty requests
    assert ids == [] and nxt == [[7, 8], [2, 2]]
    ids, nxt = _run(h, device, [5, 6, 7], [0, 0, 3, 3], [[1, 1], [3, 4], [9, 9]])
    assert nxt == [[1, 1], [6, 7], [9, 9]] and len(ids) == 3
    assert ids == _run(h, device, [5, 6, 7], [0, 3], [[3, 4]])[0]


def test_int32_inputs_and_unchecked_path_agree():
    h = _hasher("qwen4exp_hash_small_n3.json")
    case = load_golden("qwen4exp_hash_small_n3.json")["cases"]["batch_4req_mixed_lengths"]
    args = [
        np.array(case[k], dtype=np.int32) for k in ("input_ids", "query_start_loc", "ngram_context")
    ]
    assert h.row_ids(*args)[0].tolist() == case["row_ids_flat"]
    targs = [torch.from_numpy(a) for a in args]
    assert h.row_ids(*targs, check=False)[0].tolist() == case["row_ids_flat"]
    # unchecked garbage: wrong ids, but no out-of-bounds access and ids stay in the table
    ids, _ = h.row_ids(
        torch.tensor([1, 2, 3]),
        torch.tensor([0, 9, 1]),
        torch.tensor([[1, 2], [3, 4]]),
        check=False,
    )
    assert ids.shape == (3, 16) and int(ids.min()) >= 0 and int(ids.max()) < h.num_rows


BAD = [
    ("ids_too_big", dict(input_ids=[1, 2, 5000]), r"input_ids\[2\] = 5000 \(request 0, position 2"),
    (
        "ids_negative",
        dict(input_ids=[1, -1, 3], qsl=[0, 1, 3], ctx=[[2, 2], [2, 2]]),
        r"input_ids\[1\] = -1 \(request 1, position 0 of its chunk\) is outside the vocabulary",
    ),
    ("qsl_not_monotone", dict(qsl=[0, 2, 1, 3], ctx=[[2, 2]] * 3), "not monotone: request 1"),
    ("qsl_bad_start", dict(qsl=[1, 3]), "must start at 0"),
    ("qsl_bad_end", dict(qsl=[0, 2]), "ends at 2, but input_ids holds 3"),
    ("qsl_empty", dict(qsl=[]), "needs R\\+1"),
    ("ctx_width", dict(ctx=[[2, 2, 2]]), r"context has shape \[1, 3\], expected \[1, 2\]"),
    ("ctx_rows", dict(ctx=[[2, 2], [2, 2]]), r"context has shape \[2, 2\], expected \[1, 2\]"),
    ("ctx_value", dict(ctx=[[2, 5000]]), r"context\[0, 1\] = 5000 \(request 0, carried token 1"),
    ("float_ids", dict(input_ids=[1.0, 2.0, 3.0]), "input_ids must hold integers, got dtype"),
    ("2d_ids", dict(input_ids=[[1, 2, 3]]), "input_ids must be 1-D"),
]


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("name,change,message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_clear_error(name, change, message, device):
    h = _hasher("qwen4exp_hash_small_n3.json")
    args = {"input_ids": [1, 2, 3], "qsl": [0, 3], "ctx": [[2, 2]], **change}
    if device is None:
        arrays = [np.array(args[k]) for k in ("input_ids", "qsl", "ctx")]
    else:
        arrays = [_t(args[k], device) for k in ("input_ids", "qsl", "ctx")]
    with pytest.raises(ValueError, match=message):
        h.row_ids(*arrays)


def test_mixed_kinds_and_devices_are_refused():
    h = _hasher("qwen4exp_hash_small_n3.json")  # (the context follows input_ids' kind)
    with pytest.raises(ValueError, match="query_start_loc is a Tensor, but input_ids makes"):
        h.row_ids(np.array([1, 2]), torch.tensor([0, 2]), np.array([[2, 2]]))
    meta = torch.tensor([0, 2], device="meta")
    with pytest.raises(ValueError, match="query_start_loc is on meta but input_ids is on cpu"):
        h.row_ids(torch.tensor([1, 2]), meta, torch.tensor([[2, 2]]))


@pytest.mark.parametrize("device", [None, *devices()])  # None: numpy
def test_decode_row_ids_equal_the_general_path(device):
    """The decode fast path (one token per request) gives row_ids' ids and next context,
    EOS in the tokens and contexts included (the crossing rule) — in numpy and in torch (on the
    device, as a captured decode step hashes its sampled tokens)."""
    h = Qwen4ExpHash.from_hf_config(preset_config("qwen3.8-flash-next"))
    rng = np.random.default_rng(5)
    eos = h.eos_token_id
    for r in (1, 7, 64):
        tokens = rng.integers(0, h.vocab_size, r)
        ctx = rng.integers(0, h.vocab_size, (r, h.context_width))
        tokens[::3], ctx[1::4, 0], ctx[2::5, 1] = eos, eos, eos
        want = h.row_ids(tokens, np.arange(r + 1), ctx)
        if device is None:
            got = h.decode_row_ids(tokens, ctx)
            ids, nxt = h.decode_ids(tokens, ctx), h.advance_context(tokens, ctx)
        else:
            tok_t, ctx_t = (torch.from_numpy(a).to(device) for a in (tokens, ctx))
            got = [x.cpu().numpy() for x in h.decode_row_ids(tok_t, ctx_t)]
            ids = h.decode_ids(tok_t, ctx_t).cpu().numpy()
            nxt = h.advance_context(tok_t, ctx_t).cpu().numpy()
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(ids, want[0])
        np.testing.assert_array_equal(nxt, want[1])
    with pytest.raises(ValueError, match="decode_row_ids takes tokens"):
        h.decode_row_ids(np.zeros(3, np.int64), np.zeros((2, h.context_width), np.int64))
    with pytest.raises(ValueError, match="context must be torch tensors on cpu, as tokens are"):
        h.decode_row_ids(torch.zeros(2, dtype=torch.int64), np.zeros((2, 2), np.int64))


@pytest.mark.parametrize("device", devices())
def test_a_context_of_either_kind_serves_ids_of_either_kind(device):
    """fresh_context() is numpy; torch ids (the README's next step on a GPU) take it, and a
    torch context serves numpy ids: the context follows input_ids, and so does the next one."""
    h = _hasher(GOLDEN[0])
    ids, qsl = [9, 11, 7, 42], [0, 3, 4]
    want, want_ctx = h.row_ids(np.array(ids), np.array(qsl), h.fresh_context(2))
    t_ids, t_qsl = torch.tensor(ids, device=device), torch.tensor(qsl, device=device)
    got, ctx = h.row_ids(t_ids, t_qsl, h.fresh_context(2))  # numpy context, torch ids
    assert got.device.type == ctx.device.type == torch.device(device).type
    assert got.tolist() == want.tolist() and ctx.tolist() == want_ctx.tolist()
    back, np_ctx = h.row_ids(np.array(ids), np.array(qsl), h.fresh_context(2, device))
    assert isinstance(np_ctx, np.ndarray) and back.tolist() == want.tolist()
