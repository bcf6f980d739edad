"""Synthetic checkpoints: rows are a pure function of (seed, table, row), valid and plausible in
every format; files carry the real names, dtypes, shard layout and hash constants."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import ALL_KINDS
from plestore.checkpoint import Checkpoint, CheckpointError, detect_tables, expected_rows
from plestore.checkpoint.synth import DEFAULT_BASES
from plestore.checkpoint.synthrows import random_words
from plestore.formats import FORMATS, get_format
from plestore.spec import TableSpec, preset_config, table_specs_from_hf_config

SPECS = [
    TableSpec(name="t", rows=5000, dim=d, format=f)
    for f, d in [
        ("bf16", 160),
        ("fp8_e4m3", 160),
        ("nvfp4", 160),
        ("fp8_ue8m0", 256),
        ("nf4", 160),
        ("bf16", 7680),
    ]
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.format}-{s.dim}")
def test_rows_are_valid_plausible_and_random_access(spec):
    rows = expected_rows(spec, 7, np.arange(spec.rows))
    assert rows.shape == (spec.rows, spec.row_bytes) and rows.dtype == np.uint8
    v = get_format(spec.format).decode_numpy(rows, scale=1.0, dim=spec.dim)
    assert np.isfinite(v).all()
    mags = np.abs(v[v != 0])
    assert 1e-4 < np.median(mags) < 4.0 and mags.max() < 16  # x the table scale
    pick = np.array([4999, 0, 17, 17, 2500])
    np.testing.assert_array_equal(expected_rows(spec, 7, pick), rows[pick])
    assert not np.array_equal(expected_rows(spec, 8, pick), rows[pick])  # seed matters
    other = spec.replace(name="u")
    assert not np.array_equal(expected_rows(other, 7, pick), rows[pick])  # so does the table
    with pytest.raises(IndexError):
        expected_rows(spec, 7, [spec.rows])


def test_bytes_look_random():
    spec = TableSpec(name="t", rows=20000, dim=160, format="nvfp4")
    codes = expected_rows(spec, 0, np.arange(spec.rows))[:, :80]
    counts = np.bincount(codes.reshape(-1), minlength=256)
    assert counts.min() > 0.9 * counts.mean() and counts.max() < 1.1 * counts.mean()
    w = random_words(np.uint64(1), np.arange(10_000), 3)
    assert len(np.unique(w)) == w.size


@pytest.mark.parametrize("preset,fmt", ALL_KINDS)
def test_synth_checkpoint_layout(small_checkpoint, preset, fmt):
    d = small_checkpoint(preset, fmt)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["plestore_synth"]["seed"] == 0
    spec = table_specs_from_hf_config(cfg)[0]
    assert spec.format == get_format(fmt).name
    with Checkpoint.open(d) as ck:
        assert len(ck.headers) >= 3
        tables = detect_tables(ck)  # validates names, dtypes, shards, constants, scales
        for t in tables:
            want = expected_rows(t.spec, 0, np.arange(t.spec.rows))
            np.testing.assert_array_equal(t.read_rows(0, t.spec.rows), want)
        if preset.startswith("qwen"):
            ple = "model.language_model.layers.1.ple"
            hidden, embed = cfg["text_config"]["hidden_size"], 2560
            assert hidden == 64
            assert ck.tensor(f"{ple}.key_proj.weight").shape == (4 * hidden, embed)
            assert ck.tensor(f"{ple}.value_proj.weight").shape == (hidden, embed)
            assert ck.tensor(f"{ple}.conv1d.weight").shape == (4 * hidden, 1, 4)
            for n in ("key", "query", "conv"):
                assert ck.tensor(f"{ple}.norm_{n}.weight").dtype == "BF16"
            w = ck.read_tensor(f"{ple}.key_proj.weight")
            assert 0 < np.abs(w).max() < 2**-7
            # unrelated tensors sit between the shards of one file
            names = list(ck.headers[1].tensors)
            assert any("shard" not in n for n in names[1:-1])
    assert spec.rows * spec.row_bytes == tables[0].spec.nbytes


def test_default_scale_is_a_few_hundred_mb():
    for preset, fmt in ALL_KINDS:
        kind = "qwen4exp" if "qwen" in preset else "engram" if "deepseek" in preset else "identity"
        cfg = preset_config(preset, fmt, DEFAULT_BASES[kind])
        if kind == "identity":
            cfg = preset_config("gemma4-e4b", fmt, DEFAULT_BASES[kind])  # the widest Gemma row
        total = sum(s.nbytes for s in table_specs_from_hf_config(cfg))
        assert 100e6 < total < 700e6, (preset, fmt, total)
    full = table_specs_from_hf_config(preset_config("qwen3.8-flash-next", "nvfp4", 20_000_000))
    assert full[0].rows == 320_001_536 and full[0].nbytes == 28_800_138_240


def test_synth_refuses_to_overwrite_without_force(small_checkpoint, tmp_path):
    from plestore.checkpoint import synth_checkpoint

    a = synth_checkpoint(tmp_path, "gemma3n-e2b", ngram_vocab_size_base=64, hidden_size=32)
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        synth_checkpoint(tmp_path, "gemma3n-e2b", ngram_vocab_size_base=64, hidden_size=32)
    b = synth_checkpoint(
        tmp_path,
        "gemma3n-e2b",
        ngram_vocab_size_base=64,
        hidden_size=32,
        seed=5,
        num_files=2,
        overwrite=True,
    )
    assert len(a.files) == 3 and len(b.files) == 2
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == sorted(b.files)
    with Checkpoint.open(tmp_path) as ck:
        (t,) = detect_tables(ck)
        np.testing.assert_array_equal(t.read_rows(0, 64), expected_rows(t.spec, 5, range(64)))


def test_every_format_has_a_generator():
    for name in FORMATS:
        spec = TableSpec(name="t", rows=3, dim=256, format=name)
        assert expected_rows(spec, 0, [0, 2]).shape == (2, spec.row_bytes)


def test_full_disk_during_synth_leaves_no_checkpoint(tmp_path, monkeypatch):
    import errno
    import os

    from plestore.checkpoint import synth_checkpoint

    real, calls = os.pwrite, [0]

    def full(*a):
        calls[0] += 1
        if calls[0] > 40:  # some table blocks are written by the pool first
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*a)

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match="No space left on device while writing a checkpoint"):
        synth_checkpoint(
            tmp_path,
            "qwen3.8-flash-next",
            "nvfp4",
            ngram_vocab_size_base=1000,
            hidden_size=32,
            threads=4,
        )
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CheckpointError, match="holds neither"):
        Checkpoint.open(tmp_path)
    synth_checkpoint(
        tmp_path, "qwen3.8-flash-next", "nvfp4", ngram_vocab_size_base=1000, hidden_size=32
    )
    assert len(detect_tables(Checkpoint.open(tmp_path))[0].segments) == 128
