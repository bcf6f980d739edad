"""Engram hash: the golden cases (numpy, torch), the real DeepSeek-V4.1-Flash constants,
chunking through `step`, the compressed token map (built offline from a tiny tokenizer), and
clear errors for bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hash_reference import engram_row_ids

from conftest import devices, load_golden
from plestore.hashing import EngramHash, EngramState, make_hash
from plestore.hashing.backend import is_torch
from plestore.hashing.token_map import (
    check_token_map,
    compressed_token_map,
    load_token_map,
    save_token_map,
)
from plestore.spec import preset_config, table_specs_from_hf_config

G = load_golden("engram_hash_tiny.json")
TOKEN_MAP = np.arange(65536) % G["config"]["engram_compressed_vocab_size"]  # the golden's map
BACKENDS = [None, *devices()]  # None = numpy


def _golden_hash(**kw) -> EngramHash:
    return EngramHash.from_hf_config(G["config"], token_map=TOKEN_MAP, **kw)


def _arrays(case: dict, device):
    """The case's inputs; the golden lookbacks are ragged (2 or 3 per request), so rows are
    padded with unknown (-1), which lies past the n-1 columns the hash reads anyway."""
    w = max(len(r) for r in case["lookback_token_ids"])
    lb = [r + [-1] * (w - len(r)) for r in case["lookback_token_ids"]]
    lbd = [r + [False] * (w - len(r)) for r in case["lookback_dead_mask"]]
    out = [
        case["input_ids"],
        case["query_start_loc"],
        lb,
        case["dead_mask"],
        lbd,
        case["positions"],
    ]
    if device is None:
        return [np.array(x) for x in out]
    return [torch.tensor(x, device=device) for x in out]


@pytest.mark.parametrize("with_positions", [True, False])
@pytest.mark.parametrize("device", BACKENDS)
def test_golden_cases(device, with_positions):
    h = _golden_hash()
    assert len(G["cases"]) == 6
    for name, case in G["cases"].items():
        ids, qsl, lb, dead, lbd, pos = _arrays(case, device)
        got = h.row_ids(ids, qsl, lb, dead, lbd, pos if with_positions else None)
        assert got.dtype in (np.int64, torch.int64) and tuple(got.shape) == (len(ids), 2, 4)
        assert got.tolist() == case["hash_ids"], name


def test_golden_constants_and_real_model_constants():
    h = _golden_hash()
    assert [list(m) for m in h.multipliers] == G["multipliers"]
    assert [list(p) for p in h.head_sizes] == G["flat_primes"]
    assert [list(o) for o in h.head_offsets] == G["offsets"]
    assert list(h.rows_per_layer) == G["rows_per_layer"] and h.pad_id == G["pad_id"]
    real = EngramHash.from_hf_config(preset_config("deepseek-v4.1-flash"))
    assert real.layers == (1, 14) and real.columns == 24 and real.heads == 48
    assert real.multipliers[0] == (76632096046245, 4839876093313, 35959672319349, 73987337458391)
    assert real.multipliers[1] == (67716810739261, 51510806800915, 30921347202721, 82619226485591)
    assert real.rows_per_layer == (384_006_168, 384_016_682)
    assert real.head_sizes[0][0] == 16_000_057 and real.head_sizes[1][-1] == 16_000_889
    real.check_checkpoint_constants(layer_id=14, multipliers=real.multipliers[1])
    with pytest.raises(ValueError, match="multipliers disagrees"):
        real.check_checkpoint_constants(layer_id=1, multipliers=real.multipliers[1])
    with pytest.raises(ValueError, match="covers layers"):
        real.check_checkpoint_constants(multipliers=real.multipliers[1])


def test_real_constants_never_overflow():
    """DeepSeek-V4.1-Flash constants, compressed ids at both ends: int64 ids equal the
    reference's unbounded Python ints (value * multiplier < 2^63 by construction)."""
    h = EngramHash.from_hf_config(preset_config("deepseek-v4.1-flash"))
    rng = np.random.default_rng(7)
    toks = rng.choice([0, 1, 2, 99090, 99091], 40).tolist()
    dead = (rng.random(40) < 0.1).tolist()
    lb, lbd = [99091, -1, 5], [False, False, True]
    got = h.row_ids(toks, [0, 40], [lb], dead, [lbd], np.arange(3, 43))
    assert got.tolist() == engram_row_ids(h, toks, list(range(3, 43)), dead, lb, lbd)


