"""`plestore hash`: golden ids from a config file or a preset, context carrying, Engram token
maps, and errors that exit non-zero with a message."""

from __future__ import annotations

import json

import numpy as np

from conftest import load_golden
from plestore.cli import main
from plestore.hashing import save_token_map


def _json(capsys, argv: list[str]) -> dict:
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_qwen_preset_matches_the_golden_ids(capsys):
    case = load_golden("qwen4exp_hash_qwen3_8_flash_next.json")["cases"]
    out = _json(capsys, ["hash", "--preset", "qwen3.8-flash-next", "--tokens", "2740"])
    assert out["row_ids"] == case["len1_fresh"]["row_ids_flat"]
    assert out["next_context"] == [248044, 2740] and len(out["heads"]) == 16
    chunk2 = case["chunked_prefill_7_plus_5"]["chunk2"]
    tokens = ",".join(map(str, chunk2["input_ids"]))
    context = ",".join(map(str, chunk2["ngram_context"][0]))
    out = _json(
        capsys, ["hash", "--preset", "qwen3.8-flash-next", "--tokens", tokens, "--context", context]
    )
    assert out["row_ids"] == chunk2["row_ids_flat"]
    assert out["next_context"] == chunk2["requests"][0]["history_after"]


def test_qwen_config_file_short_and_long_contexts(tmp_path, capsys):
    g = load_golden("qwen4exp_hash_small_n3.json")
    cfg = {
        "ple_layer_ids": [1],
        "vocab_size": 5000,
        "eos_token_id": 2,
        "hidden_size": 128,
        "ngram_vocab_size_base": 1000,
        "split_ngram_parts": 8,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    full = g["cases"]["chunked_prefill_7_plus_5"]
    toks = full["full_tokens"]
    base = ["hash", "--config", str(tmp_path / "config.json")]
    # the whole prompt before the last token: only its last n-1 tokens matter
    before = ",".join(map(str, toks[:-1]))
    out = _json(capsys, base + ["--tokens", str(toks[-1]), "--context", before])
    assert out["row_ids"] == full["unsplit_row_ids"][-1:]
    # one token of context: the slot before it is EOS, as for a fresh request
    out = _json(capsys, base + ["--tokens", str(toks[1]), "--context", str(toks[0])])
    assert out["row_ids"] == full["unsplit_row_ids"][1:2] and out["context"] == [2, toks[0]]
    assert main(base + ["--tokens", "1,2", "--layer", "0"]) == 0
    text = capsys.readouterr().out
    assert "2g.0" in text and "3g.7" in text and "next_context: 1,2" in text


def test_engram_with_a_token_map(tmp_path, capsys):
    g = load_golden("engram_hash_tiny.json")
    (tmp_path / "config.json").write_text(json.dumps(g["config"]))
    save_token_map(tmp_path / "map.npy", np.arange(65536) % 64)
    full = g["cases"]["chunk2_with_lookback"]["full_tokens"]
    argv = [
        "hash",
        "--config",
        str(tmp_path),
        "--token-map",
        str(tmp_path / "map.npy"),
        "--tokens",
        str(full[11]),
        "--context",
        ",".join(map(str, full[:11])),
    ]
    out = _json(capsys, argv)
    assert out["row_ids"] == g["cases"]["decode_step"]["hash_ids"]
    assert out["positions"] == [11] and out["next_lookback"] == [full[11], full[10]]
    assert out["compressed_ids"] == [full[11] % 64]
    out = _json(capsys, argv + ["--layer", "3"])
    assert out["layers"] == [3]
    assert out["row_ids"] == [[g["cases"]["decode_step"]["hash_ids"][0][1]]]
    assert main(argv[:-4] + ["--tokens", "1,2"]) == 0
    assert "layer 1:" in capsys.readouterr().out


def test_engram_preset_without_a_map_says_so(capsys):
    assert main(["hash", "--preset", "deepseek-v4.1-flash", "--tokens", "5,6"]) == 0
    out = capsys.readouterr().out
    assert "taken to be compressed ids" in out and "layer 14:" in out and "4g.7" in out


def test_identity_and_errors(capsys):
    out = _json(capsys, ["hash", "--preset", "gemma4-e2b", "--tokens", "0,5,262143"])
    assert out["row_ids"] == [0, 5, 262143]
    assert main(["hash", "--preset", "gemma4-e2b", "--tokens", "262144"]) == 1
    assert "input_ids[0] = 262144 is outside" in capsys.readouterr().err
    assert main(["hash", "--preset", "qwen3.8-flash-next", "--tokens", "248320"]) == 1
    assert "request 0, position 0" in capsys.readouterr().err
    assert main(["hash", "--preset", "qwen3.8-flash-next", "--tokens", "1", "--layer", "1"]) == 1
    assert "not a dense PLE index" in capsys.readouterr().err
