"""Table specs: real-model constants, HF config parsing, JSON round trips, the row layout."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import load_golden
from plestore.spec import (
    PRESETS,
    EngramHashSpec,
    IdentityHashSpec,
    Qwen4ExpHashSpec,
    RowLayout,
    ShardLayout,
    TableSpec,
    check_hash_constants,
    preset_config,
    table_specs_from_hf_config,
)


@pytest.mark.parametrize(
    "golden", ["qwen4exp_hash_qwen3_8_flash_next.json", "qwen4exp_hash_small_n3.json"]
)
def test_qwen_hash_spec_matches_golden(golden):
    g = load_golden(golden)["config"]
    h = Qwen4ExpHashSpec(
        vocab_size=g["vocab_size"],
        eos_token_id=g["eos_token_id"],
        ngram_size=g["ngram_size"],
        heads_per_ngram=g["heads_per_ngram"],
        ngram_vocab_size_base=g["ngram_vocab_size_base"],
        seed=g["seed"],
        layer_index=g["ple_dense_layer_id"],
        pad_multiple=g["make_ngram_vocab_size_divisible_by"],
    )
    assert list(h.head_sizes) == g["sizes"]
    assert list(h.head_offsets) == g["offsets"]
    assert h.total_rows == g["total_rows"]
    assert h.num_rows == g["padded_total_rows"]
    assert h.heads == g["ngram_heads"]
    assert list(h.multipliers) == g["multipliers"]
    check_hash_constants(
        h,
        layer_multipliers=g["multipliers"],
        ngram_heads_vocab_sizes=g["sizes"],
        ngram_heads_offsets=np.array(g["offsets"]),
    )


def test_checkpoint_constants_that_disagree_are_refused():
    h = Qwen4ExpHashSpec(vocab_size=5000, eos_token_id=2, ngram_vocab_size_base=1000)
    sizes = list(h.head_sizes)
    sizes[3] += 2
    with pytest.raises(ValueError, match="ngram_heads_vocab_sizes disagrees .* at index 3"):
        check_hash_constants(h, ngram_heads_vocab_sizes=sizes)
    with pytest.raises(ValueError, match="layer_multipliers disagrees .* at index 2"):
        check_hash_constants(h, layer_multipliers=list(h.multipliers[:2]))
    with pytest.raises(ValueError, match="no constant called 'colour'"):
        check_hash_constants(h, colour=[1])


def test_qwen_second_layer_continues_the_prime_sequence():
    g = load_golden("qwen4exp_hash_qwen3_8_flash_next.json")
    second = g["hypothetical_second_ple_layer_dense_id_1"]
    h = Qwen4ExpHashSpec(vocab_size=248320, eos_token_id=248044, layer_index=1)
    assert list(h.head_sizes) == second["sizes"]
    assert h.num_rows == second["padded_total_rows"]


def test_qwen_preset_is_the_real_table():
    g = load_golden("qwen4exp_hash_qwen3_8_flash_next.json")["config"]
    for fmt, key in [
        ("fp8_e4m3", "fp8"),
        ("bf16", "bf16"),
        ("nvfp4", "nvfp4_codes_plus_block_scales"),
    ]:
        (spec,) = table_specs_from_hf_config(preset_config("qwen3.8-flash-next", fmt))
        assert spec.format == fmt
        assert (spec.rows, spec.dim, spec.heads) == (320_001_536, 160, 16)
        assert spec.shards == ShardLayout(g["checkpoint_shards"]["rows_per_shard"], 128)
        assert spec.nbytes == g["table_bytes"][key]
        assert spec.name == "ple.layers.1"
        assert spec.tensor == "model.language_model.layers.1.ple.ple_embedding.ngram_embedding"
        first, last = g["checkpoint_shards"]["first"][1], g["checkpoint_shards"]["last"][1]
        assert spec.shards.shard_rows(first[0], spec.rows) == (first[1], first[2])
        assert spec.shards.shard_rows(last[0], spec.rows) == (last[1], last[2])


def test_engram_preset_real_constants():
    specs = table_specs_from_hf_config(preset_config("deepseek-v4.1-flash"))
    assert [s.rows for s in specs] == [384_006_168, 384_016_682]
    assert all((s.dim, s.heads, s.format) == (256, 24, "fp8_ue8m0") for s in specs)
    primes = specs[0].hash.head_sizes + specs[1].hash.head_sizes
    assert primes[0] == 16_000_057 and primes[-1] == 16_000_889
    assert len(set(primes)) == 48 and list(primes) == sorted(primes)
    assert specs[0].hash.multipliers == (
        76632096046245,
        4839876093313,
        35959672319349,
        73987337458391,
    )
    assert specs[1].hash.multipliers == (
        67716810739261,
        51510806800915,
        30921347202721,
        82619226485591,
    )


def test_engram_tiny_golden_constants():
    g = load_golden("engram_hash_tiny.json")
    c = g["config"]
    specs = table_specs_from_hf_config(c, format="bf16")  # head_dim 4: too small for ue8m0
    assert [list(s.hash.head_sizes) for s in specs] == g["flat_primes"]
    assert [list(s.hash.head_offsets) for s in specs] == g["offsets"]
    assert [s.rows for s in specs] == g["rows_per_layer"]
    assert [list(s.hash.multipliers) for s in specs] == g["multipliers"]


def test_engram_num_embeddings_mismatch_is_an_error():
    cfg = dict(load_golden("engram_hash_tiny.json")["config"])
    cfg["engram_num_embeddings"] = [4062, 9999]
    with pytest.raises(ValueError, match="engram_num_embeddings says 9999"):
        table_specs_from_hf_config(cfg, format="bf16")


@pytest.mark.parametrize(
    "name,rows,dim",
    [
        ("gemma3n-e2b", 262144, 30 * 256),
        ("gemma3n-e4b", 262144, 35 * 256),
        ("gemma4-e2b", 262144, 35 * 256),
        ("gemma4-e4b", 262144, 42 * 256),
    ],
)
def test_gemma_presets(name, rows, dim):
    (spec,) = table_specs_from_hf_config(preset_config(name))
    assert (spec.rows, spec.dim, spec.heads, spec.format) == (rows, dim, 1, "bf16")
    assert isinstance(spec.hash, IdentityHashSpec)


def test_preset_scaling_through_the_vocab_base():
    (spec,) = table_specs_from_hf_config(
        preset_config("qwen3.8-flash-next", "nvfp4", ngram_vocab_size_base=1000)
    )
    assert spec.hash.head_sizes[0] == 1009 and spec.rows % 128 == 0
    assert spec.shards.num_shards == 128


def test_text_config_wins_and_files_load(tmp_path):
    cfg = preset_config("qwen3.8-flash-next", "fp8", ngram_vocab_size_base=1000)
    cfg["split_ngram_parts"] = 512  # a stray top-level key: the nested one is authoritative
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for src in (tmp_path, tmp_path / "config.json", cfg):
        (spec,) = table_specs_from_hf_config(src)
        assert spec.shards.num_shards == 128 and spec.format == "fp8_e4m3"
    assert TableSpec.from_hf_config(tmp_path) == spec


@pytest.mark.parametrize(
    "text_extra,top_extra,want",
    [
        ({"ple_embedding_dtype": "float8_e4m3fn"}, {}, "fp8_e4m3"),
        ({"ple_embedding_dtype": "nf4"}, {}, "nf4"),
        ({}, {"quantization_config": {"quant_method": "fp8"}}, "fp8_e4m3"),
        (
            {},
            {
                "quantization_config": {
                    "quant_method": "fp8",
                    "ignored_layers": ["x.ngram_embedding.shard_0"],
                }
            },
            "bf16",
        ),
        ({}, {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}, "nvfp4"),
        (
            {},
            {
                "quantization_config": {
                    "quant_method": "modelopt",
                    "quant_algo": "MIXED_PRECISION",
                    "quantized_layers": {
                        "model.language_model.layers.1.ple.ple_embedding.ngram_embedding": {
                            "quant_algo": "FP8"
                        }
                    },
                }
            },
            "fp8_e4m3",
        ),
        ({}, {}, "bf16"),
    ],
)
def test_qwen_format_detection(text_extra, top_extra, want):
    text = dict(preset_config("qwen3.8-flash-next", "bf16", 1000)["text_config"])
    text.pop("ple_embedding_dtype")
    cfg = {"model_type": "qwen4_exp", "text_config": {**text, **text_extra}, **top_extra}
    assert table_specs_from_hf_config(cfg)[0].format == want


def test_config_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="describes no plestore table"):
        table_specs_from_hf_config({"model_type": "llama"})
    with pytest.raises(ValueError, match="lacks the key 'vocab_size'"):
        table_specs_from_hf_config({"ple_layer_ids": [2], "eos_token_id": 1})
    with pytest.raises(ValueError, match="no config.json"):
        table_specs_from_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match="not valid JSON"):
        table_specs_from_hf_config(tmp_path)
    with pytest.raises(ValueError, match="unknown preset"):
        preset_config("qwen9")
    with pytest.raises(ValueError, match="ships fp8_ue8m0"):
        preset_config("deepseek-v4.1-flash", "nvfp4")
    with pytest.raises(ValueError, match="pass table= one of"):
        TableSpec.from_hf_config(preset_config("deepseek-v4.1-flash"))


def test_all_presets_round_trip_through_json():
    for name, p in PRESETS.items():
        for fmt in p.formats:
            for spec in table_specs_from_hf_config(preset_config(name, fmt, 1000)):
                again = TableSpec.from_json(spec.to_json())
                assert again == spec and again.hash == spec.hash


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(rows=0), "rows must be a positive int"),
        (dict(dim=100, format="nvfp4"), "not a multiple"),
        (dict(format="int2"), "unknown row format"),
        (dict(scale=float("nan"), format="fp8"), "finite and > 0"),
        (dict(scale=2.0), "no per-table scale"),
        (dict(heads=3, hash=IdentityHashSpec(10)), "gives 1 ids per token"),
        (dict(rows=11, hash=IdentityHashSpec(10)), "addresses 10 rows"),
        (dict(shards=ShardLayout(3, 3)), "cannot hold 10 rows"),
        (dict(name=""), "name must not be empty"),
    ],
)
def test_table_spec_validation(kwargs, match):
    base = dict(name="t", rows=10, dim=32, format="bf16")
    with pytest.raises(ValueError, match=match):
        TableSpec(**{**base, **kwargs})


def test_hash_spec_validation():
    with pytest.raises(ValueError, match="eos_token_id"):
        Qwen4ExpHashSpec(vocab_size=10, eos_token_id=10)
    with pytest.raises(ValueError, match="ngram_size"):
        Qwen4ExpHashSpec(vocab_size=10, eos_token_id=1, ngram_size=1)
    with pytest.raises(ValueError, match="layer_position"):
        EngramHashSpec(layer_ids=(1,), layer_position=1, compressed_vocab_size=9, pad_token_id=2)
    with pytest.raises(ValueError, match="unknown keys"):
        TableSpec.from_dict({"name": "t", "rows": 1, "dim": 2, "format": "bf16", "colour": 1})


# -- row layout ----------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    row_bytes=st.integers(1, 20000),
    pad=st.integers(0, 64),
    block=st.sampled_from([0, 512, 4096]),
    n=st.integers(1, 5000),
)
def test_rows_never_straddle_blocks_and_never_overlap(row_bytes, pad, block, n):
    lay = RowLayout(row_bytes, row_bytes + pad, block)
    rows = np.arange(n)
    off = lay.offsets(rows)
    assert off.dtype == np.int64
    assert (np.diff(off) >= lay.row_stride).all()  # increasing, no overlap
    end = off + lay.row_bytes
    assert end[-1] <= lay.data_bytes(n)
    if block:
        if lay.row_stride <= block:  # fits in one block: never crosses a boundary
            assert (off // block == (end - 1) // block).all()
        else:  # spans whole blocks, starting on a boundary
            assert (off % block == 0).all()


def test_layout_offsets_past_2_31_are_exact():
    lay = RowLayout(160, block_bytes=4096)
    last = 320_001_535
    assert lay.rows_per_block == 25
    assert int(lay.offsets(np.array([last]))[0]) == (last // 25) * 4096 + (last % 25) * 160
    assert int(lay.offsets(np.array([last]))[0]) > 2**33
    assert lay.data_bytes(320_001_536) == -(-320_001_536 // 25) * 4096


def test_layout_validation():
    with pytest.raises(ValueError, match="row_stride"):
        RowLayout(160, 100)
    with pytest.raises(ValueError, match="block_bytes must be one of"):
        RowLayout(160, block_bytes=1000)
    assert RowLayout.from_dict(RowLayout(90, 96, 512).to_dict()) == RowLayout(90, 96, 512)
