"""plestore's SGLang plugin end to end: SGLang 0.5.23's real Engine on the CPU (the CI shims, the
same GDN recurrence for every engine) with PLESTORE_SGLANG set gives stock SGLang's tokens on
every host tier, bf16 and FP8, through SGLang's prefetch a layer ahead (its offload flag on) and
its plain lookup (off), on one rank and two; a second boot reads no byte of the checkpoint's
table shards and writes nothing; a corrupted table with verify_reads fails naming the block."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="the SGLang job's venv has SGLang (.ci/sglang)")

from sglang_engines import run_engine, run_engines  # noqa: E402
from sglang_fixtures import checkpoints, offload_args, stock  # noqa: E402, F401 (fixtures)

from plestore.tablefile import DATA_OFFSET  # noqa: E402

#: the plugin's line for each table it opens (its tier last)
OPENED = re.compile(r"plestore: \S+ngram_embedding rows \[\d+, \d+\) .* tier (\w+)")
TABLE_SHARD = re.compile(r"\.ple\.ple_embedding\.ngram_embedding\.shard_\d+\.weight$")


def _on(**settings) -> dict:
    return {"PLESTORE_SGLANG": json.dumps(settings)}


@pytest.fixture(scope="module")
def served(checkpoints, tmp_path_factory):
    """{name: (EngineRun, the stock run it must equal)} of engines with the plugin on: bf16 on
    the three host tiers, FP8, TP2 — with SGLang's offload flag on (its prefetch a layer ahead:
    the plugin's gather and reduce) or off (its plain lookup: the plugin's forward). Engines of
    one checkpoint share its table directory: the first to start packs, the others reuse."""
    off = tmp_path_factory.mktemp("offload")
    jobs = {
        "bf16-pinned": ("bf16", {"tier": "pinned"}, offload_args(off / "a"), "bf16"),
        "bf16-mapped": ("bf16", {"tier": "mapped"}, None, "bf16"),
        "bf16-direct": ("bf16", {"tier": "direct"}, offload_args(off / "b"), "bf16"),
        "fp8-mapped": ("fp8", {"tier": "mapped"}, offload_args(off / "d"), "fp8"),
        "bf16-tp2-mapped": ("bf16", {"tier": "mapped"}, {"tp_size": 2}, "bf16-tp2"),
    }
    runs = run_engines(
        [
            {"model": checkpoints(kind), "env": _on(**settings), "engine_args": args}
            for kind, settings, args, _ in jobs.values()
        ],
        parallel=2,
    )
    return {name: (run, job[3]) for (name, job), run in zip(jobs.items(), runs, strict=True)}


@pytest.mark.parametrize(
    "name",
    ["bf16-pinned", "bf16-mapped", "bf16-direct", "fp8-mapped", "bf16-tp2-mapped"],
)  # fmt: skip
def test_every_tier_gives_stock_sglangs_tokens(served, stock, name):
    run, baseline = served[name]
    assert run.tokens == stock[baseline].tokens, name
    assert "Failed to execute general plugin" not in run.log


def test_the_plugin_served_the_tables(served, checkpoints, tmp_path_factory):
    """The tables were plestore's (packed into <model>/plestore, one a PLE layer, each opened on
    its tier), and SGLang's file backend wrote no table file where it was asked for."""
    for kind in ("bf16", "fp8"):
        tables = sorted(p.name for p in (Path(checkpoints(kind)) / "plestore").glob("*.json"))
        assert tables == ["ple.layers.0.json", "ple.layers.1.json"], tables
    for name, (run, _) in served.items():
        tier = name.rsplit("-", 1)[1]
        opened = re.findall(
            r"plestore: \S+ngram_embedding rows \[\d+, \d+\) .* tier (\w+)", run.log
        )
        assert opened and set(opened) == {tier}, (name, run.log[-3000:])
    offload = tmp_path_factory.getbasetemp()
    assert not list(offload.glob("offload*/*/ple_table_*")), "SGLang's file backend wrote"


def _split_tables(src: Path, dst: Path) -> Path:
    """A copy of checkpoint `src` whose PLE table shards sit in a file of their own (as the
    released checkpoints' do), so a boot's reads of them can be seen in the page cache."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("plestore", "*.safetensors*"))
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            tensors.update({k: st.get_tensor(k) for k in st.keys()})  # noqa: SIM118
    tables = {k: v for k, v in tensors.items() if TABLE_SHARD.search(k)}
    rest = {k: v for k, v in tensors.items() if k not in tables}
    save_file(rest, dst / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(tables, dst / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    weight_map = {k: "model-00001-of-00002.safetensors" for k in rest}
    weight_map |= {k: "model-00002-of-00002.safetensors" for k in tables}
    index = {"metadata": {}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst / "model-00002-of-00002.safetensors"


def _resident_pages(path: Path) -> list[int]:
    """The pages of `path` in the page cache (mincore over a fresh mapping of it)."""
    import numpy as np

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        vec = np.zeros(-(-size // mmap.PAGESIZE), np.uint8)
        base = np.frombuffer(m, np.uint8, count=1)
        assert libc.mincore(base.ctypes.data, size, vec.ctypes.data) == 0, ctypes.get_errno()
        del base
    return np.flatnonzero(vec & 1).tolist()


def test_a_second_boot_reads_no_table_byte_and_writes_nothing(checkpoints, stock, tmp_path):
    model = tmp_path / "model"
    shards = _split_tables(Path(checkpoints("bf16")), model)
    first = run_engine(model, env=_on(tier="direct"))
    assert first.tokens == stock["bf16"].tokens
    tables = model / "plestore"
    before = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in tables.iterdir()}
    from plestore.checkpoint.safetensors_io import read_header
    from plestore.io.memory import evict

    with open(shards, "rb+") as f:
        os.fsync(f.fileno())  # (dirty pages stay in the page cache whatever one advises)
    evict(shards)
    assert _resident_pages(shards) == []
    data = -(-read_header(shards).data_start // mmap.PAGESIZE)  # the first page of tensors alone
    second = run_engine(model, env=_on(tier="mapped"))
    assert second.tokens == stock["bf16"].tokens
    # headers are read (the tables' fingerprint), no page of the shards' tensors
    assert [p for p in _resident_pages(shards) if p >= data] == []
    after = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in tables.iterdir()}
    assert after == before  # nothing written: the tables were reused as they were


def test_a_corrupted_table_with_verify_reads_fails_naming_the_block(checkpoints, served, tmp_path):
    tables = tmp_path / "tables"
    shutil.copytree(Path(checkpoints("bf16")) / "plestore", tables)
    rows = tables / "ple.layers.1.rows"
    data = bytearray(rows.read_bytes())
    for at in range(DATA_OFFSET + 100, len(data), 512):  # a flipped byte in every block
        data[at] ^= 0x40
    stat = rows.stat()
    rows.write_bytes(bytes(data))
    os.utime(rows, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    env = _on(tier="direct", table_dir=str(tables), verify_reads=True)
    try:
        run = run_engine(checkpoints("bf16"), env=env)
    except AssertionError as e:  # (SGLang ends its processes when a scheduler raises)
        said = str(e)
    else:
        assert run.error is not None, "the engine served a corrupted table"
        said = run.log
    assert re.search(r"table ple\.layers\.\d: block \d+ .* does not match its CRC-32", said), said[
        -4000:
    ]
