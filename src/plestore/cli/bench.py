"""`plestore bench`: every known method side by side with the machine's limits.

plestore bench lookup TABLE_DIR          methods x workloads, warm/cold, vs disk/PCIe floors
plestore bench e2e TABLE_DIR             reference-decoder step time per tier / resident
plestore bench all --workdir W           synth + pack a table, then limits, lookup and e2e
plestore bench hash ... | pack ...       the hashing and full-size pack benchmarks
plestore bench footprint TABLE_DIR       disk bytes per decode token per tier, mapped Rss
plestore bench transformers --model M    stock transformers vs plestore tiers (Gemma, Qwen4Exp)
plestore bench shared TABLE_DIR          N processes: host memory (PSS), lookups, private vs shared
plestore bench hitrate --text STREAM     GPU row cache hit rate vs size (simulated, 320 M rows)
plestore bench vllm TABLE_DIR            a decode step's PLE or Engram lookups in vLLM, per tier
plestore bench hoststep [TABLE_DIR]      a graph feed's host step per tier vs a DRAM gather
plestore bench sglang TABLE_DIR          SGLang's pinned and file backends beside plestore's tiers

The fuzzer and the soak are test tools: tests/fuzz.py and tests/soak.py (CONTRIBUTING.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from plestore.cli.output import add_json_flag, format_table, print_json
from plestore.options import parse_bytes

#: `plestore bench NAME` -> plestore.bench module with its own argument parser
OWN_PARSERS = {
    "hash": "hashing",
    "pack": "pack",
    "footprint": "footprint",
    "transformers": "transformers",
    "shared": "shared",
    "hitrate": "hitrate",
    "vllm": "vllm_step",
    "hoststep": "hoststep",
    "sglang": "sglang",
}

#: what `plestore bench` leaves when interrupted (Ctrl-C; see plestore.cli.main)
INTERRUPTED = "the benchmark did not finish; results it appends at its end were not written"

_METHODS_HELP = (
    "comma-separated (default: all available); plestore-<tier>:<option>=<value>,... opens a "
    "tier with table options: plestore-direct:native=off is the numpy reference host core, to run "
    "beside plestore-direct (the native core where built)"
)


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark every method against the machine's limits",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keep the usage lines apart
    )
    bs = p.add_subparsers(dest="bench_command", metavar="BENCH")
    lk = bs.add_parser("lookup", help="lookup latency per method and workload, warm and cold")
    lk.add_argument("table", help="a packed table (directory or .json)")
    _lookup_args(lk)
    e2e = bs.add_parser("e2e", help="decoder step time per tier, relative to the resident table")
    e2e.add_argument("table", help="a packed Qwen4Exp table (directory)")
    _e2e_args(e2e)
    al = bs.add_parser("all", help="synth + pack a table at a given scale, then lookup and e2e")
    al.add_argument("--workdir", default="bench-work", help="where the table is built")
    al.add_argument("--format", default="nvfp4", choices=["nvfp4", "fp8_e4m3", "bf16"])
    al.add_argument("--ngram-vocab-size-base", type=int, help="table scale (20000000 = real)")
    al.add_argument("--block-bytes", type=int, default=4096, choices=[4096, 512])
    al.add_argument("--skip-e2e", action="store_true")
    _lookup_args(al)
    _e2e_args(al)
    for name in OWN_PARSERS:
        bs.add_parser(name, help=f"the {name} benchmark (plestore bench {name} --help)")
    for q in (lk, e2e, al):
        add_json_flag(q)
        q.add_argument("--device", help="cuda or cpu (default: cuda if available)")
        q.add_argument("--csv", default="benchmarks/bench.csv", help="append rows here ('' off)")
    p.set_defaults(func=run)


def _lookup_args(p) -> None:
    p.add_argument("--methods", help=_METHODS_HELP)
    p.add_argument(
        "--workloads", default="decode-b1,decode-b8,decode-b64,prefill-2048,prefill-4096"
    )
    p.add_argument(
        "--dists", default="uniform,zipf", help="row id distributions (text: needs --text)"
    )
    p.add_argument("--reps", type=int, default=20, help="warm repetitions (median)")
    p.add_argument(
        "--cold",
        default="decode-b1,decode-b64,prefill-4096",
        help="workloads timed cold (fresh process, file evicted, uniform ids); '' for none",
    )
    p.add_argument("--plot", default="benchmarks/lookup.png", help="PNG path ('' off)")
    p.add_argument(
        "--verify-reads",
        action="store_true",
        help="run every plestore tier a second time with verify_reads (per-block CRC-32 checks) "
        "beside it: the cost of integrity on read",
    )
    _text_arg(p)


def _text_arg(p) -> None:
    if not any(a.dest == "text" for a in p._actions):  # (bench all takes both argument sets)
        p.add_argument(
            "--text",
            help="a token stream (plestore text): lookup's text distribution, e2e's prompts",
        )


def _e2e_args(p) -> None:
    p.add_argument(
        "--tiers",
        default="device,pinned,mapped,direct",
        help="tiers, or variants with table options: e.g. direct:native=off (the Python host "
        "path beside the native core's)",
    )
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--caches", default="warm,cold", help="warm, cold (storage tiers) or both")
    # measured: RESULTS.md "e2e: host gathers"
    p.add_argument(
        "--hidden-size",
        type=int,
        default=None,
        help="decoder width (default: 6144 on a GPU, the width whose batch-64 decode step "
        "passes the 5 ms #6 asks for; 256 on a CPU)",
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument(
        "--gpu-caches",
        default="",
        help="also run each host tier behind a GPU row cache of these sizes, e.g. 1G,4G",
    )
    _text_arg(p)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--e2e-reps", type=int, default=5, help="interleaved repetitions (median ratio)")
    p.add_argument("--e2e-plot", default="", help="PNG path of the ratios ('' off)")
    p.add_argument(
        "--text-split",
        type=float,
        help="prompts only from the documents `plestore profile --split` with this share left "
        "unseen (the GPU cache's static set then meets text it was not profiled on)",
    )
    p.add_argument("--prefill-chunk", type=int, default=128, help="prompt tokens per step")
    p.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="launch every step's kernels one by one (decode and prefill) instead of replaying "
        "CUDA graphs",
    )


def run(args) -> int:
    cmd = args.bench_command  # (hash and pack are dispatched in cli.main: own argument parsers)
    if cmd is None:
        raise ValueError(f"choose a benchmark: lookup, e2e, all, {', '.join(OWN_PARSERS)} (--help)")
    import torch

    from plestore.bench.report import machine

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    result: dict = {"machine": machine()}
    table = args.table if cmd != "all" else _build(args, log)
    if cmd in ("lookup", "all"):
        result.update(_lookup(args, table, device, log, result["machine"]))
    if cmd == "e2e" or (cmd == "all" and not args.skip_e2e):
        result["e2e"] = _e2e(args, table, device, log, result["machine"])
    if args.json:
        print_json(result)
    return 0


def _build(args, log) -> str:
    from plestore.checkpoint import synth_checkpoint
    from plestore.tablefile.pack import pack_checkpoint

    work = Path(args.workdir)
    ckpt, tables = work / "checkpoint", work / "tables"
    if not (tables / "ple.layers.1.json").exists():
        synth_checkpoint(
            ckpt,
            "qwen3.8-flash-next",
            args.format,
            ngram_vocab_size_base=args.ngram_vocab_size_base,
            overwrite=True,
            hidden_size=64,
            progress=not args.json,
        )
        rep = pack_checkpoint(ckpt, tables, block_bytes=args.block_bytes, progress=not args.json)
        log(f"packed {rep.bytes_written / 2**30:.2f} GiB in {rep.seconds:.1f} s")
    return str(tables)


def _lookup(args, table, device, log, meta) -> dict:
    from plestore.bench import limits as lim
    from plestore.bench.lookup import run_lookup_bench
    from plestore.bench.methods import METHODS, split_labels
    from plestore.bench.report import append_csv, plot_lookup
    from plestore.tablefile import TableFile

    tf = TableFile.open(table)
    limits = lim.disk_limits(str(tf.data_path))
    if device.type == "cuda":
        limits["h2d_gbs"] = lim.h2d_bandwidth()
        limits["hbm_gather_65536_ms"] = lim.hbm_gather_s(65536, tf.layout.row_bytes) * 1e3
    log(
        "limits: " + json.dumps({k: round(v, 2) for k, v in limits.items() if isinstance(v, float)})
    )
    methods = split_labels(args.methods) if args.methods else list(METHODS)
    if device.type != "cuda":
        methods = [m for m in methods if m != "pinned-uva"] if not args.methods else methods
    dists = args.dists.split(",")
    if args.text and "text" not in dists:
        dists.append("text")
    if getattr(args, "verify_reads", False):
        methods = [v for m in methods for v in _with_verify(m)]
    rows = run_lookup_bench(
        table,
        methods,
        args.workloads.split(","),
        dists,
        device,
        limits,
        args.reps,
        tuple(filter(None, args.cold.split(","))),
        log,
        text=args.text,
    )
    rows = [asdict(r) for r in rows]
    _print_lookup(rows, log)
    scale = f"{tf.spec.rows:,} rows x {tf.layout.row_bytes} B ({tf.data_bytes / 2**30:.1f} GiB)"
    if args.csv:
        append_csv(args.csv, rows, {**meta, "bench": "lookup", "table": scale})
    if args.plot and rows:
        plot_lookup(rows, args.plot, f"{meta['gpu'] or meta['cpu']} — {scale} — {meta['date']}")
    return {"limits": limits, "table": scale, "lookup": rows}


def _with_verify(method: str) -> list[str]:
    """A plestore tier and, beside it, the same tier with verify_reads."""
    if not method.startswith("plestore-"):
        return [method]
    return [method, method + ("," if ":" in method else ":") + "verify_reads=true"]


def _print_lookup(rows: list[dict], log) -> None:
    def f(v):
        return "-" if v is None else f"{v:.3f}"

    table = [
        [
            r["method"],
            r["workload"],
            r["dist"],
            r["rows"],
            r["unique"],
            f(r["warm_ms"]),
            f(r["cold_ms"]),
            f(r["pcie_floor_ms"]),
            f(r["disk_floor_ms"]),
            f(r.get("read_ms")),
            "✓" if r["exact"] else "✗",
        ]
        for r in rows
    ]
    log(
        format_table(
            [
                "method",
                "workload",
                "ids",
                "rows",
                "unique",
                "warm ms",
                "cold ms",
                "PCIe floor ms",
                "disk floor ms",
                "read ms",
                "exact",
            ],
            table,
        )
    )


def _e2e(args, table, device, log, meta) -> list[dict]:
    from plestore.bench.e2e import run_e2e
    from plestore.bench.methods import split_labels
    from plestore.bench.report import append_csv

    if args.text_split is not None and not (args.text and 0 < args.text_split < 1):
        raise ValueError("--text-split takes a share in (0, 1) of a --text stream's documents")

    hidden = args.hidden_size or (6144 if device.type == "cuda" else 256)
    rows = run_e2e(
        table,
        split_labels(args.tiers),
        [int(b) for b in args.batches.split(",")],
        device,
        hidden,
        args.layers,
        args.prompt_tokens,
        args.decode_steps,
        args.e2e_reps,
        args.prefill_chunk,
        not args.no_cuda_graphs,
        args.caches.split(","),
        log,
        [parse_bytes(c) for c in filter(None, args.gpu_caches.split(","))],
        args.text,
        args.text_split,
    )
    rows = [asdict(r) for r in rows]
    log(
        format_table(
            [
                "tier",
                "batch",
                "cache",
                "prefill ms/step (first)",
                "decode ms/step",
                "prefill ratio",
                "decode ratio",
                "exposed ms prefill/decode",
                "decode window / host ms",
                "disk bound prefill/decode",
                "GPU cache hits prefill/decode",
                "tokens = resident",
            ],
            [
                [
                    r["tier"],
                    r["batch"],
                    r["cache"],
                    f"{r['prefill_step_ms']:.2f} ({r['prefill_first_ms']:.2f})",
                    f"{r['decode_step_ms']:.2f}",
                    f"{r['prefill_ratio']:.3f}",
                    f"{r['decode_ratio']:.3f}",
                    f"{r['exposed_prefill_ms']:.2f} / {r['exposed_decode_ms']:.3f}",
                    f"{r['window_decode_ms']:.3f} / {r['host_decode_ms']:.3f}",
                    _bound(r),
                    f"{r['gpu_cache_hit_prefill']:.3f} / {r['gpu_cache_hit_decode']:.3f}",
                    "✓" if r["tokens_equal_resident"] else "✗",
                ]
                for r in rows
            ],
        )
    )
    if args.csv:
        meta = {
            **meta,
            "bench": "e2e",
            "hidden": hidden,
            "layers": args.layers,
            "prompt_tokens": args.prompt_tokens,
            "cuda_graphs": not args.no_cuda_graphs,
        }
        append_csv(args.csv, rows, meta)
    if args.e2e_plot:
        from plestore.bench.report import plot_e2e

        title = f"bench e2e, {meta.get('gpu') or device.type}, {meta.get('commit') or ''}"
        if not plot_e2e(rows, args.e2e_plot, title):
            log("e2e: no plot (matplotlib is not installed)")
    return rows


def _bound(row: dict) -> str:
    """A cold row's disk bound on its ratios (see bench.e2e), '-' where there is none."""
    b = [row.get(f"bound_{p}_ratio") for p in ("prefill", "decode")]
    return " / ".join("-" if x is None else f"{x:.3f}" for x in b)
