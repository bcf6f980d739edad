"""verify_reads: every tier checks the blocks it reads against the table's per-block CRC-32;
a flipped byte is reported (table, block, rows), never returned; older tables are refused with
the way to re-pack them."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import torch

import plestore
from plestore.formats import get_format
from plestore.spec import RowLayout, TableSpec
from plestore.tablefile import DATA_OFFSET, TableFile, TableFileError, TableWriter
from plestore.tablefile.checksums import BlockChecksumError

TIERS = ["device", "pinned", "mapped", "direct"]


def _table(tmp_path, block: int, rows: int = 700, fmt: str = "fp8", dim: int = 160):
    spec = TableSpec(name="t", rows=rows, dim=dim, format=fmt)
    data = np.random.default_rng(block).integers(0, 256, (rows, spec.row_bytes), np.uint8)
    layout = RowLayout(spec.row_bytes, block_bytes=block)
    with TableWriter(tmp_path, spec, layout, chunk_bytes=8192) as w:
        for a in range(0, rows, 97):  # runs that start and end inside blocks
            w.write_rows(data[a : a + 97])
        tf = w.commit()
    want = torch.from_numpy(get_format(fmt).decode_numpy(data, 1.0)).to(torch.bfloat16)
    return tf, want


def _flip(tf: TableFile, row: int) -> None:
    off = DATA_OFFSET + int(tf.layout.offsets(np.array([row]))[0]) + 3
    with open(tf.data_path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("block", [512, 4096, 0])
def test_sidecar_matches_every_block(tmp_path, block):
    tf, _ = _table(tmp_path, block)
    bc = tf.block_checks
    assert tf.version == 2 and bc is not None and bc.unit == (block or 4096)
    assert bc.count == -(-tf.data_bytes // bc.unit)
    bc.verify_rows(np.arange(tf.spec.rows))  # a plain reread agrees with every stored CRC


@pytest.mark.parametrize("core", ["auto", "off"])  # the compiled host core, its reference
@pytest.mark.parametrize("block", [512, 0])
@pytest.mark.parametrize("tier", TIERS)
def test_flipped_byte_is_reported_by_a_lookup(tmp_path, tier, block, core):
    """Checked where the host core reads (the direct tier's blocks inside its one call, the
    mapped tier's before its gather), on the compiled core where built: verify_reads never
    leaves it."""
    from plestore import native

    tf, want = _table(tmp_path, block)
    opts = dict(device="cpu", verify_reads=True, native=core)
    with plestore.open_table(tmp_path, tier=tier, **opts) as t:
        ids = np.arange(tf.spec.rows)
        assert torch.equal(t.lookup(ids[:, None]).view(torch.int16), want.view(torch.int16))
        host = getattr(t.tier, "_core", None)
        if host is not None and tier != "direct":
            assert host is native.load(core)
        elif host is not None and t.tier.engine == "io_uring":
            assert core == "auto" and not isinstance(host, native.reference.DirectCore)
    _flip(tf, 321)
    if tier in ("device", "pinned"):  # checked as the table loads
        with pytest.raises(BlockChecksumError, match=r"table t: block \d+ .*rows \d+\.\.\d+"):
            plestore.open_table(tmp_path, tier=tier, **opts)
        return
    with plestore.open_table(tmp_path, tier=tier, **opts) as t:
        far = np.array([[0], [699]])
        assert torch.equal(t.lookup(far).view(torch.int16), want[[0, 699]].view(torch.int16))
        for _ in range(2):  # nothing of the bad block was cached
            with pytest.raises(BlockChecksumError, match=r"rows \d+\.\.\d+ are corrupt"):
                t.lookup(np.array([[5], [321]]))
        with pytest.raises(BlockChecksumError):
            t.prefetch(np.array([[321]])).result(timeout=30)
    with plestore.open_table(tmp_path, tier=tier, device="cpu") as t:  # off: no check
        t.lookup(np.array([[321]]))


def _downgrade(tf: TableFile) -> None:
    """Rewrite a table as format version 1 (no block checksums), as older plestore wrote it."""
    meta = json.loads(tf.meta_path.read_text())
    meta["plestore_table"] = 1
    del meta["block_checksums"]
    tf.meta_path.write_text(json.dumps(meta))
    tf.block_checks.path.unlink()
    with open(tf.data_path, "r+b") as f:
        f.seek(16)
        f.write(struct.pack("<I", 1))


def test_version_1_opens_without_checks_and_is_refused_with_them(tmp_path):
    tf, want = _table(tmp_path, 512)
    _downgrade(tf)
    old = TableFile.open(tmp_path)
    assert old.version == 1 and old.block_checks is None and old.verify().ok
    with plestore.open_table(tmp_path, tier="mapped", device="cpu") as t:
        assert torch.equal(t.lookup(np.array([[3]])).view(torch.int16), want[3:4].view(torch.int16))
    with pytest.raises(TableFileError, match="version 1.*re-pack it .*plestore pack"):
        plestore.open_table(tmp_path, tier="mapped", device="cpu", verify_reads=True)
    with (
        plestore.defaults.set(verify_reads=True),  # (as PLESTORE_VERIFY_READS=1 would)
        pytest.raises(TableFileError, match="no per-block checksums"),
    ):
        plestore.open_table(tmp_path, tier="direct", device="cpu")


def test_repack_rewrites_a_version_1_table(small_checkpoint, tmp_path):
    from plestore.tablefile.pack import pack_checkpoint

    ck = small_checkpoint("qwen3.8-flash-next", "fp8_e4m3")
    pack_checkpoint(ck, tmp_path)
    _downgrade(TableFile.open(tmp_path))
    rep = pack_checkpoint(ck, tmp_path)
    assert not rep.reused and TableFile.open(tmp_path).block_checks is not None
    assert pack_checkpoint(ck, tmp_path).reused


@pytest.mark.parametrize("what", ["truncated", "foreign", "missing"])
def test_bad_sidecar_is_refused_at_open(tmp_path, what):
    tf, _ = _table(tmp_path, 512)
    other, _ = _table(tmp_path / "o", 512)
    p = tf.block_checks.path
    if what == "truncated":
        os.truncate(p, p.stat().st_size - 4)
    elif what == "foreign":
        p.write_bytes(other.block_checks.path.read_bytes())
    else:
        p.unlink()
    with pytest.raises(TableFileError, match="block checksum file"):
        TableFile.open(tmp_path)


def test_verify_reads_option():
    from plestore.options import TableOptions

    assert TableOptions.from_env({"PLESTORE_VERIFY_READS": "on"}).verify_reads is True
    assert TableOptions.from_env({}).verify_reads is False
    with pytest.raises(ValueError, match="verify_reads"):
        TableOptions(verify_reads="yes")


def test_plestore_verify_checks_the_block_sidecar(tmp_path):
    tf, _ = _table(tmp_path, 512)
    said = tf.verify().message
    assert tf.verify().ok and "block CRC-32s (512-B blocks, the .crc sidecar) match" in said
    with open(tf.block_checks.path, "r+b") as f:  # damage one stored block CRC
        f.seek(64 + 4 * 3)
        f.write(b"\xff\xff\xff\xff")
    rep = TableFile.open(tmp_path).verify()
    assert not rep.ok and rep.bad_chunks == [] and rep.bad_blocks == [3]
    assert ".crc file is damaged" in rep.message
    _flip(tf, 321)
    rep = TableFile.open(tmp_path).verify()
    assert not rep.ok and rep.bad_chunks and "blocks differ" in rep.message


@pytest.mark.parametrize("path", ["native", "python"])
def test_block_crcs_agree_with_zlib_and_a_stream_finds_a_bad_block(tmp_path, monkeypatch, path):
    """Block CRCs (the native core's on its pool, or zlib's per block) equal zlib.crc32 of each
    block — whole blocks, a short last one, unaligned and empty spans; a table streamed with its
    checks raises for a flipped byte in either path."""
    import zlib

    from plestore import native
    from plestore.tablefile import checksums

    if path == "native" and not native.available():
        pytest.skip("native core not built")
    if path == "python":  # the numpy reference's CRCs
        reference = native.load("off")
        monkeypatch.setattr(checksums.native, "load", lambda mode="auto": reference)
    rng = np.random.default_rng(7)
    buf = rng.integers(0, 256, 300_001, np.uint8)  # past the size the core hands to its pool
    starts = np.arange(0, buf.size, 512)
    sizes = np.minimum(512, buf.size - starts)
    odd = rng.integers(0, buf.size - 700, 50)
    starts, sizes = np.concatenate([starts, odd, [5]]), np.concatenate([sizes, odd % 700, [0]])
    want = [zlib.crc32(buf[a : a + n]) for a, n in zip(starts, sizes, strict=True)]
    assert checksums.block_crcs(buf, starts, sizes).tolist() == want
    for a, n in ((buf.size - 10, 11), (-1, 4)):
        with pytest.raises(ValueError, match="outside the buffer"):
            checksums.block_crcs(buf, np.array([a]), np.array([n]))
    if path == "native":
        core = native.load("on")
        out = np.empty(1, np.uint32)
        with pytest.raises(ValueError, match="outside the buffer"):
            core.crc32_blocks(buf, np.array([buf.size - 10]), np.array([11]), out, 2)
        for o, s in ((out, np.array([0, 1])), (np.empty(1, np.float32), np.array([0]))):
            with pytest.raises(ValueError, match="one length"):
                core.crc32_blocks(buf, s, np.ones_like(s), o, 2)
    tf, _ = _table(tmp_path, 512, rows=20_000)
    got = []
    tf.stream(0, tf.spec.rows, lambda a, r: got.append(r), tf.block_checks, chunk_bytes=1 << 16)
    assert len(got) > 2 and sum(len(r) for r in got) == tf.spec.rows
    with pytest.raises(IndexError, match="not in table"):
        tf.stream(5, tf.spec.rows + 1, lambda a, r: None)
    _flip(tf, 12_345)
    with pytest.raises(BlockChecksumError, match=r"rows \d+\.\.\d+"):
        tf.stream(0, tf.spec.rows, lambda a, r: None, tf.block_checks, chunk_bytes=1 << 16)


@pytest.mark.parametrize("core", ["auto", "off"])  # the compiled host core, its reference
@pytest.mark.parametrize("tier", ["mapped", "direct"])
def test_a_staged_step_checks_its_blocks_in_the_host_step(tmp_path, tier, core):
    """A staged lookup's stage() and a graph feed's step run the host step with verify_reads
    (the blocks checked in the core, never a Python read): rows exact, and a flipped byte fails
    that step with the error naming the table, the block and its rows (the feed's check())."""
    from plestore.lookup.graphfeed import FeedError

    tf, want = _table(tmp_path, 512)
    _flip(tf, 321)
    name = "native" if core == "auto" and plestore.native.available() else "reference"
    opts = dict(device="cpu", verify_reads=True, native=core, timeout_s=5)
    with plestore.open_table(tmp_path, tier=tier, **opts) as t:
        staged = t.staged((2, 1))
        staged.stage(np.array([[0], [699]]))
        assert torch.equal(staged.decode().view(torch.int16), want[[0, 699]].view(torch.int16))
        assert t.stats()["last_call"]["host_step"] == name
        named = r"table t: block \d+ .*rows \d+\.\.\d+ are corrupt"
        with pytest.raises(BlockChecksumError, match=named):
            staged.stage(np.array([[5], [321]]))
        ids = torch.zeros(2, 1, dtype=torch.int64)
        feed = t.staged((2, 1), ids=ids, feed=True)
        assert feed.feeder.host_path == name
        ids.copy_(torch.tensor([[321], [5]]))
        feed.post()
        assert torch.isnan(feed.decode().float()).all()
        with pytest.raises(FeedError, match=r"step 1's host read failed: " + named):
            t.check_feed()
