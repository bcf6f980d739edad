"""Checkpoint reading: safetensors by hand (cross-checked with the safetensors library both
ways), table detection for every family, and every kind of bad input refused with a message
that names the file and the tensor."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from plestore.checkpoint import (
    Checkpoint,
    CheckpointError,
    SafetensorsError,
    detect_tables,
    expected_rows,
)
from plestore.checkpoint.safetensors_io import read_header, write_safetensors

QWEN = "qwen3.8-flash-next"
PLE = "model.language_model.layers.1.ple.ple_embedding"
EMB = f"{PLE}.ngram_embedding"
_TORCH = {
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "U8": torch.uint8,
    "F32": torch.float32,
    "I64": torch.int64,
}


def _load_all(ck_dir) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint as torch tensors, read with OUR reader."""
    out = {}
    with Checkpoint.open(ck_dir) as ck:
        for name, info in ck.tensors.items():
            raw = ck._pread(info, info.offset, info.nbytes)
            t = torch.frombuffer(bytearray(raw.tobytes()), dtype=torch.uint8)
            out[name] = t.view(_TORCH[info.dtype]).reshape(info.shape)
    return out


def _save(src_dir, dst_dir, tensors: dict[str, torch.Tensor], files: int = 2) -> None:
    """Write tensors as a checkpoint with the safetensors library (an independent writer)."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(src_dir / "config.json", dst_dir / "config.json")
    names = list(tensors)
    weight_map = {}
    for i in range(files):
        part = names[i::files]
        fname = f"part-{i}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, dst_dir / fname)
        weight_map.update({n: fname for n in part})
    (dst_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _edit(small_checkpoint, tmp_path, fmt="fp8_e4m3", edit=None, preset=QWEN):
    src = small_checkpoint(preset, fmt)
    tensors = _load_all(src)
    if edit:
        edit(tensors)
    _save(src, tmp_path / "ck", tensors)
    return tmp_path / "ck"


# ----------------------------------------------------------------------------------------------
# safetensors, both ways
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "preset,fmt", [(QWEN, "nvfp4"), ("deepseek-v4.1-flash", None), ("gemma3n-e2b", None)]
)
def test_our_files_read_back_by_the_safetensors_library(small_checkpoint, preset, fmt):
    d = small_checkpoint(preset, fmt)
    ours = _load_all(d)
    seen = 0
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, "pt") as g:
            for k in g.keys():  # noqa: SIM118 (safe_open is not a dict)
                t = g.get_tensor(k)
                assert t.dtype == ours[k].dtype and t.shape == ours[k].shape, k
                assert torch.equal(
                    t.reshape(-1).view(torch.uint8), ours[k].reshape(-1).view(torch.uint8)
                ), k
                seen += 1
    assert seen == len(ours) and len(list(d.glob("*.safetensors"))) >= 3


def test_library_files_read_by_us(tmp_path):
    rng = np.random.default_rng(0)
    ts = {
        "a": torch.from_numpy(rng.standard_normal((5, 3)).astype(np.float32)).bfloat16(),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.tensor(0.25),
        "d": torch.from_numpy(rng.integers(0, 255, (4, 16), dtype=np.uint8)),
        "e": torch.randn(3, 4).to(torch.float8_e4m3fn),
        "z": torch.zeros((0, 4)),
    }
    save_file(ts, tmp_path / "model.safetensors", metadata={"k": "v"})
    h = read_header(tmp_path / "model.safetensors")
    assert h.metadata == {"k": "v"} and set(h.tensors) == set(ts)
    with Checkpoint.open(tmp_path) as ck:
        for name, t in ts.items():
            np.testing.assert_array_equal(ck.read_tensor(name), t.float().numpy(), err_msg=name)
        np.testing.assert_array_equal(ck.read_rows("d", 1, 2), ts["d"][1:3].numpy())
        with pytest.raises(CheckpointError, match="outside tensor d"):
            ck.read_rows("d", 3, 2)


def test_write_safetensors_is_read_by_the_library(tmp_path):
    write_safetensors(
        tmp_path / "x.safetensors",
        {"i": ("I64", np.arange(3, dtype="<i8")), "s": ("F32", np.array(2.5, "<f4"))},
        {"format": "pt"},
    )
    with safe_open(tmp_path / "x.safetensors", "pt") as g:
        assert g.get_tensor("i").tolist() == [0, 1, 2] and g.get_tensor("s").item() == 2.5


# ----------------------------------------------------------------------------------------------
# Detection
# ----------------------------------------------------------------------------------------------


def test_detects_each_family(small_checkpoint):
    want = {
        (QWEN, "fp8_e4m3"): (["ple.layers.1"], 2.0**-6, 128),
        (QWEN, "nvfp4"): (["ple.layers.1"], 2.0**-8, 128),
        (QWEN, "bf16"): (["ple.layers.1"], 1.0, 128),
        ("deepseek-v4.1-flash", None): (["engram.layers.1", "engram.layers.14"], 1.0, 1),
        ("gemma3n-e2b", None): (["embed_tokens_per_layer"], 1.0, 1),
    }
    for (preset, fmt), (names, scale, shards) in want.items():
        with Checkpoint.open(small_checkpoint(preset, fmt)) as ck:
            tables = detect_tables(ck)
            assert [t.name for t in tables] == names
            for t in tables:
                assert t.spec.scale == scale and len(t.segments) == shards
                rows = np.array([0, 1, t.spec.rows // 2, t.spec.rows - 1])
                np.testing.assert_array_equal(
                    np.concatenate([t.read_rows(int(r), 1) for r in rows]),
                    expected_rows(t.spec, 0, rows),
                )


def test_reads_across_shard_and_file_boundaries(small_checkpoint):
    with Checkpoint.open(small_checkpoint(QWEN, "nvfp4")) as ck:
        (t,) = detect_tables(ck)
        files = {s.parts[0].file for s in t.segments}
        assert len(files) >= 2  # the shards are spread over several files
        rps = t.spec.shards.rows_per_shard
        a = 3 * rps - 5  # 5 rows of shard 2, all of shards 3..4, 7 rows of shard 5
        want = expected_rows(t.spec, 0, np.arange(a, a + 2 * rps + 12))
        np.testing.assert_array_equal(t.read_rows(a, 2 * rps + 12), want)


def test_text_only_names_and_single_file(small_checkpoint, tmp_path):
    d = small_checkpoint(QWEN, "fp8_e4m3", text_only=True)
    with Checkpoint.open(d) as ck:
        (t,) = detect_tables(ck)
        assert t.spec.tensor == "model.layers.1.ple.ple_embedding.ngram_embedding"
    single = tmp_path / "single"
    single.mkdir()
    shutil.copy(d / "config.json", single)
    save_file(_load_all(d), single / "model.safetensors")
    with Checkpoint.open(single) as ck:
        (t2,) = detect_tables(ck)
        assert t2.fingerprint != t.fingerprint  # other files, same spec
        np.testing.assert_array_equal(t2.read_rows(0, 50), expected_rows(t2.spec, 0, range(50)))


def test_fingerprint_is_stable_and_sees_rewrites(small_checkpoint, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(small_checkpoint(QWEN, "bf16"), d)
    fp = lambda: detect_tables(Checkpoint.open(d))[0].fingerprint
    first = fp()
    assert fp() == first
    f = sorted(d.glob("model-*.safetensors"))[1]
    f.write_bytes(f.read_bytes())  # same bytes, new mtime: counts as a new source
    assert fp() != first


# ----------------------------------------------------------------------------------------------
# Bad input: each refused, naming the file and/or tensor
# ----------------------------------------------------------------------------------------------


def _drop(name):
    return lambda ts: ts.pop(name)


BAD = {
    "missing shard": (
        "fp8_e4m3",
        _drop(f"{EMB}.shard_5.weight"),
        f"{EMB}.shard_5.weight is missing",
    ),
    "extra shard": (
        "fp8_e4m3",
        lambda ts: ts.__setitem__(f"{EMB}.shard_128.weight", ts[f"{EMB}.shard_0.weight"]),
        "shard_128.weight is an extra shard",
    ),
    "short shard": (
        "fp8_e4m3",
        lambda ts: ts.__setitem__(f"{EMB}.shard_3.weight", ts[f"{EMB}.shard_3.weight"][:-1]),
        r"shard_3.weight in part-\d.safetensors: expected F8_E4M3 \[132, 160\]",
    ),
    "wrong dtype": (
        "fp8_e4m3",
        lambda ts: ts.__setitem__(
            f"{EMB}.shard_2.weight", ts[f"{EMB}.shard_2.weight"].view(torch.uint8)
        ),
        "shard_2.weight in part-.*: expected F8_E4M3 .* got U8",
    ),
    "bf16 shards, fp8 config": (
        "fp8_e4m3",
        lambda ts: ts.__setitem__(f"{EMB}.shard_0.weight", ts[f"{EMB}.shard_0.weight"].bfloat16()),
        "got BF16",
    ),
    "no fp8 scale": ("fp8_e4m3", _drop(f"{EMB}.weight_scale"), "weight_scale .*is missing"),
    "nvfp4 scales differ": (
        "nvfp4",
        lambda ts: ts.__setitem__(f"{EMB}.shard_7.weight_scale_2", torch.tensor(0.5)),
        "global scales differ across shards: .*shard_7.weight_scale_2",
    ),
    "nvfp4 no block scales": (
        "nvfp4",
        _drop(f"{EMB}.shard_9.weight_scale"),
        "shard_9.weight_scale is missing",
    ),
    "non-sharded": (
        "bf16",
        lambda ts: ts.__setitem__(f"{EMB}.weight", torch.zeros(4, 160)),
        "non-sharded n-gram table",
    ),
    "hash constants": (
        "bf16",
        lambda ts: ts[f"{PLE}.layer_multipliers"].__setitem__(1, 7),
        "layer_multipliers in part-.*disagrees .* at index 1",
    ),
    "undeclared table": (
        "bf16",
        lambda ts: ts.__setitem__(
            "model.language_model.layers.4.ple.ple_embedding.ngram_embedding.shard_0.weight",
            torch.zeros(2, 160),
        ),
        "config.json does not declare",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoints_are_refused(small_checkpoint, tmp_path, case):
    fmt, edit, message = BAD[case]
    d = _edit(small_checkpoint, tmp_path, fmt, edit)
    with pytest.raises(CheckpointError, match=message), Checkpoint.open(d) as ck:
        detect_tables(ck)


def test_bad_engram_and_gemma_tensors(small_checkpoint, tmp_path):
    eng = "model.layers.14.engram.embed"
    s = f"{eng}.weight_scale_inv"
    d = _edit(
        small_checkpoint,
        tmp_path / "e",
        None,
        lambda ts: ts.__setitem__(s, ts[s][:, :4]),
        preset="deepseek-v4.1-flash",
    )
    with pytest.raises(CheckpointError, match=rf"{eng}.weight_scale_inv in .*expected U8 \["):
        detect_tables(Checkpoint.open(d))
    g = "model.language_model.embed_tokens_per_layer.weight"
    d = _edit(
        small_checkpoint,
        tmp_path / "g",
        None,
        lambda ts: ts.__setitem__(g, ts[g].float()),
        preset="gemma3n-e2b",
    )
    with pytest.raises(CheckpointError, match=f"{g} in .*expected BF16 .* got F32"):
        detect_tables(Checkpoint.open(d))


def _copy(small_checkpoint, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(small_checkpoint(QWEN, "bf16"), d)
    return d, sorted(d.glob("model-*.safetensors"))


def test_missing_shard_file_and_index_lies(small_checkpoint, tmp_path):
    d, files = _copy(small_checkpoint, tmp_path)
    files[1].unlink()
    with pytest.raises(CheckpointError, match=f"shard file {files[1].name} .* is missing"):
        Checkpoint.open(d)
    d2, _ = _copy(small_checkpoint, tmp_path / "2")
    idx = json.loads((d2 / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.ghost.weight"] = files[0].name
    (d2 / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="says tensor model.ghost.weight is in"):
        Checkpoint.open(d2)


def test_truncated_file(small_checkpoint, tmp_path):
    d, files = _copy(small_checkpoint, tmp_path)
    size = files[2].stat().st_size
    with open(files[2], "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(SafetensorsError, match=f"{files[2].name}: tensor .* extends past the end"):
        Checkpoint.open(d)


def _raw_file(path, header: bytes, data: bytes = b"", length: int | None = None):
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return path


def test_absurd_and_foreign_headers(tmp_path):
    def hdr(d):
        return json.dumps(d).encode()

    cases = {
        "beyond": (
            hdr({"t": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}}),
            b"1234",
            None,
            "tensor t: data .* extends past the end",
        ),
        "length": (b"{}", b"", 1 << 40, "header length 1099511627776 exceeds the file"),
        "size": (
            hdr({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}),
            b"x" * 8,
            None,
            "tensor t: data_offsets span 8 bytes, shape \\[3\\] x F32 needs 12",
        ),
        "overlap": (
            hdr(
                {
                    "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                    "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
                }
            ),
            b"x" * 6,
            None,
            "tensors a and b overlap",
        ),
        "dtype": (
            hdr({"t": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}),
            b"x",
            None,
            "unknown dtype 'Q4'",
        ),
        "negative": (
            hdr({"t": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}),
            b"x",
            None,
            "is not a list of non-negative ints",
        ),
        "not json": (b"\x80\x81 not json", b"", None, "header is not JSON"),
    }
    for name, (header, data, length, message) in cases.items():
        p = _raw_file(tmp_path / f"{name.replace(' ', '_')}.safetensors", header, data, length)
        with pytest.raises(SafetensorsError, match=message):
            read_header(p)
    text = tmp_path / "model.safetensors"
    text.write_text("this is a README, not tensors\n" * 3)
    with pytest.raises(SafetensorsError, match="header length .* exceeds the file"):
        Checkpoint.open(tmp_path)
    (tmp_path / "tiny.safetensors").write_bytes(b"abc")
    with pytest.raises(SafetensorsError, match="not a safetensors file: 3 bytes"):
        read_header(tmp_path / "tiny.safetensors")


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="holds neither"):
        Checkpoint.open(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint.open(tmp_path / "nope")
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no weight_map"):
        Checkpoint.open(tmp_path)


def test_offsets_past_2_to_the_31(tmp_path):
    """Tables are 26-200 GB: a tensor 3 GiB into a (sparse) file reads at the right place."""
    from plestore.checkpoint.safetensors_io import layout_file

    rows = np.arange(4 * 160, dtype=np.uint8).reshape(4, 160)
    header, spans, size = layout_file([("pad", "U8", (3 << 30,)), ("t", "U8", (4, 160))])
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(size)  # a hole, no disk used
        f.seek(spans["t"][0])
        f.write(rows.tobytes())
    assert spans["t"][0] > 2**31
    with Checkpoint.open(tmp_path) as ck:
        np.testing.assert_array_equal(ck.read_rows("t", 1, 3), rows[1:])
    with safe_open(path, "np") as g:
        np.testing.assert_array_equal(g.get_slice("t")[1:4], rows[1:])


def test_engram_tables_under_the_released_checkpoints_names(small_checkpoint, tmp_path):
    """DeepSeek-V4.1's checkpoints name the table `layers.L.engram.embed.weight` + `.scale`
    (F8_E8M0); synth writes `model.layers.L...` + `.weight_scale_inv` (U8). Same bytes, same
    rows packed."""

    from plestore.checkpoint.safetensors_io import write_safetensors
    from plestore.tablefile.pack import pack_checkpoint

    src = small_checkpoint("deepseek-v4.1-flash")
    ours = tmp_path / "ours"
    shutil.copytree(src, ours)
    words = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
    with Checkpoint.open(src) as ck:
        tensors = {}
        for name, info in ck.tensors.items():
            with open(info.file, "rb") as f:
                f.seek(info.offset)
                raw = np.frombuffer(f.read(info.nbytes), words[info.itemsize]).reshape(info.shape)
            new = name.removeprefix("model.").replace(".weight_scale_inv", ".scale")
            dtype = "F8_E8M0" if name.endswith(".weight_scale_inv") else info.dtype
            tensors[new] = (dtype, raw)
    for f in ours.glob("*.safetensors*"):
        f.unlink()
    write_safetensors(ours / "model.safetensors", tensors)
    a, b = pack_checkpoint(src, tmp_path / "a"), pack_checkpoint(ours, tmp_path / "b")
    from plestore.tablefile import DATA_OFFSET

    assert (
        [t.name for t in a.tables]
        == [t.name for t in b.tables]
        == [
            "engram.layers.1",
            "engram.layers.14",
        ]
    )
    for t in a.tables:  # (the headers name their sources; the rows are the same bytes)
        rows = [(Path(d) / f"{t.name}.rows").read_bytes()[DATA_OFFSET:] for d in (a.out, b.out)]
        assert rows[0] == rows[1] and len(rows[0]) > 0
