"""`plestore synth`: write a synthetic checkpoint of a preset (real names, dtypes, shards)."""

from __future__ import annotations

from pathlib import Path

from plestore.cli.output import add_json_flag, human_bytes, print_json
from plestore.spec import PRESETS

#: what `plestore synth` leaves when interrupted (Ctrl-C; see plestore.cli.main)
INTERRUPTED = "the checkpoint was not finished and does not open; run synth again"


def register(sub) -> None:
    p = sub.add_parser(
        "synth",
        help="write a synthetic checkpoint of a model preset",
        description="Write config.json, model.safetensors.index.json and shard files with the "
        "preset's real tensor names, dtypes and shard layout. Row values are a deterministic "
        "function of (seed, row id), so any row can be checked later without the source. The "
        "default size is a few hundred MB; --ngram-vocab-size-base 20000000 gives the real "
        "320M-row Qwen table.",
    )
    p.add_argument("out", help="output directory")
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument(
        "--format", help="table format (default: the preset's first; fp8 | nvfp4 | bf16)"
    )
    p.add_argument(
        "--ngram-vocab-size-base",
        type=int,
        metavar="N",
        help="scale: Qwen n-gram base, Engram prime base, Gemma vocab",
    )
    p.add_argument("--seed", type=int, default=0, help="row-value seed (default 0)")
    p.add_argument("--hidden-size", type=int, help="shrink the non-table weights (small tests)")
    p.add_argument("--text-only", action="store_true", help="name tensors model.layers.L...")
    p.add_argument("--files", type=int, metavar="N", help="number of shard files")
    p.add_argument("--threads", type=int, help="worker threads (default: CPUs, at most 16)")
    p.add_argument("--force", action="store_true", help="replace a checkpoint already in OUT")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from plestore.checkpoint import synth_checkpoint

    rep = synth_checkpoint(
        args.out,
        args.preset,
        args.format,
        args.ngram_vocab_size_base,
        seed=args.seed,
        hidden_size=args.hidden_size,
        text_only=args.text_only,
        num_files=args.files,
        threads=args.threads,
        overwrite=args.force,
        progress=not args.no_progress,
    )
    d = rep.to_dict()
    if args.json:
        print_json(d)
        return 0
    rate = human_bytes(d["throughput_bytes_per_s"] or 0)
    names = ("config.json", "model.safetensors.index.json")
    extra = [n for n in names if (Path(rep.out) / n).exists()]
    print(
        f"wrote {rep.out}: {len(rep.files) + len(extra)} files ({len(rep.files)} safetensors, "
        f"{', '.join(extra)}), {human_bytes(rep.bytes)} in {rep.seconds:.2f} s ({rate}/s)"
    )
    for t in rep.tables:
        print(
            f"  table {t['name']}: {t['rows']:,} rows x {t['dim']} {t['format']}, "
            f"{human_bytes(t['nbytes'])}"
        )
    return 0
