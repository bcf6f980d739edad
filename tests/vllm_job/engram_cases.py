"""Inputs of tests/vllm_job/test_engram_vllm.py, made once for both sides: a byte-level tokenizer
whose pad token compresses to another id, Engram configs, ragged batches in the layout vLLM's
runner passes (with plestore's EngramState carrying the lookback between chunks), and
checkpoints of fp8 e4m3 rows + ue8m0 scales (plestore's synthetic Engram tensor names,
small)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from plestore.hashing import EngramHash

PAD = 2  # engram_pad_token_id, a tokenizer id
NAN_CODES = (0x7F, 0xFF)  # e4m3fn NaN: Triton's interpreter decodes them as +-480
#: fp32 products e4m3 * 2^(b-127) are subnormal for scale bytes 1..9, which the interpreter's
#: fp32 -> bf16 conversion mangles (a GPU converts them exactly): the rows test uses the rest.
SCALE_BYTES = np.array([0, *range(10, 256)], dtype=np.uint8)
PAIR_ROWS = len(SCALE_BYTES) * 8 * 32 // 64  # rows of 64 values holding every (code, scale)


def write_tokenizer(path: Path) -> Path:
    """A WordLevel byte-level tokenizer (GPT-2 alphabet, every byte a token: the bytes >= 0x80
    decode to U+FFFD) plus words that compress together: case, accents, NFKC, whitespace runs,
    a lone space, a lone combining accent. Token 2 (" hello") compresses to 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    def bl(text: str) -> str:
        split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return "".join(p for p, _ in split.pre_tokenize_str(text))

    words = ["hello", "Hello", " hello", "Héllo", " ", "  ", "\n", " \t ", "\ufb01", "fi"]
    words += ["\u0301", " World ", "world", "THE", "the", " The", "Ünïcödé", "unicode"]
    pieces = [bl(w) for w in words]
    pieces += [c for c in sorted(pre_tokenizers.ByteLevel.alphabet()) if c not in pieces]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token=pieces[0]))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|EOS|>"])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    return path


def engram_config(layer_ids, max_ngram, n_heads, vocab, compressed, head_dim) -> dict:
    """A DeepSeek-V4.1-style config; engram_num_embeddings = each layer's sum of primes."""
    rows = EngramHash(layer_ids, compressed, PAD, max_ngram, n_heads, vocab).rows_per_layer
    return {
        "engram_layer_ids": list(layer_ids),
        "engram_num_embeddings": list(rows),
        "engram_max_ngram_size": max_ngram,
        "engram_n_heads": n_heads,
        "engram_head_dim": head_dim,
        "engram_vocab_size": vocab,
        "engram_compressed_vocab_size": compressed,
        "engram_pad_token_id": PAD,
    }


# -- batches -----------------------------------------------------------------------------------


def batch(requests: list[dict], depth: int) -> dict:
    """vLLM's hash inputs for requests {tokens, start, dead, lookback, lookback_dead}
    (lookback newest first, -1 unknown): input_ids int32 [T], positions int64 [T],
    query_start_loc int32 [R+1], dead_mask [T], lookback_token_ids int32 [R, depth]."""
    lens = [len(r["tokens"]) for r in requests]
    cat = [x for r in requests for x in r["tokens"]]

    def lookback(key, fill):
        rows = [list(r.get(key, []))[:depth] for r in requests]
        return [row + [fill] * (depth - len(row)) for row in rows]

    return {
        "input_ids": torch.tensor(cat, dtype=torch.int32),
        "positions": torch.tensor(
            [r["start"] + i for r in requests for i in range(len(r["tokens"]))], dtype=torch.int64
        ),
        "query_start_loc": torch.tensor(np.cumsum([0, *lens]), dtype=torch.int32),
        "dead_mask": torch.tensor([bool(x) for r in requests for x in r["dead"]], dtype=torch.bool),
        "lookback_token_ids": torch.tensor(lookback("lookback", -1), dtype=torch.int32),
        "lookback_dead_mask": torch.tensor(lookback("lookback_dead", False), dtype=torch.bool),
    }


def ragged_requests(rng: np.random.Generator, vocab: int) -> list[dict]:
    """A fresh prefill with a DEAD span, a 33-token chunk (crosses vLLM's 32-token tile), a
    decode step after a DEAD token, an empty request, a decode step whose window reaches before
    position 0, and a chunk whose lookback is partly unknown (-1)."""

    def toks(n):
        return rng.integers(0, vocab, n).tolist()

    def dead(n, span=()):
        return [i in span for i in range(n)]

    return [
        {"tokens": toks(9), "start": 0, "dead": dead(9, range(3, 6))},
        {"tokens": toks(33), "start": 40, "dead": dead(33, (30,)), "lookback": toks(3)},
        {
            "tokens": toks(1),
            "start": 100,
            "dead": [False],
            "lookback": toks(3),
            "lookback_dead": [False, True, False],
        },
        {"tokens": [], "start": 7, "dead": [], "lookback": toks(3)},
        {"tokens": toks(1), "start": 2, "dead": [False], "lookback": toks(2)},
        {
            "tokens": toks(27),
            "start": 5,
            "dead": dead(27, (0,)),
            "lookback": [toks(1)[0], -1, toks(1)[0]],
        },
    ]


def plestore_ids(h: EngramHash, b: dict) -> np.ndarray:
    """plestore's ids [T, layers, cols] of one batch."""
    a = {k: v.numpy() for k, v in b.items()}
    return h.row_ids(
        a["input_ids"],
        a["query_start_loc"],
        a["lookback_token_ids"],
        a["dead_mask"],
        a["lookback_dead_mask"],
        a["positions"],
    )


