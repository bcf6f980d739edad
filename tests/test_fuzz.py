"""Every untrusted input, mutated: each case ends in success or a clear error (ValueError family,
naming the field; IndexError for out-of-range ids; an exit status from the CLI), never a hang.

The seeded run has a fixed budget (~15 s on a 2-core CI machine); `python3 tests/fuzz.py --cases
10000` runs a fresh seed at full size. The per-case limit is a hang detector, not a target."""

from __future__ import annotations

import json
import struct
import time

import pytest
from fuzz import all_targets, run_fuzz

from plestore.checkpoint.safetensors_io import SafetensorsError, read_header
from plestore.spec import TableSpec, preset_config, table_specs_from_hf_config

HANG_S = (
    5.0  # per case: cases take ~1-40 ms (1.5 s seen on a loaded 2-core machine); a hang runs past
)


def test_seeded_fuzz_run_finds_nothing(tmp_path):
    rep = run_fuzz(cases=2500, seed=20261201, slow_s=HANG_S, hang_s=10.0, workdir=tmp_path)
    assert set(rep.by_target) == set(all_targets())
    assert not rep.unclear, json.dumps(rep.unclear, indent=1)
    assert not rep.slow, json.dumps(rep.slow, indent=1)
    assert rep.outcomes.get("clear", 0) > 500 and rep.outcomes.get("ok", 0) > 100


def _safetensors(path, header) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * 8)


def test_list_valued_dtype_is_a_clear_error(tmp_path):
    p = tmp_path / "x.safetensors"
    _safetensors(p, {"t": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}})
    with pytest.raises(SafetensorsError, match="tensor t: unknown dtype"):
        read_header(p)
    _safetensors(p, {"t": {"dtype": "F32", "shape": [1] * 100, "data_offsets": [0, 4]}})
    with pytest.raises(SafetensorsError, match="tensor t: shape"):
        read_header(p)


def _qwen():
    return preset_config("qwen3.8-flash-next", "bf16", ngram_vocab_size_base=1000)


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("ngram_size", 1, "ngram_size must be an int in"),  # was ZeroDivisionError
        ("heads_per_ngram", 0, "heads_per_ngram"),
        ("ngram_size", "3", "ngram_size must be an int"),  # was TypeError
        ("eos_token_id", [], "eos_token_id"),  # was IndexError
        ("ple_layer_ids", [0.5], "ple_layer_ids must hold ints"),
        ("split_ngram_parts", 0, "split_ngram_parts"),
        ("ple_layer_ids", list(range(1, 20001)), "ple_layer_ids must be a list of 1 to"),
        ("ple_layer_ids", list(range(1, 2001)), "need .* primes"),  # 2000 layers x 16 heads
        ("ngram_vocab_size_base", 2**62, "ngram_vocab_size_base must be an int in"),
        ("ple_embedding_dtype", ["bf16"], "ple_embedding_dtype must be a string"),
    ],
)
def test_config_values_are_clear_errors_in_bounded_time(key, value, match):
    cfg = _qwen()
    cfg["text_config"][key] = value
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        table_specs_from_hf_config(cfg)
    assert time.perf_counter() - t0 < HANG_S


def test_many_layers_cost_linear_prime_search():
    cfg = _qwen()
    cfg["text_config"]["ple_layer_ids"] = list(range(1, 301))  # 4,800 primes: within the cap
    t0 = time.perf_counter()
    specs = table_specs_from_hf_config(cfg)
    assert len(specs) == 300 and time.perf_counter() - t0 < 5 * HANG_S  # was quadratic


def test_table_metadata_hash_layer_index_is_bounded(tmp_path):
    spec = TableSpec.from_hf_config(_qwen())
    d = spec.to_dict()
    d["hash"]["layer_index"] = 10**6
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="primes"):
        TableSpec.from_dict(d)
    d["hash"]["layer_index"] = 2**80
    with pytest.raises(ValueError, match="layer_index is .* above the limit"):
        TableSpec.from_dict(d)
    assert time.perf_counter() - t0 < HANG_S


def test_cli_inspect_of_hostile_metadata_is_quick(tmp_path, capsys):
    from fuzz_targets import small_tables

    from plestore.cli import main

    tf, _ = small_tables(tmp_path)[0]
    meta = json.loads(tf.meta_path.read_text())
    meta["spec"]["hash"]["layer_index"] = 10**5
    tf.meta_path.write_text(json.dumps(meta))
    t0 = time.perf_counter()
    assert main(["inspect", str(tf.meta_path)]) == 1
    assert time.perf_counter() - t0 < HANG_S
    assert "primes" in capsys.readouterr().out


def test_fuzz_and_soak_commands(capsys):
    """The test tools' own command lines; `plestore bench` no longer lists them."""
    import fuzz
    import soak

    from plestore.cli import main

    argv = ["--cases", "12", "--seed", "3", "--targets", "safetensors,token-map"]
    assert fuzz.main([*argv, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["passed"] and rep["cases"] == 12 and rep["seed"] == 3
    with pytest.raises(SystemExit):
        soak.main(["--help"])
    assert "RSS, open file descriptors" in capsys.readouterr().out
    assert fuzz.main(["--cases", "1", "--targets", "nope"]) == 2
    for tool in ("fuzz", "soak"):
        with pytest.raises(SystemExit) as e:
            main(["bench", tool, "--help"])
        assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err
