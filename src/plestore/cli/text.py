"""`plestore text`: text files -> a token-id stream (the input of `plestore profile` and the
`text` workload of `plestore bench`)."""

from __future__ import annotations

import sys

from plestore.cli.output import add_json_flag, print_json

#: what `plestore text` leaves when interrupted (Ctrl-C; see plestore.cli.main)
INTERRUPTED = "the stream was not finished; run text again"


def register(sub) -> None:
    p = sub.add_parser(
        "text",
        help="tokenize text files into a token-id stream (STREAM.npy + STREAM.json)",
        description="Read text files (plain, .gz, HTML; directories walked), tokenize each as one "
        "document with a real tokenizer file (.tiktoken ranks or a tokenizer.json), and write "
        "STREAM.npy (ids) and STREAM.json (tokenizer, sources, document starts).",
    )
    p.add_argument("stream", help="output path without suffix (STREAM.npy, STREAM.json)")
    p.add_argument("sources", nargs="+", help="text files or directories")
    p.add_argument("--tokenizer", required=True, help="a .tiktoken rank file or tokenizer.json")
    p.add_argument("--max-tokens", type=int, help="stop after this many tokens")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from plestore.bench.text import build_stream

    shown = [0]

    def progress(path: str, total: int) -> None:
        if not args.json and total - shown[0] >= 1_000_000:
            shown[0] = total
            print(f"{total:,} tokens ...", file=sys.stderr, flush=True)

    meta = build_stream(
        args.stream, args.sources, args.tokenizer, args.max_tokens, progress=progress
    )
    if args.json:
        print_json({k: v for k, v in meta.items() if k != "docs"})
    else:
        print(
            f"{args.stream}.npy: {meta['tokens']:,} tokens in {meta['documents']} documents "
            f"({meta['tokenizer']['kind']} {meta['tokenizer']['vocab_size']:,} ids)"
        )
    return 0
