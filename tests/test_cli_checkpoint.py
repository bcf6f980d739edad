"""The checkpoint commands end to end: synth -> pack -> verify -> inspect, with --json and exit
codes (1 on a bad table or a failed check)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np

from plestore.checkpoint import Checkpoint, detect_tables, expected_rows
from plestore.cli import main
from plestore.tablefile import TableFile


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


def _cli(*args: str) -> subprocess.CompletedProcess:
    """`plestore ARGS` in a process of its own (exit status, stdout, stderr as a user sees)."""
    cmd = [sys.executable, "-m", "plestore", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_synth_pack_verify_inspect(tmp_path, capsys):
    ck, out = tmp_path / "ck", tmp_path / "tables"
    assert (
        main(
            [
                "synth",
                str(ck),
                "--preset",
                "qwen3.8-flash-next",
                "--format",
                "nvfp4",
                "--ngram-vocab-size-base",
                "1000",
                "--hidden-size",
                "32",
                "--seed",
                "3",
                "--no-progress",
                "--json",
            ]
        )
        == 0
    )
    s = _json(capsys)
    assert s["tables"][0]["rows"] == 16896 and len(s["files"]) == 3 and s["seed"] == 3
    assert main(["pack", str(ck), str(out), "--block-bytes", "512", "--no-progress", "--json"]) == 0
    p = _json(capsys)
    assert not p["reused"] and p["bytes_written"] > 0 and p["peak_rss_bytes"] > 0
    assert p["tables"][0]["throughput_bytes_per_s"] > 0
    tf = TableFile.open(out)
    np.testing.assert_array_equal(tf.read_range(0, 100), expected_rows(tf.spec, 3, range(100)))
    assert main(["pack", str(ck), str(out), "--block-bytes", "512", "--no-progress"]) == 0
    assert "reused" in capsys.readouterr().out
    assert main(["verify", str(out), "--against", str(ck), "--no-progress", "--json"]) == 0
    v = _json(capsys)
    assert v["ok"] and v["tables"][0]["against"]["ok"] and v["tables"][0]["checksums_ok"]
    assert main(["inspect", str(ck), "--json"]) == 0
    i = _json(capsys)
    t = i["checkpoint"]["tables"][0]
    assert t["format"] == "nvfp4" and t["shards"] == 128 and t["scale"] == 2.0**-8
    assert t["fingerprint"] == tf.source["fingerprint"]
    assert main(["inspect", str(out), "--json"]) == 0
    (tt,) = _json(capsys)["tables"]
    assert tt["layout"]["block_bytes"] == 512 and tt["rows_per_block"] == 5
    assert tt["source"]["options"]["format"] == "nvfp4"
    assert main(["inspect", str(ck)]) == 0 and "ple.layers.1" in capsys.readouterr().out
    assert main(["inspect", str(out)]) == 0 and "5 rows per block" in capsys.readouterr().out


def test_verify_fails_on_a_flipped_byte_and_inspect_on_a_broken_table(
    tmp_path, capsys, small_checkpoint
):
    ck = small_checkpoint("deepseek-v4.1-flash")
    assert main(["pack", str(ck), str(tmp_path), "--block-bytes", "4096", "--no-progress"]) == 0
    capsys.readouterr()
    tf = TableFile.open(tmp_path, "engram.layers.14")
    off = int(tf.row_offsets(np.array([777]))[0])
    with open(tf.data_path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x40]))
    assert main(["verify", str(tmp_path), "--no-progress"]) == 1
    text = capsys.readouterr().out
    assert "engram.layers.1: checksums OK" in text and "engram.layers.14: checksums FAILED" in text
    assert "1 of 1,185 blocks differ from the .crc sidecar: block 51 (rows 765..779)" in text
    assert (
        main(
            [
                "verify",
                str(tmp_path),
                "--table",
                "engram.layers.14",
                "--against",
                str(ck),
                "--no-progress",
                "--json",
            ]
        )
        == 1
    )
    a = _json(capsys)["tables"][0]["against"]
    assert a["bad_rows"] == 1 and a["first_bad_row"] == 777
    tf.data_path.write_bytes(b"")
    assert main(["inspect", str(tmp_path)]) == 1
    assert "is 0 bytes" in capsys.readouterr().out
    for command in ("verify", "inspect"):  # the same words for a path that is not there
        assert main([command, str(tmp_path / "nothing")]) == 1
        err = capsys.readouterr().err
        assert err == f"plestore {command}: error: {tmp_path / 'nothing'} does not exist\n", err


def test_errors_are_one_line(tmp_path, capsys):
    assert main(["pack", str(tmp_path), str(tmp_path / "o"), "--no-progress"]) == 1
    assert "holds neither model.safetensors.index.json" in capsys.readouterr().err
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    assert main(["inspect", str(tmp_path)]) == 1
    assert "header length 16 exceeds the file" in capsys.readouterr().err


def test_pack_refuses_a_table_of_another_checkpoint_unless_forced(tmp_path, small_checkpoint):
    a, b = (
        small_checkpoint("qwen3.8-flash-next", "nvfp4"),
        small_checkpoint("qwen3.8-flash-next", "nvfp4", seed=1),
    )
    out = tmp_path / "t"
    assert _cli("pack", a, out, "--no-progress").returncode == 0
    mine = TableFile.open(out).source["fingerprint"]
    r = _cli("pack", b, out, "--no-progress")
    theirs = TableFile.open(out).source["fingerprint"]
    assert r.returncode == 1 and theirs == mine, r.stdout  # refused, nothing replaced
    with Checkpoint.open(b) as ck:
        other = detect_tables(ck)[0].fingerprint
    assert mine in r.stderr and other in r.stderr and "--force" in r.stderr, r.stderr
    assert "force=True" not in r.stderr  # the CLI names its own flags only
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    block = TableFile.open(out).layout.block_bytes  # (the disk's smallest O_DIRECT read)
    want = 4096 if block == 512 else 512
    r = _cli("pack", a, out, "--block-bytes", want, "--no-progress")  # same source, new options
    assert r.returncode == 0 and TableFile.open(out).layout.block_bytes == want, r.stderr
    assert f": replaced (block size {block} → {want}): packed " in r.stdout, r.stdout
    r = _cli("pack", b, out, "--no-progress", "--force")
    assert r.returncode == 0 and TableFile.open(out).source["fingerprint"] == other, r.stderr


def test_verify_names_every_bad_block_and_says_what_it_checked(tmp_path, small_checkpoint):
    out = tmp_path / "t"
    assert (
        _cli(
            "pack",
            small_checkpoint("qwen3.8-flash-next", "nvfp4"),
            out,
            "--block-bytes",
            "512",
            "--no-progress",
        ).returncode
        == 0
    )
    ok = _cli("verify", out, "--no-progress")
    tf = TableFile.open(out)
    assert ok.returncode == 0 and (
        f"all {tf.spec.rows:,} rows: 1 chunk CRC32s (" in ok.stdout
        and f"{tf.block_checks.count:,} block CRC-32s (512-B blocks" in ok.stdout
    ), ok.stdout
    rows = [10, 11, 12, 16, 5000]  # 5 rows a block: blocks 2, 3 (a run) and 1000
    with open(tf.data_path, "r+b") as f:
        for r in rows:
            f.seek(int(tf.row_offsets(np.array([r]))[0]) + 7)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x08]))
    bad = _cli("verify", out, "--no-progress")
    assert bad.returncode == 1
    assert "3 of" in bad.stdout and "blocks 2..3 (rows 10..19), block 1000 (rows 5000..5004)" in (
        bad.stdout
    ), bad.stdout
    (t,) = json.loads(_cli("verify", out, "--no-progress", "--json").stdout)["tables"]
    assert t["bad_blocks"] == [2, 3, 1000] and [r["rows"] for r in t["bad_runs"]] == [
        [10, 19],
        [5000, 5004],
    ]


def test_rows_prints_decoded_rows_with_their_tier_and_offsets(tmp_path, small_checkpoint):
    from plestore.formats import get_format

    out = tmp_path / "t"
    ck = small_checkpoint("qwen3.8-flash-next", "nvfp4")
    assert _cli("pack", ck, out, "--block-bytes", "4096").returncode == 0
    tf = TableFile.open(out)
    ids = [3, 4, tf.spec.rows - 1]
    r = _cli("rows", out, "--ids", ",".join(map(str, ids)), "--tier", "direct", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["tier"] == "direct" and [x["id"] for x in got["rows"]] == ids
    want = get_format("nvfp4").decode_numpy(tf.read_rows(ids), tf.spec.scale)
    for x, offset, raw, values in zip(
        got["rows"], tf.row_offsets(np.array(ids)), tf.read_rows(ids), want, strict=True
    ):
        assert x["file_offset"] == offset and x["bytes_hex"] == raw.tobytes().hex()
        assert x["values"] == values.tolist() and x["matches_file"]
        assert x["block"] == (offset - 4096) // 4096
    text = _cli("rows", out, "--ids", "3").stdout
    assert f"row 3: {tf.data_path} offset {tf.row_offsets(np.array([3]))[0]:,}, block 0" in text
    assert "on tier mapped" in text and "equals the file's row" in text
    for bad in ("3,99999999", "3,x"):
        r = _cli("rows", out, "--ids", bad)
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    huge = "99999999999999999999999"  # an integer past int64: out of range, not "not integers"
    r = _cli("rows", out, "--ids", huge)
    assert r.stderr.strip() == (
        f"plestore rows: error: --ids: row {huge} is outside table {tf.name}'s "
        f"{tf.spec.rows:,} rows (0 to {tf.spec.rows - 1:,})"
    ), r.stderr
    short, full = text, _cli("rows", out, "--ids", "3", "--full").stdout
    assert "(160 values; --full)" in short and len(short.splitlines()) <= 6, short
    assert "--full" not in full and len(full.splitlines()) > 20
    r = _cli("pack", out, tmp_path / "again")  # the packed tables given as the checkpoint
    assert r.returncode == 1 and r.stderr.strip() == (
        f"plestore pack: error: {out} holds packed tables, not a checkpoint: pack reads a "
        "checkpoint (config.json + safetensors); these tables open as they are (plestore "
        "inspect, plestore.open_table)"
    )


def test_messages_say_what_is_there(tmp_path, small_checkpoint):
    """synth counts the files it writes; inspect says how a row longer than a block lies; pack
    into a regular file says it is one."""
    r = _cli(
        "synth",
        tmp_path / "g",
        "--preset",
        "gemma3n-e2b",
        "--ngram-vocab-size-base",
        "3000",
        "--hidden-size",
        "32",
        "--no-progress",
    )
    files = sorted(p.name for p in (tmp_path / "g").iterdir())
    assert r.returncode == 0 and f"{len(files)} files (3 safetensors, config.json, " in r.stdout
    r = _cli("pack", tmp_path / "g", tmp_path / "t", "--block-bytes", "4096", "--no-progress")
    assert r.returncode == 0, r.stderr
    r = _cli("inspect", tmp_path / "t")  # Gemma rows: 7680 bf16 values, 15,360 B, 4 blocks
    assert "4096 B blocks, 4 whole blocks per row" in r.stdout
    assert "0 rows per block" not in r.stdout
    (tmp_path / "afile").write_text("")
    r = _cli("pack", small_checkpoint("qwen3.8-flash-next", "nvfp4"), tmp_path / "afile")
    assert r.returncode == 1 and r.stderr.strip() == (
        f"plestore pack: error: output {tmp_path / 'afile'} is a file: pack writes "
        "<table>.json, .rows and .crc into a directory; name a new or existing directory"
    )


def test_pack_names_a_checkpoint_changed_in_place(tmp_path, small_checkpoint):
    """The same path, its files rewritten since the table was packed: refused as a change of
    that checkpoint (not "another checkpoint"), both fingerprints named."""
    ck = tmp_path / "ck"
    shutil.copytree(small_checkpoint("qwen3.8-flash-next", "nvfp4"), ck)
    out = tmp_path / "t"
    assert _cli("pack", ck, out, "--no-progress").returncode == 0
    shard = sorted(ck.glob("*.safetensors"))[0]
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    r = _cli("pack", ck, out, "--no-progress")
    assert r.returncode == 1, r.stdout
    assert "before its files changed" in r.stderr and "another checkpoint" not in r.stderr
    assert TableFile.open(out).source["fingerprint"] in r.stderr, r.stderr


def test_inspect_names_what_a_killed_pack_left_and_how_to_remove_it(tmp_path, small_checkpoint):
    import signal
    import time

    from slow_pack import slow_pack

    out = tmp_path / "t"
    proc = subprocess.Popen(slow_pack(small_checkpoint("qwen3.8-flash-next", "bf16"), out, 0.05))
    deadline = time.time() + 60
    while not any(p.stat().st_size > 64 << 10 for p in out.glob(".*.rows.tmp-*")):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)  # kill -9: nothing of the pack's own runs
    proc.wait(timeout=60)
    left = sorted(p.name for p in out.glob(".*.tmp-*"))
    assert left
    r = _cli("inspect", out)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert f"{out} holds no finished table" in line and left[0] in line, line
    assert f"rm {out}/.*.tmp-*" in line and f"plestore pack CHECKPOINT {out}" in line