@pytest.mark.parametrize("device", BACKENDS)
def test_one_layer_hasher_from_a_table_spec_is_a_slice(device):
    case = G["cases"]["batch_2req"]
    specs = table_specs_from_hf_config(G["config"], format="bf16")
    both = _golden_hash().row_ids(*_arrays(case, device))
    for i, table in enumerate(specs):
        h = make_hash(table.hash, token_map=TOKEN_MAP)
        assert isinstance(h, EngramHash) and h.spec == table.hash
        assert (h.heads, h.num_rows) == (table.heads, table.rows)
        assert h.row_ids(*_arrays(case, device)).tolist() == both[:, i : i + 1].tolist()
    assert EngramHash.from_hf_config(G["config"], layers=[3]).layers == (3,)
    with pytest.raises(ValueError, match="layer 2 is not one of the Engram layer ids"):
        EngramHash.from_hf_config(G["config"], layers=[2])


@pytest.mark.parametrize("device", BACKENDS)
def test_step_chunks_and_lookback_match_the_golden(device):
    h = _golden_hash()
    full = G["cases"]["chunk2_with_lookback"]["full_tokens"]  # positions 0..11
    mk = (lambda x: np.array(x)) if device is None else (lambda x: torch.tensor(x, device=device))
    whole, state = h.step(mk(full), mk([0, 12]), h.fresh_state(1, device))
    assert state.next_position.tolist() == [12]
    assert whole.reshape(12, 2, 4)[7:].tolist() == G["cases"]["chunk2_with_lookback"]["hash_ids"]
    ids, state = h.step(mk(full[:7]), mk([0, 7]), h.fresh_state(1, device))
    assert state.lookback_token_ids.tolist() == [[50019, 46541]]  # newest first
    parts = [ids]
    for tok in full[7:]:  # decode steps
        ids, state = h.step(mk([tok]), mk([0, 1]), state)
        parts.append(ids)
    cat = np.concatenate if device is None else torch.cat
    assert cat(parts).tolist() == whole.tolist()
    if device is not None:  # fresh_state() (numpy) serves torch ids: it takes their kind
        again, state = h.step(mk(full), mk([0, 12]), h.fresh_state(1))
        assert again.tolist() == whole.tolist() and is_torch(state.next_position)
    nxt, dead = h.next_lookback(mk(full[:11]), mk([0, 11]), mk([[-1, -1]]))
    assert nxt.tolist() == G["cases"]["decode_step"]["lookback_token_ids"]
    assert dead.tolist() == [[False, False]]


def test_dead_flags_travel_with_the_lookback():
    h = _golden_hash()
    ids = np.array([5, 6, 7, 8])
    dead = np.array([False, True, False, False])
    lb, lbd = h.next_lookback(ids, [0, 2, 4], [[1, 2], [3, 4]], dead, [[False, True]] * 2)
    assert lb.tolist() == [[6, 5], [8, 7]] and lbd.tolist() == [[True, False], [False, False]]
    lb, lbd = h.next_lookback(ids[:1], [0, 1, 1], [[1, 2], [3, 4]], dead[:1], [[False, True]] * 2)
    assert lb.tolist() == [[5, 1], [3, 4]] and lbd.tolist() == [[False, False], [False, True]]