def chunked_steps(h: EngramHash, streams: list[dict], schedules: list[list[int]]) -> list[dict]:
    """Engine steps over whole requests {tokens, dead}: step i takes schedules[r][i] tokens of
    request r (1 = a decode step), the lookback coming from plestore's EngramState. Each step
    holds vLLM's inputs and plestore's ids [T, layers, cols] ("ids")."""
    state, done, steps = h.fresh_state(len(streams)), [0] * len(streams), []
    for i in range(len(schedules[0])):
        reqs = []
        for r, s in enumerate(streams):
            n, a = schedules[r][i], done[r]
            lb, lbd = state.lookback_token_ids[r], state.lookback_dead_mask[r]
            part = {k: s[k][a : a + n] for k in ("tokens", "dead")}
            reqs.append(
                {**part, "start": a, "lookback": lb.tolist(), "lookback_dead": lbd.tolist()}
            )
            done[r] += n
        b = batch(reqs, h.max_ngram_size - 1)
        dead = b["dead_mask"].numpy()
        ids, state = h.step(
            b["input_ids"].numpy(), b["query_start_loc"].numpy(), state, dead_mask=dead
        )
        b["ids"] = ids.reshape(len(ids), len(h.layers), h.columns)
        steps.append(b)
    return steps


def slot_cache_steps(steps: list[dict], block_tables: list[list[int]], block: int) -> list[dict]:
    """The same steps as vLLM's V1 runner passes them: no lookback ids (all -1: the history
    comes from its per-KV-slot cache), plus slot_mapping and block_table."""
    table = torch.tensor(block_tables, dtype=torch.int32)
    out = []
    for b in steps:
        qsl = b["query_start_loc"].tolist()
        req = np.searchsorted(qsl[1:], np.arange(len(b["input_ids"])), side="right")
        pos = b["positions"].numpy()
        slots = table.numpy()[req, pos // block] * block + pos % block
        out.append({
            **b,
            "slot_mapping": torch.tensor(slots, dtype=torch.int64),
            "block_table": table,
            "lookback_token_ids": torch.full_like(b["lookback_token_ids"], -1),
            "lookback_dead_mask": torch.zeros_like(b["lookback_dead_mask"]),
        })  # fmt: skip
    return out


# -- checkpoints -------------------------------------------------------------------------------


def every_byte_rows(rng, rows: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows whose first PAIR_ROWS hold every e4m3 code (NaN aside) under every scale byte of
    SCALE_BYTES, 32 codes a block; the rest random bytes of the same sets."""
    codes = np.resize(np.setdiff1d(np.arange(256, dtype=np.uint8), NAN_CODES), 256)  # 8 x 32
    blocks = dim // 32
    values = rng.choice(codes, (rows, dim))
    scales = rng.choice(SCALE_BYTES, (rows, blocks))
    pairs = np.tile(codes.reshape(8, 32), (len(SCALE_BYTES), 1))  # [247*8, 32]
    values[:PAIR_ROWS] = pairs.reshape(PAIR_ROWS, dim)
    scales[:PAIR_ROWS] = np.repeat(SCALE_BYTES, 8).reshape(PAIR_ROWS, blocks)
    return values, scales


def model_rows(rng, rows: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows as a trained table holds them: |e4m3| < 448, scales 2^-10 .. 2^-3."""
    values = rng.integers(0, 256, (rows, dim), dtype=np.uint8)
    values[np.isin(values, NAN_CODES)] = 0x7E
    return values, rng.integers(117, 125, (rows, dim // 32), dtype=np.uint8)


def write_checkpoint(path: Path, config: dict, rows_fn, seed: int, layer: dict | None) -> Path:
    """config.json + model.safetensors: per Engram layer `model.layers.L.engram.embed.weight`
    (F8_E4M3) and `.weight_scale_inv` (U8), and with `layer` = {hc_mult, dim} its wkv.weight,
    q_weight and k_weight (bf16; one q/k row per stream, the first stream's q row zero so that
    its dot is exactly 0)."""
    from safetensors.torch import save_file

    rng = np.random.default_rng(seed)
    dim, cols = (
        config["engram_head_dim"],
        (config["engram_max_ngram_size"] - 1) * config["engram_n_heads"],
    )
    tensors = {}
    for lid, rows in zip(config["engram_layer_ids"], config["engram_num_embeddings"], strict=True):
        p = f"model.layers.{lid}.engram."
        values, scales = rows_fn(rng, rows, dim)
        tensors[p + "embed.weight"] = torch.from_numpy(values).view(torch.float8_e4m3fn)
        tensors[p + "embed.weight_scale_inv"] = torch.from_numpy(scales)
        if layer is not None:
            hc, d = layer["hc_mult"], layer["dim"]
            g = torch.Generator().manual_seed(seed + lid)
            wkv = torch.randn((hc + 1) * d, cols * dim, generator=g) * (cols * dim) ** -0.5
            q = 1 + 0.3 * torch.randn(hc, d, generator=g)
            q[0] = 0
            tensors[p + "wkv.weight"] = wkv.bfloat16()
            tensors[p + "q_weight"] = q.bfloat16()
            tensors[p + "k_weight"] = (1 + 0.3 * torch.randn(hc, d, generator=g)).bfloat16()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors")
    extra = {} if layer is None else {"hidden_size": layer["dim"], "hc_mult": layer["hc_mult"]}
    if layer is not None:  # DeepSeek-V4.1's class, a MoE (what vLLM's ModelConfig reads: DP
        # token metadata is kept for MoE models only)
        extra |= {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41"}
        extra |= {"n_routed_experts": 4, "num_experts_per_tok": 2}
    (path / "config.json").write_text(json.dumps({**config, **extra, "rms_norm_eps": 1e-6}))
    return path
