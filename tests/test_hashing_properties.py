"""Properties of the n-gram hashes on random ragged batches (empty requests, EOS/DEAD anywhere,
ids 0 and V-1): numpy == torch == the per-token reference, head h's ids lie in
[offset_h, offset_h + size_h), and splitting any batch into chunks or decode steps never
changes an id."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hash_reference import engram_row_ids, qwen_row_ids
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import devices, load_golden
from plestore.hashing import EngramHash, Qwen4ExpHash

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
QWEN = {
    3: Qwen4ExpHash(vocab_size=5000, eos_token_id=2, ngram_vocab_size_base=1000),
    4: Qwen4ExpHash(
        vocab_size=300,
        eos_token_id=299,
        ngram_size=4,
        heads_per_ngram=3,
        ngram_vocab_size_base=500,
        layer_index=2,
    ),
}
ENGRAM_CFG = load_golden("engram_hash_tiny.json")["config"]
TOKEN_MAP = np.arange(1000) % 64
ENGRAM = {
    3: EngramHash.from_hf_config(ENGRAM_CFG, token_map=TOKEN_MAP),
    4: EngramHash(
        [0, 5, 9],
        compressed_vocab_size=64,
        pad_token_id=2,
        max_ngram_size=4,
        n_heads=3,
        vocab_size=700,
        token_map=TOKEN_MAP,
        layers=[9, 0],
    ),
}


def _token(h: Qwen4ExpHash):
    v = h.vocab_size
    return st.one_of(st.just(h.eos_token_id), st.sampled_from([0, v - 1]), st.integers(0, v - 1))


@st.composite
def qwen_batches(draw, n: int):
    """[(context, tokens)] per request: 0..5 requests of 0..9 tokens, EOS common."""
    h = QWEN[n]
    tok = _token(h)
    return draw(
        st.lists(
            st.tuples(st.lists(tok, min_size=n - 1, max_size=n - 1), st.lists(tok, max_size=9)),
            max_size=5,
        )
    )


def _pack(reqs, n):
    ids = [t for _, toks in reqs for t in toks]
    qsl = np.cumsum([0] + [len(toks) for _, toks in reqs])
    ctx = np.array([c for c, _ in reqs], dtype=np.int64).reshape(len(reqs), n - 1)
    return np.array(ids, dtype=np.int64), qsl, ctx


def _torch(arrays, device):
    return [torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("n", [3, 4])
@SETTINGS
@given(data=st.data())
def test_qwen_numpy_torch_reference_and_head_ranges(n, device, data):
    h = QWEN[n]
    reqs = data.draw(qwen_batches(n))
    ids, qsl, ctx = _pack(reqs, n)
    got, nxt = h.row_ids(ids, qsl, ctx)
    want = [row for c, toks in reqs for row in qwen_row_ids(h, toks, c)]
    assert got.tolist() == want if want else got.shape == (0, h.heads)
    assert nxt.tolist() == [(list(c) + list(t))[-(n - 1) :] for c, t in reqs]
    tg, tn = h.row_ids(*_torch((ids, qsl, ctx), device))
    assert tg.cpu().tolist() == got.tolist() and tn.cpu().tolist() == nxt.tolist()
    tu, _ = h.row_ids(*_torch((ids, qsl, ctx), device), check=False)
    assert tu.cpu().tolist() == got.tolist()
    lo = np.array(h.head_offsets)
    assert ((got >= lo) & (got < lo + np.array(h.head_sizes))).all()


@pytest.mark.parametrize("n", [3, 4])
@SETTINGS
@given(data=st.data())
def test_qwen_chunking_never_changes_ids(n, data):
    h = QWEN[n]
    reqs = data.draw(qwen_batches(n))
    ids, qsl, ctx = _pack(reqs, n)
    whole, whole_ctx = h.row_ids(ids, qsl, ctx)
    # Cut every request into chunks (decode steps are chunks of one); round i hashes each
    # request's i-th chunk (empty once it has none left) with the context the last round gave.
    cuts = [
        sorted(data.draw(st.sets(st.integers(1, max(1, len(t) - 1)), max_size=4))) for _, t in reqs
    ]
    chunks = [
        [t[a:b] for a, b in zip([0, *c], [*c, len(t)], strict=True)]
        for (_, t), c in zip(reqs, cuts, strict=True)
    ]
    got = [[] for _ in reqs]
    state = ctx
    for i in range(max((len(c) for c in chunks), default=0)):
        step = [
            (s, c[i] if i < len(c) else []) for s, c in zip(state.tolist(), chunks, strict=True)
        ]
        rows, state = h.row_ids(*_pack(step, n))
        off = 0
        for r, (_, toks) in enumerate(step):
            got[r] += rows[off : off + len(toks)].tolist()
            off += len(toks)
    assert [row for g in got for row in g] == whole.tolist()
    assert state.tolist() == whole_ctx.tolist()


@st.composite
def engram_batches(draw, n: int):
    """[(lookback newest first, lookback dead, start position, tokens, dead)] per request."""
    tok = st.one_of(st.sampled_from([0, 999]), st.integers(0, 999))
    lb_tok = st.one_of(st.just(-1), tok)
    reqs = []
    for _ in range(draw(st.integers(0, 4))):
        k = draw(st.integers(0, 8))
        reqs.append(
            (
                draw(st.lists(lb_tok, min_size=n - 1, max_size=n - 1)),
                draw(st.lists(st.booleans(), min_size=n - 1, max_size=n - 1)),
                draw(st.sampled_from([0, 1, 2, 7])),
                draw(st.lists(tok, min_size=k, max_size=k)),
                draw(
                    st.lists(st.sampled_from([False, False, False, True]), min_size=k, max_size=k)
                ),
            )
        )
    return reqs


def _pack_engram(reqs, n):
    ids = np.array([t for r in reqs for t in r[3]], dtype=np.int64)
    qsl = np.cumsum([0] + [len(r[3]) for r in reqs])
    lb = np.array([r[0] for r in reqs], dtype=np.int64).reshape(len(reqs), n - 1)
    lbd = np.array([r[1] for r in reqs], dtype=bool).reshape(len(reqs), n - 1)
    pos = np.array([r[2] + j for r in reqs for j in range(len(r[3]))], dtype=np.int64)
    dead = np.array([d for r in reqs for d in r[4]], dtype=bool)
    return ids, qsl, lb, dead, lbd, pos


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("n", [3, 4])
@SETTINGS
@given(data=st.data())
def test_engram_numpy_torch_reference_and_head_ranges(n, device, data):
    h = ENGRAM[n]
    reqs = data.draw(engram_batches(n))
    arrays = _pack_engram(reqs, n)
    got = h.row_ids(*arrays)
    want = [
        row
        for lb, lbd, p0, toks, dead in reqs
        for row in engram_row_ids(
            h, toks, [p0 + j for j in range(len(toks))], dead, lb, lbd, TOKEN_MAP
        )
    ]
    assert got.tolist() == want if want else got.shape == (0, len(h.layers), h.columns)
    assert h.row_ids(*_torch(arrays, device)).cpu().tolist() == got.tolist()
    assert h.row_ids(*_torch(arrays, device), check=False).cpu().tolist() == got.tolist()
    lo = np.array(h.head_offsets)  # [L, cols]
    assert ((got >= lo) & (got < lo + np.array(h.head_sizes))).all()


@pytest.mark.parametrize("n", [3, 4])
@SETTINGS
@given(data=st.data())
def test_engram_chunking_never_changes_ids(n, data):
    """A sequence from position 0, hashed whole or cut into chunks through step()."""
    h = ENGRAM[n]
    k = data.draw(st.integers(1, 14))
    toks = np.array(data.draw(st.lists(st.integers(0, 999), min_size=k, max_size=k)))
    dead = np.array(data.draw(st.lists(st.booleans(), min_size=k, max_size=k)))
    whole, _ = h.step(toks, [0, k], h.fresh_state(1), dead_mask=dead)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, k - 1)), max_size=5)))
    state, parts = h.fresh_state(2), []
    for a, b in zip([0, *cuts], [*cuts, k], strict=True):
        # a second, empty request rides along: its state must not move
        ids, state = h.step(toks[a:b], [0, b - a, b - a], state, dead_mask=dead[a:b])
        parts.append(ids)
    assert np.concatenate(parts).tolist() == whole.tolist()
    assert state.next_position.tolist() == [k, 0]
    assert state.lookback_token_ids[1].tolist() == [-1] * (n - 1)
