"""`plestore hash`: the row ids a few tokens get — the tool for debugging an id mismatch.

Prints, per token and head, the row id the model's hash gives (and the context to carry into
the next step), straight from a Hugging Face config.json or a preset.
"""

from __future__ import annotations

import argparse

import numpy as np

from plestore.cli.output import add_json_flag, format_table, print_json
from plestore.spec import (
    PRESETS,
    EngramHashSpec,
    IdentityHashSpec,
    Qwen4ExpHashSpec,
    preset_config,
    table_specs_from_hf_config,
)

#: what `plestore hash` leaves when interrupted (Ctrl-C; see plestore.cli.main)
INTERRUPTED = "nothing was changed"


def register(sub) -> None:
    p = sub.add_parser(
        "hash",
        help="show the row ids some tokens hash to",
        description="Hash token ids the way the model does (Qwen4Exp PLE n-grams, DeepSeek "
        "Engram n-grams, Gemma identity) and print the row id of every token and head, plus "
        "the context to carry into the next chunk.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  plestore hash --preset qwen3.8-flash-next --tokens 9707,11,1879\n"
        "  plestore hash --config config.json --tokens 1879 --context 9707,11 --json",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="path to a Hugging Face config.json (or its directory)")
    src.add_argument("--preset", choices=sorted(PRESETS), help="a built-in model preset")
    p.add_argument("--tokens", required=True, type=_ids, help="token ids, e.g. 9707,11,1879")
    p.add_argument(
        "--context",
        type=_ids,
        default=[],
        help="the tokens before --tokens, oldest first (default: none, a fresh request; "
        "Qwen4Exp pads a short context with EOS as a fresh request would)",
    )
    p.add_argument(
        "--layer",
        type=int,
        help="Qwen4Exp: dense PLE index (0 = first of ple_layer_ids, the default); Engram: "
        "an id of engram_layer_ids (default: all)",
    )
    p.add_argument(
        "--token-map",
        help="Engram: compressed token map (.npy or .json); without it the ids given are "
        "taken to be compressed ids",
    )
    p.add_argument(
        "--position",
        type=int,
        help="Engram: position of the first of --tokens (default: len(--context))",
    )
    add_json_flag(p)
    p.set_defaults(func=run)


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        msg = f"expected comma-separated integers, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


def run(args) -> int:
    cfg = preset_config(args.preset) if args.preset else args.config
    spec = table_specs_from_hf_config(cfg, format="bf16")[0].hash
    if not args.tokens:
        raise ValueError("--tokens is empty")
    if isinstance(spec, Qwen4ExpHashSpec):
        out = _qwen(cfg, args)
    elif isinstance(spec, EngramHashSpec):
        out = _engram(cfg, args)
    elif isinstance(spec, IdentityHashSpec):
        out = _identity(spec, args)
    else:  # pragma: no cover - table_specs_from_hf_config knows no other kinds
        raise ValueError(f"no hasher for {type(spec).__name__}")
    blocks = out.pop("blocks")
    if args.json:
        print_json(out)
        return 0
    for key in ("hash", "multipliers", "note", "context", "lookback"):
        if key in out:
            print(f"{key}: {out[key]}")
    for block in blocks:
        print(block)
    for key in ("next_context", "next_lookback"):
        if key in out:
            print(f"{key}: {','.join(str(x) for x in out[key])}")
    return 0


# The hashes import torch: imported where used, so registering this command stays light.


def _qwen(cfg, args) -> dict:
    from plestore.hashing import Qwen4ExpHash

    h = Qwen4ExpHash.from_hf_config(cfg, layer_index=args.layer or 0)
    c = h.context_width
    ctx = ([h.eos_token_id] * c + list(args.context))[-c:]
    ids, nxt = h.row_ids(np.array(args.tokens), np.array([0, len(args.tokens)]), np.array([ctx]))
    heads = [f"{k}g.{j}" for k in range(2, h.ngram_size + 1) for j in range(h.heads_per_ngram)]
    return {
        "hash": repr(h),
        "multipliers": list(h.multipliers),
        "context": ctx,
        "tokens": args.tokens,
        "row_ids": ids.tolist(),
        "next_context": nxt[0].tolist(),
        "heads": [
            {"name": n, "offset": o, "size": s}
            for n, o, s in zip(heads, h.head_offsets, h.head_sizes, strict=True)
        ],
        "blocks": [_table(heads, args.tokens, ids)],
    }


def _engram(cfg, args) -> dict:
    from plestore.hashing import EngramHash, load_token_map

    tmap = load_token_map(args.token_map) if args.token_map else None
    layers = None if args.layer is None else [args.layer]
    h = EngramHash.from_hf_config(cfg, token_map=tmap, layers=layers)
    w, k = h.max_ngram_size - 1, len(args.tokens)
    start = len(args.context) if args.position is None else args.position
    lookback = (list(args.context)[::-1] + [-1] * w)[:w]  # newest first, -1 = unknown
    ids = h.row_ids(
        np.array(args.tokens),
        np.array([0, k]),
        np.array([lookback]),
        positions=np.arange(start, start + k),
    )
    nxt, _ = h.next_lookback(np.array(args.tokens), np.array([0, k]), np.array([lookback]))
    cols = [f"{o}g.{j}" for o in range(2, h.max_ngram_size + 1) for j in range(h.n_heads)]
    blocks = []
    for li, lid in enumerate(h.layers):
        blocks.append(f"layer {lid}:\n" + _table(cols, args.tokens, ids[:, li]))
    out = {
        "hash": repr(h),
        "multipliers": [list(m) for m in h.multipliers],
        "layers": list(h.layers),
        "tokens": args.tokens,
        "positions": list(range(start, start + k)),
        "lookback": lookback,
        "row_ids": ids.tolist(),
        "next_lookback": nxt[0].tolist(),
        "blocks": blocks,
    }
    if tmap is None:
        out["note"] = "no --token-map: the token ids are taken to be compressed ids"
    else:
        out["compressed_ids"] = tmap[np.array(args.tokens)].tolist()
    return out


def _identity(spec: IdentityHashSpec, args) -> dict:
    from plestore.hashing import IdentityHash

    h = IdentityHash.from_spec(spec)
    ids = h.row_ids(np.array(args.tokens))
    return {
        "hash": repr(h),
        "tokens": args.tokens,
        "row_ids": ids.tolist(),
        "blocks": [_table(["row"], args.tokens, ids[:, None])],
    }


def _table(heads: list[str], tokens: list[int], ids: np.ndarray) -> str:
    """One line per token, one column per head; plain digits (no separators), so ids can be
    copied and grepped."""
    rows = [
        [str(i), str(t), *(str(x) for x in r)]
        for i, (t, r) in enumerate(zip(tokens, ids.tolist(), strict=True))
    ]
    return format_table(["i", "token", *heads], rows)
