"""What the fuzzer (tests/fuzz.py) mutates: one Target per untrusted input (see fuzz_cases;
lookup ids in fuzz_ids). The table metadata and config targets also check that what is
accepted is right (a table that opens must read back the rows it was written with).
"""

from __future__ import annotations

import contextlib
import io
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
from fuzz_cases import Case, Mutator, Target

__all__ = ["TARGETS", "small_tables"]


# -- safetensors headers -----------------------------------------------------------------------
class SafetensorsTarget(Target):
    """Header JSON (dtype, shape, data_offsets, __metadata__), the length prefix, truncation."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.header = {
            "__metadata__": {"format": "pt"},
            "w": {"dtype": "BF16", "shape": [3, 4], "data_offsets": [0, 24]},
            "s": {"dtype": "F8_E4M3", "shape": [5], "data_offsets": [24, 29]},
            "i": {"dtype": "I64", "shape": [], "data_offsets": [29, 37]},
        }
        self.data = bytes(range(37))
        self.path = root / "case.safetensors"

    @staticmethod
    def _file(header: Any, data: bytes) -> bytes:
        text = json.dumps(header).encode()
        return struct.pack("<Q", len(text)) + text + data

    def case(self, rng) -> Case:
        m = Mutator(rng)
        kind = int(rng.integers(4))
        if kind <= 1:
            header, where = m.tree(self.header, int(rng.integers(1, 3)))
            return Case("header", self._file(header, self.data), where)
        raw = self._file(self.header, self.data)
        if kind == 2:
            n = m.pick([0, 1, 2, len(raw), len(raw) - 8, 2**63, 2**64 - 1, 100_000_001, 7])
            return Case("length", struct.pack("<Q", n) + raw[8:], n)
        return Case("bytes", m.bytes_edit(raw))

    def run(self, case: Case) -> None:
        from plestore.checkpoint.safetensors_io import decode_tensor, read_header

        self.path.write_bytes(case.data)
        h = read_header(self.path)
        with open(self.path, "rb") as f:
            for t in h.tensors.values():
                f.seek(t.offset)
                decode_tensor(t, f.read(t.nbytes))


# -- table metadata and its checksum sidecar ---------------------------------------------------
def _write_table(root: Path, spec, block_bytes: int, seed: int):
    from plestore.spec import RowLayout
    from plestore.tablefile import TableWriter

    rows = np.random.default_rng(seed).integers(0, 256, (spec.rows, spec.row_bytes), np.uint8)
    layout = RowLayout(spec.row_bytes, block_bytes=block_bytes)
    with TableWriter(root, spec, layout, source={"fingerprint": "fuzz"}, chunk_bytes=8192) as w:
        w.write_rows(rows)
        return w.commit(), rows


def small_tables(root: Path) -> list:
    """Two small tables with real hash specs: Qwen4Exp fp8 in 512-B blocks, Engram rows back to
    back. Returns [(TableFile, rows)]."""
    from plestore.spec import TableSpec, preset_config

    qwen = TableSpec.from_hf_config(
        preset_config("qwen3.8-flash-next", "fp8_e4m3", ngram_vocab_size_base=5)
    )
    engram = TableSpec.from_hf_config(
        preset_config("deepseek-v4.1-flash", ngram_vocab_size_base=3), table="engram.layers.14"
    )
    return [_write_table(root / "q", qwen, 512, 1), _write_table(root / "e", engram, 0, 2)]


class TableMetaTarget(Target):
    """Every field of a table's metadata (spec, hash, layout, sizes, ids, checksums) and the
    bytes of its checksum sidecar; what opens must read back the rows it was written with."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.tables = small_tables(root)

    def case(self, rng) -> Case:
        m = Mutator(rng)
        which = int(rng.integers(len(self.tables)))
        tf = self.tables[which][0]
        if rng.random() < 0.8 or tf.block_checks is None:
            meta, where = m.tree(tf.meta, int(rng.integers(1, 3)))
            return Case("meta", meta, (which, where))
        raw = tf.block_checks.path.read_bytes()
        return Case("sidecar", m.bytes_edit(raw), which)

    def run(self, case: Case) -> None:
        from plestore.cli import main
        from plestore.tablefile import TableFile

        which = case.where[0] if case.kind == "meta" else case.where
        tf, rows = self.tables[which]
        if case.kind == "meta":
            path = tf.meta_path.with_name("case.json")
            path.write_text(json.dumps(case.data))
            sidecar = None
        else:
            path = tf.meta_path
            sidecar = tf.block_checks.path
            good = sidecar.read_bytes()
            sidecar.write_bytes(case.data)
        try:
            got = TableFile.open(path)
            quiet = io.StringIO()
            with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
                main(["inspect", str(path), "--json"])  # what `plestore inspect` makes of it
            n = got.spec.rows
            pick = np.array([0, n - 1, n // 2], np.int64)
            back = got.read_rows(pick)
            if got.layout == tf.layout and got.spec.rows == tf.spec.rows:
                assert np.array_equal(back, rows[pick]), "an accepted table read other bytes"
            if got.block_checks is not None:
                got.block_checks.verify_rows(pick)
        finally:
            if sidecar is not None:
                sidecar.write_bytes(good)


# -- Hugging Face configs ----------------------------------------------------------------------
#: the keys the specs and hashers read (spec/hf.py), edited more often than the rest
_CONFIG_KEYS = [
    "ple_layer_ids",
    "vocab_size",
    "eos_token_id",
    "ngram_size",
    "heads_per_ngram",
    "ple_embed_dim",
    "hidden_size",
    "split_ngram_parts",
    "ngram_vocab_size_base",
    "seed",
    "make_ngram_vocab_size_divisible_by",
    "ple_embedding_dtype",
    "quantization_config",
    "quant_method",
    "quant_algo",
    "ignore",
    "quantized_layers",
    "engram_layer_ids",
    "engram_compressed_vocab_size",
    "engram_pad_token_id",
    "engram_max_ngram_size",
    "engram_n_heads",
    "engram_vocab_size",
    "engram_num_embeddings",
    "engram_head_dim",
    "num_hidden_layers",
    "hidden_size_per_layer_input",
    "vocab_size_per_layer_input",
    "text_config",
]


class ConfigTarget(Target):
    """Every key the specs read, in each preset family; accepted configs are hashed too."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        from plestore.spec import preset_config

        self.configs = [
            preset_config("qwen3.8-flash-next", "nvfp4", ngram_vocab_size_base=1000),
            preset_config("qwen3.8-flash-next", "bf16", ngram_vocab_size_base=1000),
            preset_config("deepseek-v4.1-flash", ngram_vocab_size_base=500),
            preset_config("gemma3n-e2b", ngram_vocab_size_base=300),
        ]
        self.configs[0]["text_config"]["ple_layer_ids"] = [2, 5]
        self.path = root / "config.json"

    def case(self, rng) -> Case:
        m = Mutator(rng)
        cfg = self.configs[int(rng.integers(len(self.configs)))]
        if rng.random() < 0.1:
            return Case("bytes", m.bytes_edit(json.dumps(cfg).encode()))
        doc = json.loads(json.dumps(cfg))
        where = []
        for _ in range(int(rng.integers(1, 3))):
            text = doc.get("text_config") if isinstance(doc.get("text_config"), dict) else doc
            key = m.pick(_CONFIG_KEYS)
            if rng.random() < 0.6 and key in text:
                text[key] = m.value(text[key])
                where.append(key)
            else:
                doc, w = m.tree(doc)
                where += w
        return Case("config", doc, where)

    def run(self, case: Case) -> None:
        from plestore.hashing import EngramHash, IdentityHash, Qwen4ExpHash
        from plestore.spec import EngramHashSpec, Qwen4ExpHashSpec, table_specs_from_hf_config

        if case.kind == "bytes":
            self.path.write_bytes(case.data)
            cfg: Any = self.path
        else:
            cfg = case.data
        specs = table_specs_from_hf_config(cfg)
        for s in specs:
            s.to_dict()
            _ = s.row_bytes
        h = specs[0].hash
        tokens = np.array([0, 1, 2], np.int64)
        if isinstance(h, Qwen4ExpHashSpec):
            hasher = Qwen4ExpHash.from_spec(h)
            hasher.row_ids(tokens % h.vocab_size, [0, 3], hasher.fresh_context(1))
        elif isinstance(h, EngramHashSpec):
            hasher = EngramHash.from_spec(h)
            hasher.row_ids(tokens % h.compressed_vocab_size, [0, 3], hasher.fresh_state(1))
        else:
            IdentityHash.from_spec(h)


# -- token maps --------------------------------------------------------------------------------
class TokenMapTarget(Target):
    """Engram token maps as .npy (dtype, shape, header bytes) and .json (document fields)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.map = np.arange(50, dtype=np.int64) % 40
        buf = io.BytesIO()
        np.save(buf, self.map, allow_pickle=False)
        self.npy = buf.getvalue()
        self.doc = {"kind": "engram_token_map", "compressed_vocab_size": 40, "token_map": []}
        self.doc["token_map"] = self.map.tolist()

    def case(self, rng) -> Case:
        m = Mutator(rng)
        kind = int(rng.integers(4))
        if kind == 0:
            return Case("npy", m.bytes_edit(self.npy))
        if kind == 1:
            arrays = [
                self.map.astype(np.float32),
                self.map.reshape(5, 10),
                self.map[:0],
                -self.map,
                self.map.astype(np.uint64) + np.uint64(2**63),
                np.array(["a", "b"]),
                self.map.astype(bool),
                np.array(7),
            ]
            buf = io.BytesIO()
            np.save(buf, m.pick(arrays), allow_pickle=False)
            return Case("npy", buf.getvalue(), "array")
        if kind == 2:
            doc, where = m.tree(self.doc)
            return Case("json", json.dumps(doc).encode(), where)
        return Case("json", m.bytes_edit(json.dumps(self.doc).encode()))

    def run(self, case: Case) -> None:
        from plestore.hashing.token_map import load_token_map

        path = self.root / f"map.{case.kind}"
        path.write_bytes(case.data)
        load_token_map(path, 40 if case.where is not None else None)


# -- CLI arguments -----------------------------------------------------------------------------
class CliTarget(Target):
    """Argument lists for the commands that read files and numbers (inspect, inspect-config,
    verify, hash, formats): every run ends in an exit status, never a traceback."""

    clear = (SystemExit,)

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.tables = small_tables(root)
        from plestore.spec import preset_config

        cfg = root / "config.json"
        cfg.write_text(json.dumps(preset_config("qwen3.8-flash-next", ngram_vocab_size_base=9)))
        bad = root / "bad.json"
        bad.write_text('{"plestore_table": 1, "spec": 3}')
        tmap = root / "map.npy"
        np.save(tmap, np.arange(10, dtype=np.int64))
        q = self.tables[0][0]
        self.paths = [
            str(q.meta_path.parent),
            str(q.meta_path),
            str(q.data_path),
            str(cfg),
            str(bad),
            str(root / "missing"),
            str(root),
            "/dev/null",
            str(tmap),
        ]
        self.numbers = ["0", "-1", "1", "3", "1e9", "abc", "", "99999999999999999999", "2,3"]
        self.tokens = ["1,2,3", "", ",", "1,,2", "-5", "99999999999", "a,b", "1" * 40, "0"]

    def case(self, rng) -> Case:
        m = Mutator(rng)
        cmd = m.pick(["inspect", "inspect-config", "verify", "hash", "formats"])
        argv = [cmd]
        path, num, tok = (
            (lambda: m.pick(self.paths)),
            (lambda: m.pick(self.numbers)),
            (lambda: m.pick(self.tokens)),
        )
        if cmd == "inspect":
            argv += [path()] + (["--json"] if rng.random() < 0.5 else [])
        elif cmd == "inspect-config":
            if rng.random() < 0.5:
                argv += [path()]
            else:
                argv += ["--preset", m.pick(["qwen3.8-flash-next", "deepseek-v4.1-flash", "x"])]
            if rng.random() < 0.4:
                argv += ["--format", m.pick(["nvfp4", "bf16", "fp8_ue8m0", "zz", ""])]
        elif cmd == "verify":
            argv += [path(), "--no-progress"]
            if rng.random() < 0.5:
                argv += ["--threads", m.pick(["1", "2", "0", "-3", "x"])]
            if rng.random() < 0.3:
                argv += ["--table", m.pick(["ple.layers.1", "nope", ""])]
        elif cmd == "hash":
            if rng.random() < 0.5:
                argv += ["--config", path()]
            else:
                argv += ["--preset", m.pick(["qwen3.8-flash-next", "gemma3n-e2b"])]
            argv += ["--tokens", tok()]
            for flag, make in (("--context", tok), ("--layer", num), ("--position", num)):
                if rng.random() < 0.3:
                    argv += [flag, make()]
            if rng.random() < 0.2:
                argv += ["--token-map", path()]
        else:
            for _ in range(int(rng.integers(3))):
                argv += ["--dim", m.pick(self.numbers + ["160", "4096", "1000000"])]
        if rng.random() < 0.3:
            argv.insert(int(rng.integers(1, len(argv) + 1)), m.pick(["--json", "--bogus", "-"]))
        return Case("argv", argv)

    def run(self, case: Case) -> None:
        from plestore.cli import main

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            code = main(list(case.data))
        if not isinstance(code, int):
            raise TypeError(f"exit status {code!r} is not an int")


TARGETS: dict[str, type[Target]] = {
    "safetensors": SafetensorsTarget,
    "table-meta": TableMetaTarget,
    "hf-config": ConfigTarget,
    "token-map": TokenMapTarget,
    "cli": CliTarget,
}
