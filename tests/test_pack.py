"""pack: synth -> pack -> every row equals the checkpoint's and expected_rows, in every format
and block size; reuse in < 1 s; bounded memory; a kill -9 or a full disk leaves nothing that
opens, and the rerun completes."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from slow_pack import slow_pack

from conftest import ALL_KINDS
from plestore.checkpoint import Checkpoint, detect_tables, expected_rows
from plestore.formats import get_format
from plestore.spec import TableSpec
from plestore.tablefile import DATA_OFFSET, TableFile, TableFileError
from plestore.tablefile.pack import pack_checkpoint
from plestore.tablefile.verify import verify_against

QWEN = "qwen3.8-flash-next"


@pytest.mark.parametrize("block", [4096, 512, 0])
@pytest.mark.parametrize("preset,fmt", ALL_KINDS)
def test_round_trip_every_format_and_block(small_checkpoint, tmp_path, preset, fmt, block):
    ck_dir = small_checkpoint(preset, fmt)
    rep = pack_checkpoint(ck_dir, tmp_path, block_bytes=block, batch_bytes=150_000, threads=2)
    with Checkpoint.open(ck_dir) as ck:
        sources = {s.name: s for s in detect_tables(ck)}
        assert [t.name for t in rep.tables] == list(sources)
        for t in rep.tables:
            src = sources[t.name]
            tf = TableFile.open(tmp_path, t.name)
            assert tf.spec == src.spec and tf.layout.block_bytes == block and not t.reused
            rows = tf.read_range(0, tf.spec.rows)
            np.testing.assert_array_equal(rows, src.read_rows(0, src.spec.rows))
            np.testing.assert_array_equal(rows, expected_rows(tf.spec, 0, np.arange(tf.spec.rows)))
            pick = np.array([tf.spec.rows - 1, 0, 12345 % tf.spec.rows])
            np.testing.assert_array_equal(tf.read_rows(pick), rows[pick])
            assert tf.verify().ok and verify_against(tf, ck).ok
            assert tf.source["fingerprint"] == src.fingerprint
            if tf.spec.format == "nvfp4":  # [80 code bytes | 10 e4m3 block-scale bytes]
                seg = src.segments[1]
                codes = ck.read_rows(seg.parts[0], 0, 3)
                scales = ck.read_rows(seg.parts[1], 0, 3)
                got = tf.read_range(seg.first_row, 3)
                np.testing.assert_array_equal(got, np.concatenate([codes, scales], axis=1))


def test_reuse_is_instant_and_only_when_nothing_changed(small_checkpoint, tmp_path):
    ck_dir = small_checkpoint(QWEN, "nvfp4")
    first = pack_checkpoint(ck_dir, tmp_path)
    t0 = time.perf_counter()
    again = pack_checkpoint(ck_dir, tmp_path)
    assert time.perf_counter() - t0 < 1.0 and again.reused and again.to_dict()["reused"]
    assert again.tables[0].data_bytes == first.tables[0].data_bytes
    block = first.tables[0].block_bytes  # the disk's (see test_a_new_table_gets_...)
    want = 4096 if block == 512 else 512
    other = pack_checkpoint(ck_dir, tmp_path, block_bytes=want)  # other options: re-packed
    assert not other.reused and TableFile.open(tmp_path).layout.block_bytes == want
    assert other.tables[0].replaced == {"block_bytes": [block, want]}  # and says so
    assert pack_checkpoint(ck_dir, tmp_path).reused  # no size given: any is reused
    tf = TableFile.open(tmp_path)
    os.truncate(tf.data_path, os.path.getsize(tf.data_path) - 1)  # a table that no longer opens
    fixed = pack_checkpoint(ck_dir, tmp_path, block_bytes=512)
    assert not fixed.reused and TableFile.open(tmp_path).verify().ok
    assert fixed.tables[0].replaced is None  # (nothing that opened was replaced)


def test_a_new_table_gets_the_disks_smallest_direct_read_and_says_why(
    small_checkpoint, tmp_path, monkeypatch
):
    from plestore.io import odirect

    ck_dir = small_checkpoint(QWEN, "nvfp4")
    (t,) = pack_checkpoint(ck_dir, tmp_path / "a").tables
    assert t.block_bytes == odirect.o_direct_alignment(TableFile.open(tmp_path / "a").data_path)
    assert "O_DIRECT" in t.block_reason and str(tmp_path / "a") in t.block_reason

    def no_direct(path, offset=0):
        raise OSError(22, f"{path}: this filesystem does not support O_DIRECT")

    monkeypatch.setattr(odirect, "o_direct_alignment", no_direct)
    (t,) = pack_checkpoint(ck_dir, tmp_path / "b").tables
    assert t.block_bytes == 4096 and "takes no O_DIRECT reads" in t.block_reason
    assert not [p for p in (tmp_path / "b").iterdir() if "probe" in p.name]  # (removed)


@pytest.mark.parametrize(
    "src_fmt,dst_fmt", [("bf16", "nvfp4"), ("bf16", "fp8"), ("fp8_e4m3", "nvfp4")]
)
def test_conversion_reports_error_and_verifies(small_checkpoint, tmp_path, src_fmt, dst_fmt):
    ck_dir = small_checkpoint(QWEN, src_fmt)
    rep = pack_checkpoint(ck_dir, tmp_path, format=dst_fmt, batch_bytes=200_000)
    (t,) = rep.tables
    tf = TableFile.open(tmp_path)
    assert tf.spec.format == get_format(dst_fmt).name == t.format and t.source_format == src_fmt
    err = t.encode_error
    assert err is not None and 0 < err["rel_rmse"] < 0.2 and err["max_rel"] < 0.5
    with Checkpoint.open(ck_dir) as ck:
        (src,) = detect_tables(ck)
        ref = get_format(src_fmt).decode_numpy(src.read_rows(0, 500), scale=src.spec.scale)
        got = get_format(tf.spec.format).decode_numpy(tf.read_range(0, 500), scale=tf.spec.scale)
        amax = np.abs(ref).max()
        assert np.abs(got - ref).max() <= err["max_abs"] + 1e-12 and amax <= 6 * 448 * tf.spec.scale
        assert verify_against(tf, ck).ok
    again = pack_checkpoint(ck_dir, tmp_path, format=dst_fmt)
    assert again.reused and again.tables[0].encode_error == err
    given = pack_checkpoint(ck_dir, tmp_path / "s", format=dst_fmt, scale=0.5)
    assert TableFile.open(tmp_path / "s").spec.scale == 0.5 and not given.reused


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (decoding NaN and inf bytes)
@pytest.mark.parametrize("dst_fmt", ["fp8_e4m3", "bf16", "fp16", "fp32"])
@pytest.mark.parametrize("src_fmt", ["nvfp4", "fp8_e4m3", "bf16", "fp8_ue8m0", "nf4"])
def test_lookup_conversion_is_decode_then_encode_byte_for_byte(src_fmt, dst_fmt):
    """Every byte pattern a row can hold (random rows: NaN, inf, subnormals, -0.0, values past
    the target's range at a small scale), converted by the lookup tables and by decoding and
    encoding: the same bytes, the same error sums, and the same refusal of a value the target
    cannot hold."""
    from plestore.tablefile.convert import Conversion

    src = TableSpec(
        name="t",
        rows=4000,
        dim=64,
        format=src_fmt,
        scale=0.75 if src_fmt in ("nvfp4", "fp8_e4m3") else 1.0,
    )
    raw = np.random.default_rng(5).integers(0, 256, (src.rows, src.row_bytes), dtype=np.uint8)
    values = get_format(src_fmt).decode_numpy(raw, scale=src.scale, dim=src.dim)
    finite = raw[np.isfinite(values).all(axis=1)]
    for scale in (1.0, 2.0**-12):  # the second saturates most values
        dst = src.replace(format=dst_fmt, scale=scale if dst_fmt == "fp8_e4m3" else 1.0)
        conv = Conversion(src, dst)
        assert conv.symbols is not None  # (the lookup path)
        got, sums = conv(finite)
        want, want_sums = conv._decode_encode(finite)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(sums, want_sums, rtol=1e-9)
        if dst_fmt == "bf16":  # stores NaN and inf as they are
            np.testing.assert_array_equal(conv(raw)[0], conv._decode_encode(raw)[0])
        else:
            with pytest.raises(ValueError, match="table t: .*cannot encode non-finite value"):
                conv(raw)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (decoding NaN scale bytes)
def test_nvfp4_max_without_decoding_is_the_decoded_max():
    """The first pass's max |x| of NVFP4 rows from nibble codes and block scales: every byte
    pattern, tiny scales, few nibble codes, NaN scales, at three table scales."""
    from plestore.tablefile.convert import _nvfp4_amax

    rng = np.random.default_rng(3)
    for trial in range(300):
        raw = rng.integers(0, 256, (int(rng.integers(0, 40)), 90), dtype=np.uint8)
        if trial % 3 == 0:
            raw[:, 80:] = rng.integers(0, 3, raw[:, 80:].shape)  # subnormal block scales
        if trial % 5 == 0:
            raw[:, :80] &= (0x11, 0x33)[trial % 2]  # small nibble codes only
        scale = (0.37, 1e-3, 2.0**-8)[trial % 3]
        v = np.abs(get_format("nvfp4").decode_numpy(raw, scale, 160))
        assert _nvfp4_amax(raw, 160, scale) == v[np.isfinite(v)].max(initial=0), trial


def test_table_selection(small_checkpoint, tmp_path):
    ck_dir = small_checkpoint("deepseek-v4.1-flash")
    rep = pack_checkpoint(ck_dir, tmp_path, table="engram.layers.14")
    assert [t.name for t in rep.tables] == ["engram.layers.14"]
    assert [p.name for p in tmp_path.glob("*.json")] == ["engram.layers.14.json"]
    with pytest.raises(ValueError, match="no table 'nope' .*engram.layers.1, engram.layers.14"):
        pack_checkpoint(ck_dir, tmp_path, table="nope")


def test_verify_against_finds_a_changed_source_row(small_checkpoint, tmp_path):
    ck_dir = tmp_path / "ck"
    shutil.copytree(small_checkpoint(QWEN, "fp8_e4m3"), ck_dir)
    pack_checkpoint(ck_dir, tmp_path / "t")
    with Checkpoint.open(ck_dir) as ck:
        (src,) = detect_tables(ck)
        seg = src.segments[7]
        off = seg.parts[0].offset + 4 * seg.parts[0].row_bytes + 9  # row 4 of shard 7
    with open(seg.parts[0].file, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x01]))
    rep = verify_against(tmp_path / "t", ck_dir)
    assert not rep.ok and rep.bad_rows == 1 and rep.first_bad_row == seg.first_row + 4
    assert not rep.fingerprint_matches and rep.rows_sha256_matches is False
    assert "first bad row" in rep.message and "fingerprint differs" in rep.message


# ----------------------------------------------------------------------------------------------
# Memory, interruption, full and unwritable disks
# ----------------------------------------------------------------------------------------------

_RSS_SCRIPT = """
import json, os, sys
from plestore.checkpoint import Checkpoint, detect_tables
from plestore.tablefile.pack import pack_checkpoint
from plestore.io.streaming import peak_rss_bytes
ck = Checkpoint.open(sys.argv[1]); detect_tables(ck)
import tqdm  # noqa: the bar's import is not pack's memory
rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = max(rss, peak_rss_bytes())
rep = pack_checkpoint(ck, sys.argv[2], batch_bytes=1 << 20, threads=2, format=sys.argv[3] or None)
print(json.dumps({"before": before, "peak": rep.peak_rss_bytes, "bytes": rep.bytes_written}))
"""


@pytest.mark.parametrize("src_fmt,dst_fmt", [("bf16", ""), ("nvfp4", "fp8_e4m3")])
def test_peak_memory_is_bounded_by_the_batch_not_the_table(
    tmp_path, small_checkpoint, src_fmt, dst_fmt
):
    """A plain pack, and a conversion (two passes, symbol tables, per-thread buffers)."""
    base = 12_000 if src_fmt == "bf16" else 24_000  # tables of 61 and 34 MB (fp8: 62 MB)
    ck_dir = small_checkpoint(QWEN, src_fmt, ngram_vocab_size_base=base)
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(ck_dir), str(tmp_path), dst_fmt],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    r = json.loads(out)
    assert r["bytes"] > 60e6  # 60 batches of 1 MiB of source, or 30 of nvfp4
    growth = r["peak"] - r["before"]
    bound = 64 << 20 if dst_fmt else 24 << 20  # + a conversion's tables and scratch
    assert growth < bound, f"pack grew the RSS by {growth / 2**20:.1f} MiB"


def test_kill_9_mid_pack_leaves_nothing_that_opens_and_rerun_completes(small_checkpoint, tmp_path):
    ck_dir = small_checkpoint(QWEN, "bf16")
    cmd = slow_pack(ck_dir, tmp_path, 0.05, "--batch-mib", "0.0625")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 30
        while time.time() < deadline:  # until a good part of the table is written
            temps = list(tmp_path.glob(".ple.layers.1.rows.tmp-*"))
            if temps and temps[0].stat().st_size > DATA_OFFSET + (1 << 20):
                break
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.02)
        else:
            pytest.fail("pack never got going")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not list(tmp_path.glob("*.json")) and not (tmp_path / "ple.layers.1.rows").exists()
    with pytest.raises(TableFileError):
        TableFile.open(tmp_path)
    rep = pack_checkpoint(ck_dir, tmp_path)
    t = rep.tables[0]
    assert not t.reused and t.removed_temps == 2  # the data and its block checksums
    names = ["ple.layers.1.crc", "ple.layers.1.json", "ple.layers.1.rows"]
    assert sorted(p.name for p in tmp_path.iterdir()) == names  # no lock file left (LOCK_NAME)
    tf = TableFile.open(tmp_path)
    assert tf.verify().ok
    np.testing.assert_array_equal(
        tf.read_range(0, tf.spec.rows), expected_rows(tf.spec, 0, np.arange(tf.spec.rows))
    )


@pytest.mark.parametrize(
    "where", ["pwrite", "fsync data", "fsync block checksums", "fsync metadata"]
)
def test_full_disk_is_a_clear_error_and_commits_nothing(
    small_checkpoint, tmp_path, monkeypatch, where
):
    ck_dir = small_checkpoint(QWEN, "fp8_e4m3")
    name, fail_at = {
        "pwrite": ("pwrite", 5),
        "fsync data": ("fsync", 1),
        "fsync block checksums": ("fsync", 2),
        "fsync metadata": ("fsync", 3),
    }[where]
    real = getattr(os, name)
    calls = [0]

    def full(*a):
        calls[0] += 1
        if calls[0] >= fail_at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*a)

    monkeypatch.setattr(os, name, full)
    with pytest.raises(OSError, match="No space left on device while packing table ple.layers.1"):
        pack_checkpoint(ck_dir, tmp_path, batch_bytes=100_000, threads=1)
    monkeypatch.undo()
    with pytest.raises(TableFileError):
        TableFile.open(tmp_path)
    assert not list(tmp_path.glob(".*.tmp-*"))  # the writer removed its temporary files
    rep = pack_checkpoint(ck_dir, tmp_path)  # once there is room again, the rerun completes
    assert not rep.reused and TableFile.open(tmp_path).verify().ok
    names = ["ple.layers.1.crc", "ple.layers.1.json", "ple.layers.1.rows"]
    assert sorted(p.name for p in tmp_path.iterdir()) == names  # no lock file left (LOCK_NAME)


def test_unwritable_output(small_checkpoint, tmp_path):
    ck_dir = small_checkpoint(QWEN, "nvfp4")
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError, match="output directory .*file/out is not writable"):
        pack_checkpoint(ck_dir, tmp_path / "file" / "out")
    with pytest.raises(NotADirectoryError, match="output .*file is a file"):
        pack_checkpoint(ck_dir, tmp_path / "file")
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(OSError, match="is not writable"):
            pack_checkpoint(ck_dir, ro)


def test_pack_tools_do_not_import_torch():
    """torch adds ~200 MB resident to pack's 1 GiB budget; the tools that never look rows up
    must not pull it in (the lookup engine imports it when asked for)."""
    import subprocess
    import sys

    code = (
        "import sys, plestore, plestore.tablefile.pack, plestore.tablefile.verify, plestore.cli\n"
        "from plestore.cli import main\n"
        "try:\n    main(['pack', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert plestore.open_table is not None and 'torch' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
