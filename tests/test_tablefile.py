"""Table files: every layout round-trips, open validates in O(1), verify names bad rows."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from plestore.spec import RowLayout, TableSpec
from plestore.tablefile import (
    DATA_OFFSET,
    TableFile,
    TableFileError,
    TableWriter,
    find_tables,
    place_bytes,
)

RNG = np.random.default_rng(7)


def _write(
    tmp_path,
    fmt="fp8",
    dim=160,
    rows=1000,
    block=4096,
    pieces=(1, 7, 300, 0, 2, 690),
    chunk=8192,
    name="t",
):
    spec = TableSpec(name=name, rows=rows, dim=dim, format=fmt)
    data = RNG.integers(0, 256, (rows, spec.row_bytes), dtype=np.uint8)
    with TableWriter(
        tmp_path,
        spec,
        RowLayout(spec.row_bytes, block_bytes=block),
        source={"fingerprint": "abc"},
        chunk_bytes=chunk,
    ) as w:
        i = 0
        for n in pieces:
            w.write_rows(data[i : i + n])
            i += n
        tf = w.commit()
    return tf, data


@pytest.mark.parametrize("block", [0, 512, 4096])
@pytest.mark.parametrize(
    "fmt,dim", [("fp8", 160), ("nvfp4", 160), ("bf16", 3000), ("fp8_ue8m0", 256), ("nf4", 160)]
)
def test_round_trip_every_layout(tmp_path, fmt, dim, block):
    tf, data = _write(tmp_path, fmt, dim, block=block)
    again = TableFile.open(tmp_path)
    assert again.spec == tf.spec and again.layout == tf.layout
    assert again.source["fingerprint"] == "abc"
    np.testing.assert_array_equal(again.read_rows(np.arange(1000)), data)
    np.testing.assert_array_equal(again.read_rows([999, 0, 999]), data[[999, 0, 999]])
    assert again.verify().ok
    assert os.path.getsize(tf.data_path) == DATA_OFFSET + tf.layout.data_bytes(1000)


def test_verify_names_the_bad_chunk_and_rows(tmp_path):
    tf, _ = _write(tmp_path)
    off = int(tf.row_offsets(np.array([555]))[0])
    with open(tf.data_path, "r+b") as f:
        f.seek(off + 3)
        b = f.read(1)
        f.seek(off + 3)
        f.write(bytes([b[0] ^ 0x10]))
    rep = TableFile.open(tmp_path).verify()
    assert not rep.ok and len(rep.bad_chunks) == 1
    assert rep.first_bad_rows[0] <= 555 <= rep.first_bad_rows[1]
    (block,) = rep.bad_blocks
    assert f"block {block} (rows {rep.first_bad_rows[0]}..{rep.first_bad_rows[1]})" in rep.message


def test_truncated_data_is_refused_at_open(tmp_path):
    tf, _ = _write(tmp_path)
    os.truncate(tf.data_path, os.path.getsize(tf.data_path) - 1)
    with pytest.raises(TableFileError, match="truncated"):
        TableFile.open(tmp_path)


def test_data_file_of_another_pack_is_refused(tmp_path):
    a, _ = _write(tmp_path / "a")
    b, _ = _write(tmp_path / "b")
    os.replace(b.data_path, a.data_path)
    with pytest.raises(TableFileError, match="does not belong"):
        TableFile.open(tmp_path / "a")


def test_missing_files_and_bad_metadata(tmp_path):
    tf, _ = _write(tmp_path)
    meta = json.loads(tf.meta_path.read_text())
    tf.meta_path.write_text(json.dumps({**meta, "plestore_table": 99}))
    with pytest.raises(TableFileError, match="version 99"):
        TableFile.open(tf.meta_path)
    tf.meta_path.write_text("{not json")
    with pytest.raises(TableFileError, match="not valid JSON"):
        TableFile.open(tf.meta_path)
    tf.meta_path.write_text(json.dumps({**meta, "data_bytes": 5}))
    with pytest.raises(TableFileError, match="data bytes"):
        TableFile.open(tf.meta_path)
    tf.meta_path.write_text(json.dumps(meta))
    os.unlink(tf.data_path)
    with pytest.raises(TableFileError, match="missing"):
        TableFile.open(tf.meta_path)
    with pytest.raises(TableFileError, match="nope.json does not exist"):
        TableFile.open(tmp_path / "nope.json")


def test_directory_with_several_tables(tmp_path):
    _write(tmp_path, name="a")
    _write(tmp_path, name="b")
    assert [p.name for p in find_tables(tmp_path)] == ["a.json", "b.json"]
    with pytest.raises(TableFileError, match=r"holds tables \[a, b\]"):
        TableFile.open(tmp_path)
    assert TableFile.open(tmp_path, table="b").name == "b"
    with pytest.raises(TableFileError, match="no table 'c'"):
        TableFile.open(tmp_path, table="c")


def test_uncommitted_writer_leaves_nothing_that_opens(tmp_path):
    spec = TableSpec(name="t", rows=10, dim=32, format="bf16")
    with TableWriter(tmp_path, spec) as w:
        w.write_rows(np.zeros((5, 64), np.uint8))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(TableFileError):
        TableFile.open(tmp_path)


def test_writer_rejects_bad_rows(tmp_path):
    spec = TableSpec(name="t", rows=10, dim=32, format="bf16")
    with TableWriter(tmp_path, spec) as w:
        with pytest.raises(ValueError, match="uint8"):
            w.write_rows(np.zeros((2, 64), np.int8))
        with pytest.raises(ValueError, match="has 10 rows"):
            w.write_rows(np.zeros((11, 64), np.uint8))
        w.write_rows(np.zeros((3, 64), np.uint8))
        with pytest.raises(ValueError, match="3 of 10 rows written"):
            w.commit()


def test_read_rows_out_of_range(tmp_path):
    tf, _ = _write(tmp_path)
    with pytest.raises(IndexError, match="row 1000 is outside"):
        tf.read_rows([0, 1000])
    with pytest.raises(IndexError, match="row -1"):
        tf.read_rows([-1])


def test_crc32_combine_matches_zlib():
    import zlib

    from plestore.tablefile import crc32_combine

    a, b = RNG.bytes(1000), RNG.bytes(70001)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b""), 0) == zlib.crc32(a)


@pytest.mark.parametrize("block", [0, 512, 4096])
@pytest.mark.parametrize("dim,fmt", [(160, "nvfp4"), (3000, "bf16"), (256, "fp8")])
def test_prepare_in_threads_equals_sequential_writes(tmp_path, block, dim, fmt):
    """Workers lay out and checksum batches concurrently into recycled (dirty) buffers of
    `place_bytes`; the writer only appends them in order. Chunk boundaries fall anywhere inside
    batches (CRCs are combined)."""
    from concurrent.futures import ThreadPoolExecutor

    spec = TableSpec(name="t", rows=997, dim=dim, format=fmt)
    layout = RowLayout(spec.row_bytes, block_bytes=block)
    data = RNG.integers(0, 256, (997, spec.row_bytes), dtype=np.uint8)
    cuts = [0, 1, 50, 51, 400, 997]
    with TableWriter(tmp_path / "a", spec, layout, chunk_bytes=8192) as w:
        with ThreadPoolExecutor(4) as pool:
            preps = list(
                pool.map(
                    lambda ab: w.prepare(
                        data[ab[0] : ab[1]],
                        ab[0],
                        out=np.full(place_bytes(layout, ab[1] - ab[0]), 0xAB, np.uint8),
                    ),
                    zip(cuts, cuts[1:], strict=False),
                )
            )
        with pytest.raises(ValueError, match="in order"):
            w.write_prepared(preps[1])
        if block:  # unblocked rows are their own bytes: no buffer is needed
            with pytest.raises(ValueError, match="needed"):
                w.prepare(data[1:50], 1, out=np.empty(place_bytes(layout, 49) // 3, np.uint8))
        for p in preps:
            w.write_prepared(p)
        a = w.commit()
    with TableWriter(tmp_path / "b", spec, layout, chunk_bytes=8192) as w:
        w.write_rows(data)
        b = w.commit()
    assert a.checksums == b.checksums and a.verify().ok
    assert a.data_path.read_bytes()[DATA_OFFSET:] == b.data_path.read_bytes()[DATA_OFFSET:]
    np.testing.assert_array_equal(a.read_range(0, 997), data)


@pytest.mark.parametrize("block", [0, 512, 4096])
def test_read_range_every_layout(tmp_path, block):
    tf, data = _write(tmp_path, "bf16", 3000, block=block)  # rows span several blocks
    for a, n in [(0, 1000), (0, 1), (999, 1), (3, 5), (44, 2), (500, 0)]:
        np.testing.assert_array_equal(tf.read_range(a, n), data[a : a + n])
    tf2, data2 = _write(tmp_path / "n", "nvfp4", 160, block=block)  # many rows per block
    for a, n in [(0, 1000), (44, 3), (45, 45), (990, 10)]:
        np.testing.assert_array_equal(tf2.read_range(a, n), data2[a : a + n])
    with pytest.raises(IndexError):
        tf.read_range(990, 11)


def test_remove_stale_temps_keeps_live_writers(tmp_path):
    import subprocess

    from plestore.tablefile import remove_stale_temps

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f".t.rows.tmp-{dead.pid}-abcd1234"
    live = tmp_path / f".t.rows.tmp-{os.getppid()}-abcd1234"
    other = tmp_path / f".u.rows.tmp-{dead.pid}-abcd1234"
    for p in (stale, live, other):
        p.write_bytes(b"x")
    assert remove_stale_temps(tmp_path, "t") == [stale]
    assert live.exists() and other.exists() and not stale.exists()


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 255, 4096, 65537])
def test_crc32_combine_lengths(n):
    import zlib

    from plestore.tablefile import crc32_combine

    a, b = RNG.bytes(13), RNG.bytes(n)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), n) == zlib.crc32(a + b)


def test_a_checkpoint_or_an_empty_directory_says_how_to_make_a_table(tmp_path, small_checkpoint):
    import plestore

    ck = small_checkpoint("qwen3.8-flash-next", "nvfp4")
    says = rf"{ck} is a checkpoint .*`plestore pack {ck} TABLES`"
    with pytest.raises(TableFileError, match=says):
        plestore.open_table(ck)
    for command in ("verify", "rows"):  # the CLI says the same (inspect reads checkpoints)
        args = [sys.executable, "-m", "plestore", command, str(ck)]
        if command == "rows":
            args += ["--ids", "1"]
        run = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert run.returncode == 1 and re.search(says, run.stderr), (command, run.stderr)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TableFileError, match=r"holds no packed tables .*`plestore pack CHECKPOINT"):
        plestore.open_table(tmp_path / "empty", table="ple.layers.1")
    (tmp_path / "empty" / "t.json").write_text("{}")  # a JSON file that is no table's metadata
    with pytest.raises(TableFileError, match="t.json is not plestore table metadata"):
        plestore.open_table(tmp_path / "empty" / "t.json")