def test_without_a_token_map_ids_are_compressed_ids():
    h = EngramHash.from_hf_config(G["config"])
    case = G["cases"]["dead_span"]
    args = _arrays(case, None)
    args[0] = TOKEN_MAP[args[0]]
    assert h.row_ids(*args).tolist() == case["hash_ids"]
    with pytest.raises(ValueError, match="outside the compressed vocabulary \\[0, 64\\)"):
        h.row_ids([64], [0, 1], [[-1, -1]])


def test_blocked_sources_take_the_compressed_pad_id():
    """engram_pad_token_id is a token id: blocked and unknown sources hash as its compressed
    id (vLLM's NgramHashState: pad_id = token_map[pad_token_id]); the golden map keeps 2 at 2."""
    moved = TOKEN_MAP.copy()
    moved[2] = 9  # the pad token's compressed id
    h = _golden_hash()
    hm = EngramHash.from_hf_config(G["config"], token_map=moved)
    assert (h.pad_id, hm.pad_id) == (2, 9)
    fresh = G["cases"]["single_fresh"]
    args = _arrays(fresh, None)
    got = hm.row_ids(*args)
    assert got.tolist() == engram_row_ids(hm, *_reference_args(fresh), token_map=moved)
    assert got.tolist() != fresh["hash_ids"]  # the first n-1 tokens read blocked sources
    assert got[2:].tolist() == fresh["hash_ids"][2:]  # later windows hold no pad value
    with pytest.raises(ValueError, match=r"pad_token_id 2 is outside the token map \[0, 2\)"):
        EngramHash.from_hf_config(G["config"], token_map=np.array([0, 63]))


def _reference_args(case: dict) -> tuple:
    return (
        case["input_ids"],
        case["positions"],
        case["dead_mask"],
        case["lookback_token_ids"][0],
        case["lookback_dead_mask"][0],
    )


BAD = [
    (
        dict(input_ids=[1, 70000]),
        r"input_ids\[1\] = 70000 \(request 0, position 1 of its chunk\) "
        r"is outside the token map \[0, 65536\)",
    ),
    (dict(lb=[[-2, 5]]), r"lookback_token_ids\[0, 0\] = -2 \(request 0, lookback slot"),
    (dict(lb=[[5]]), r"lookback_token_ids has shape \[1, 1\], expected \[1, >= 2\]"),
    (dict(lb=[[5, 5], [5, 5]]), r"expected \[1, >= 2\]"),
    (dict(dead=[True]), r"dead_mask has shape \[1\], expected \[2\]"),
    (dict(dead=[1, 0]), "dead_mask must be a bool mask"),
    (dict(pos=[3, -1]), r"positions\[1\] = -1 \(request 0, position 1 of its chunk\) is negative"),
    (dict(pos=[3]), "positions has 1 entries for 2 tokens"),
    (dict(qsl=[0, 1]), "ends at 1, but input_ids holds 2"),
    (dict(lb=[[1.0, 2.0]]), "lookback_token_ids must hold integers"),
]


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("change,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_a_clear_error(change, message, device):
    h = _golden_hash()
    a = {
        "input_ids": [1, 2],
        "qsl": [0, 2],
        "lb": [[-1, -1]],
        "dead": [False, False],
        "lbd": None,
        "pos": [0, 1],
        **change,
    }
    conv = (lambda x: np.array(x)) if device is None else (lambda x: torch.tensor(x, device=device))
    args = [None if a[k] is None else conv(a[k]) for k in ("input_ids", "qsl", "lb", "dead")]
    with pytest.raises(ValueError, match=message):
        h.row_ids(*args, None, None if a["pos"] is None else conv(a["pos"]))


def test_dead_and_unknown_ids_need_not_be_valid():
    h = _golden_hash()
    got = h.row_ids([1, -5, 99999], [0, 3], [[-1, 77777]], [False, True, True], [[False, True]])
    assert got.shape == (3, 2, 4)


# -- the compressed token map ------------------------------------------------------------------


def _tiny_tokenizer():
    tokenizers = pytest.importorskip(
        "tokenizers", reason="the optional `tokenizers` package builds Engram token maps"
    )
    from tokenizers import decoders, models, pre_tokenizers

    def bl(text: str) -> str:  # the byte-level spelling of `text` (GPT-2 style vocabularies)
        return "".join(
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(
                text
            )[0][0]
        )

    pieces = [
        bl("hello"),
        bl("Hello"),
        bl(" hello"),
        bl("Héllo"),  # -> "hello"
        bl(" "),
        bl("  "),
        bl("\n"),
        bl(" \t "),  # -> " " (a lone space survives the strip)
        bl("é")[0],
        bl("é")[1],  # half a UTF-8 sequence each: keyed on the raw token
        bl("\ufb01"),
        bl("fi"),  # the "fi" ligature is "fi" after NFKC
        bl("\u0301"),  # a lone combining accent normalises to "": keyed on itself
        bl(" World "),
        bl("world"),
    ]
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=pieces[0]))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|EOS|>"])
    return tok


