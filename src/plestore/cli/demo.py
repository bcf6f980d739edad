"""`plestore demo`: synthesise, pack, and generate on every tier — the README's main job."""

from __future__ import annotations

import sys
import textwrap

from plestore.cli.output import add_json_flag, format_table, human_bytes, print_json
from plestore.options import TIER_NAMES

#: what `plestore demo` leaves when interrupted (Ctrl-C; see plestore.cli.main)
INTERRUPTED = "its checkpoint and table are reused, or rebuilt, by the next run"

TIERS = TIER_NAMES[1:]  # every tier but auto (the default: the four storage tiers)

#: what the demo's columns mean (--help, and under the table)
COLUMNS = (
    "Columns: tok/s, the median (min-max) of the timed generations; rows/token, table rows "
    "looked up a token (one per hash head); unique rows/token, distinct rows a step's lookup "
    "reads; disk/token, bytes read from the disk a token; host memory, what the tier holds in "
    "host RAM; exact, tokens and logits equal the resident (device) table's."
)


def register(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="synthesise a checkpoint, pack it, and generate on every tier",
        description="Synthesise a Qwen3.8-Flash-Next-format checkpoint (reused if present), "
        "pack its PLE (per-layer embedding) table, run the reference decoder on a few prompts "
        "with the table on each tier, and check that tokens and logits equal the resident-table "
        "run. It writes about 500 MB under --dir (checkpoint + table, reused by the next run). "
        "Every tier runs once before any is timed; each is then timed after a warm-up "
        "generation, over --repeats generations from cold storage: median (min-max).",
        epilog=COLUMNS,
    )
    p.add_argument(
        "--dir", default="plestore-demo", help="working directory (default: %(default)s)"
    )
    p.add_argument(
        "--format",
        default="fp8_e4m3",
        choices=["fp8_e4m3", "nvfp4", "bf16"],
        help="the table's row format: fp8_e4m3 (1 B a value + a table scale, the real "
        "checkpoint's), nvfp4 (4-bit values + block scales), bf16 (default: %(default)s)",
    )
    p.add_argument(
        "--tiers",
        default=",".join(TIERS[:4]),
        help="comma-separated tiers to run (default: %(default)s)",
    )
    p.add_argument("--prompts", type=int, default=3, help="number of prompts (default: 3)")
    p.add_argument(
        "--decode-tokens", type=int, default=64, help="tokens generated per prompt (default: 64)"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed generations per tier (default: 3)")
    p.add_argument("--hidden-size", type=int, help="decoder width (default: 256 CPU, 2560 GPU)")
    p.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    p.add_argument(
        "--ngram-vocab-size-base",
        type=int,
        help="scale of the synthetic table (default: a few hundred MB; 20000000 = the real size)",
    )
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from plestore.models.demo import run_demo  # torch: imported only when the demo runs

    tiers = tuple(t for t in args.tiers.split(",") if t)
    unknown = set(tiers) - set(TIERS)
    if unknown:
        raise ValueError(f"unknown tiers {sorted(unknown)}; choose from {', '.join(TIERS)}")
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    res = run_demo(
        args.dir,
        args.format,
        tiers,
        args.prompts,
        args.decode_tokens,
        args.hidden_size,
        args.device,
        args.ngram_vocab_size_base,
        progress=not args.json,
        log=log,
        repeats=args.repeats,
    )
    if args.json:
        print_json(res)
    else:
        print(
            f"\n{res['prompts']} prompts ({res['prompt_tokens']} tokens) + "
            f"{res['decode_tokens']} decode tokens each, {res['format']} table, hidden "
            f"{res['hidden_size']}, on {res['device']}; tok/s: the median of {res['repeats']} "
            "generations after a warm-up (min-max):\n"
        )
        table = [
            [
                r["tier"],
                _spread(r["prefill_tok_s"], r["prefill_tok_s_runs"], ".0f"),
                _spread(r["decode_tok_s"], r["decode_tok_s_runs"], ".1f"),
                f"{r['rows_per_token']:.1f}",
                f"{r['unique_rows_per_token']:.1f}",
                human_bytes(r["disk_bytes_per_token"]),
                human_bytes(r["host_bytes"]),
                "✓" if r["exact"] else ("✗ " + r["note"] if r["note"] else "✗"),
            ]
            for r in res["rows"]
        ]
        print(
            format_table(
                [
                    "tier",
                    "prefill tok/s",
                    "decode tok/s",
                    "rows/token",
                    "unique rows/token",
                    "disk/token",
                    "host memory",
                    "exact",
                ],
                table,
            )
        )
        print("\n" + textwrap.fill(COLUMNS, 100))
    return 0 if all(r["exact"] or r["note"] for r in res["rows"]) else 1


def _spread(median: float, runs: list[float], fmt: str) -> str:
    """'median (min-max)' of a tier's timed runs."""
    if len(runs) < 2:
        return f"{median:,{fmt}}"
    return f"{median:,{fmt}} ({min(runs):,{fmt}}-{max(runs):,{fmt}})"
