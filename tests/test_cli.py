"""The CLI: every subcommand has --help, numbers have --json, and CI runs the README's command."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from slow_pack import slow_pack

from plestore.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def _subcommands() -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sorted(sub.choices)


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", readme, re.S)
    commands = [line for b in blocks[:1] for line in b.strip().splitlines()]
    assert len(commands) == 2, "the README opens with exactly two set-up commands"
    assert "torch==2.13.0" in commands[0] and "torch==2.13.0" in commands[1]
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert commands[1] in ci
    # ... inside a venv made fresh for it, apart from the machine's site-packages
    before = ci[: ci.index(commands[1])]
    assert any(line.strip() == "job main" for line in before)
    assert "--system-site-packages" not in "\n".join(ci)
    assert any("python3 -m venv" in line for line in ci)


@pytest.mark.parametrize("command", _subcommands())
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    assert "usage: plestore " + command in capsys.readouterr().out


def test_version_and_module_entry_point():
    out = subprocess.run(
        [sys.executable, "-m", "plestore", "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip().startswith("plestore ")


def test_formats_json(capsys):
    assert main(["formats", "--dim", "160", "--json"]) == 0
    rows = {r["format"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["nvfp4"]["row_bytes"] == {"160": 90}
    assert rows["fp8_e4m3"]["table_scale"] is True


def test_formats_table(capsys):
    assert main(["formats"]) == 0
    out = capsys.readouterr().out
    assert "nvfp4" in out and "90" in out and "144" in out


def test_inspect_config_preset_json(capsys):
    assert main(["inspect-config", "--preset", "qwen3.8-flash-next", "--json"]) == 0
    (table,) = json.loads(capsys.readouterr().out)
    assert table["rows"] == 320_001_536 and table["nbytes"] == 51_200_245_760
    assert table["nbytes_by_format"]["nvfp4"] == 28_800_138_240


def test_inspect_config_file_and_errors(tmp_path, capsys):
    from plestore.spec import preset_config

    (tmp_path / "config.json").write_text(json.dumps(preset_config("deepseek-v4.1-flash")))
    assert main(["inspect-config", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "engram.layers.1" in out and "engram.layers.14" in out
    assert main(["inspect-config", str(tmp_path / "nope")]) == 1
    assert "no config.json" in capsys.readouterr().err


_INTERRUPT_AT_START = """
import argparse, sys
def interrupted(*a, **k):
    raise KeyboardInterrupt  # what Ctrl-C raises, as the command starts
argparse.ArgumentParser.parse_args = interrupted
from plestore.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(
    "argv",
    [[c] for c in _subcommands()]
    + [["bench", b] for b in ("lookup", "pack", "hash", "shared", "fuzz")],
    ids=" ".join,
)
def test_every_command_takes_ctrl_c_as_one_line_and_status_130(argv):
    r = subprocess.run(
        [sys.executable, "-c", _INTERRUPT_AT_START, *argv], capture_output=True, text=True
    )
    assert r.returncode == 130, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"plestore {argv[0]}: interrupted; "), line


def test_ctrl_c_during_pack_leaves_the_previous_table(tmp_path, small_checkpoint):
    import signal
    import time

    from plestore.tablefile import DATA_OFFSET, TableFile

    ck, out = small_checkpoint("qwen3.8-flash-next", "bf16"), tmp_path / "t"
    cmd = [sys.executable, "-m", "plestore", "pack", str(ck), str(out), "--no-progress"]
    subprocess.run([*cmd, "--block-bytes", "4096"], check=True, capture_output=True)
    slow = slow_pack(ck, out, 0.05, "--block-bytes", "512", "--batch-mib", "0.0625")  # a re-pack
    # SIGINT as a terminal's Ctrl-C finds it: a shell starts background jobs (a CI runner's
    # too) with SIGINT ignored, and Python then keeps it ignored
    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    proc = subprocess.Popen(
        slow, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=default_sigint
    )
    deadline = time.time() + 60
    while not any(p.stat().st_size > DATA_OFFSET + (256 << 10) for p in out.glob(".*.rows.tmp-*")):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    stderr = proc.communicate(timeout=60)[1].decode()
    assert proc.returncode == 130, stderr
    assert stderr.strip() == (
        "plestore pack: interrupted; the table being packed was not written (the previous one "
        "is intact); tables finished before it are kept"
    )
    tf = TableFile.open(out)
    assert tf.layout.block_bytes == 4096 and tf.verify().ok
    assert not list(out.glob(".*tmp*")), list(out.iterdir())


def test_ctrl_c_while_still_importing_is_one_line():
    """A Ctrl-C in the first fraction of a second lands in the imports: no traceback either."""
    script = (
        "import runpy, sys\n"
        "class Stop:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'plestore.cli':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Stop())\n"
        "runpy.run_module('plestore', run_name='__main__')\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert r.returncode == 130 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == "plestore: interrupted while starting; nothing was changed"
    toml = (ROOT / "pyproject.toml").read_text()
    assert 'plestore = "plestore.__main__:main"' in toml  # the script takes the same path


def test_ctrl_c_during_a_first_pack_claims_no_previous_table(tmp_path, small_checkpoint):
    import signal
    import time

    out = tmp_path / "t"
    slow = slow_pack(small_checkpoint("qwen3.8-flash-next", "bf16"), out, 0.05)
    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    proc = subprocess.Popen(slow, stderr=subprocess.PIPE, preexec_fn=default_sigint)
    deadline = time.time() + 60
    while not any(p.stat().st_size > 64 << 10 for p in out.glob(".*.rows.tmp-*")):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    stderr = proc.communicate(timeout=60)[1].decode()
    assert proc.returncode == 130 and stderr.strip() == (
        "plestore pack: interrupted; the table being packed was not written; tables finished "
        "before it are kept"
    ), stderr


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        ("demo", ["--tiers", "--prompts", "--repeats", "--format", "--decode-tokens"]),
        ("pack", ["--block-bytes"]),
        ("verify", ["--threads"]),
    ],
)
def test_help_states_every_default(command, flags, capsys):
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    helps = {s: a.help for a in sub._actions for s in a.option_strings}
    assert all("default" in helps[flag].lower() for flag in flags), helps
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    if command == "demo":
        assert "500 MB" in text and "Columns:" in text and "fp8_e4m3 (1 B a value" in text


def test_inspect_config_heads_every_column(capsys):
    assert main(["inspect-config", "--preset", "qwen3.8-flash-next"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(line for line in lines if line.split()[:1] == ["format"])
    assert head.split() == ["format", "bytes", "size"]


def test_readme_python_snippet_runs_as_written(tmp_path, small_checkpoint, monkeypatch, capsys):
    """The Quickstart's Python, on the Quickstart's `synth` + `pack` output (small here); its
    comments say what PLE, [0, 3, 4] and fresh_context(2) are."""
    from plestore.tablefile.pack import pack_checkpoint

    readme = (ROOT / "README.md").read_text()
    code = re.findall(r"```python\n(.*?)```", readme, re.S)[0]
    assert "PLE\n(per-layer embedding)" in readme and "2 new requests" in code
    assert "[0, 3, 4]: request 0 is tokens 0-2, request 1 token 3" in code
    (tmp_path / "ckpt").symlink_to(small_checkpoint("qwen3.8-flash-next", "nvfp4"))
    pack_checkpoint(tmp_path / "ckpt", tmp_path / "tables")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert tuple(scope["emb"].shape) == (4, 16 * 160) and scope["row_ids"].shape == (4, 16)
    assert "rows: 64" in capsys.readouterr().out  # (stats() print as people read them)
    scope["table"].close()