def test_token_map_from_a_tokenizer():
    tok = _tiny_tokenizer()
    m = compressed_token_map(tok)
    assert m.dtype == np.int64
    assert m.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 3, 4, 4, 5, 6, 6, 7]

    class FastTokenizerLike:  # transformers' fast tokenizers expose the Rust one like this
        backend_tokenizer = tok

    assert compressed_token_map(FastTokenizerLike()).tolist() == m.tolist()
    with pytest.raises(ValueError, match="expected a tokenizers.Tokenizer"):
        compressed_token_map(object())


def test_token_map_files_round_trip_without_pickle(tmp_path):
    m = np.array([0, 0, 1, 2, 1, 3])
    for name in ("map.npy", "map.json"):
        save_token_map(tmp_path / name, m)
        assert load_token_map(tmp_path / name, compressed_vocab_size=4).tolist() == m.tolist()
    (tmp_path / "plain.json").write_text("[0, 1, 1]")
    assert load_token_map(tmp_path / "plain.json").tolist() == [0, 1, 1]
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="allow_pickle"):
        load_token_map(tmp_path / "obj.npy")
    with pytest.raises(ValueError, match="built from another tokenizer"):
        load_token_map(tmp_path / "map.npy", compressed_vocab_size=99092)
    with pytest.raises(ValueError, match=r"\.npy or \.json"):
        save_token_map(tmp_path / "map.pkl", m)
    with pytest.raises(ValueError, match="negative"):
        check_token_map([0, -1])
    with pytest.raises(ValueError, match="has 3 compressed ids"):
        EngramHash.from_hf_config(G["config"], token_map=[0, 1, 2])


def test_fresh_state_and_repr():
    h = _golden_hash()
    s = h.fresh_state(2)
    assert isinstance(s, EngramState) and s.lookback_token_ids.tolist() == [[-1, -1]] * 2
    assert s.next_position.tolist() == [0, 0] and not s.lookback_dead_mask.any()
    t = h.fresh_state(1, device="cpu")
    assert t.lookback_token_ids.dtype == torch.int64 and t.lookback_dead_mask.dtype == torch.bool
    assert "layers=[1, 3]" in repr(h)


@pytest.mark.parametrize("device", BACKENDS)
def test_step_validates_before_it_gathers(device):
    h = _golden_hash()
    conv = (lambda x: np.array(x)) if device is None else (lambda x: torch.tensor(x, device=device))
    state = h.fresh_state(2, device)
    with pytest.raises(ValueError, match="not monotone: request 1 ends at 3"):
        h.step(conv([1, 2, 3]), conv([0, 5, 3]), state)
    with pytest.raises(ValueError, match="state has 2 requests, the batch 1"):
        h.step(conv([1, 2, 3]), conv([0, 3]), state)
    with pytest.raises(ValueError, match=r"input_ids\[2\] = 70000 \(request 1, position 0"):
        h.step(conv([1, 2, 70000]), conv([0, 2, 3]), state)
