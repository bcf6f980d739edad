"""plestore bench transformers: stock transformers vs plestore per tier, Gemma and Qwen4Exp.

    plestore bench transformers --model gemma3n-e4b              # on the H200
    plestore bench transformers --model qwen4exp --fp8           # the real 320M-row table, FP8
    plestore bench transformers --model qwen4exp --tiny --json   # CI: CPU, seconds

Builds a random-weight model of the real transformers class on the device, the per-layer
table(s) at their real shape — Gemma: the preset's [262144, layers * 256]; Qwen4Exp: the n-gram
table of `--ngram-vocab-size-base` (20,000,000: 320,001,536 rows x 160) on a small trunk
(`--hidden-size`, `--layers`; the table does not depend on them) — then, one after the other:

  stock            greedy generate, the table resident on the device (what transformers does)
  accelerate-cpu   Qwen4Exp: stock with the tables on the CPU (what device_map does with them
                   when they do not fit: transformers then looks rows up on the CPU)
  accelerate-disk  Qwen4Exp: stock with accelerate's disk offload of the tables (hooks load
                   the whole weight per forward: --offload-tokens bounds it)
  <tier>           offload_per_layer_embeddings, then the same generate with rows from each
                   tier (device, pinned, mapped, direct), tokens checked against stock

--fp8 (Qwen4Exp): the model holds e4m3 values in bf16, as transformers loads an FP8 checkpoint,
and plestore keeps them in an fp8_e4m3 table (1 byte per value), exactly.
Decode tok/s = batch * (new_tokens - 1) / (t(generate new_tokens) - t(generate 1 token)): the
prefill is left out; the median of --repeats warm runs, p10 / p90 beside it. Peak GPU memory is
torch's max_memory_allocated over the variant's runs; host memory the process's RSS after them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

TIERS = ("pinned", "mapped", "direct", "device")  # the first one is offloaded to
GEMMA = ("gemma3n-e2b", "gemma3n-e4b", "gemma4-e2b", "gemma4-e4b")
# Gemma 3n config.json values the presets leave out (the text model's MLP and KV sharing)
_GEMMA3N = {
    "gemma3n-e2b": dict(
        intermediate_size=8192,
        num_kv_shared_layers=10,
        activation_sparsity_pattern=[0.95] * 10 + [0.0] * 20,
    ),
    "gemma3n-e4b": dict(
        intermediate_size=16384,
        num_kv_shared_layers=15,
        activation_sparsity_pattern=[0.95] * 10 + [0.0] * 25,
    ),
}


def _gemma(preset: str, tiny: bool):
    import transformers

    from plestore.spec import preset_config

    family = preset.split("-")[0]
    if tiny:
        text = dict(
            vocab_size=512,
            vocab_size_per_layer_input=512,
            hidden_size=64,
            hidden_size_per_layer_input=16,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            intermediate_size=128,
            num_kv_shared_layers=2,
            sliding_window=16,
            max_position_embeddings=256,
            layer_types=["sliding_attention", "full_attention"] * 2,
        )
        if family == "gemma3n":
            text.update(laurel_rank=8)
    else:
        cfg = preset_config(preset)
        text = {k: v for k, v in cfg["text_config"].items() if k != "model_type"}
        extra = _GEMMA3N.get(preset) or dict(intermediate_size=4 * text["hidden_size"])
        text.update(extra)
    if family == "gemma3n":
        return transformers.Gemma3nTextConfig(**text), transformers.Gemma3nForCausalLM
    return transformers.Gemma4TextConfig(**text), transformers.Gemma4ForCausalLM


def _qwen(a):
    import transformers

    hidden = 32 if a.tiny else a.hidden_size
    layers = 3 if a.tiny else a.layers
    heads = 2 if a.tiny else 16  # n-gram heads: (ngram_size - 1) * heads_per_ngram
    kind = ["linear_attention"] * (layers - 1) + ["full_attention"]  # indexed (QSA) layer
    text = dict(
        vocab_size=300 if a.tiny else 248320,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2 if a.tiny else 8,
        num_key_value_heads=1,
        head_dim=16 if a.tiny else 128,
        linear_key_head_dim=8 if a.tiny else 128,
        linear_value_head_dim=8 if a.tiny else 128,
        linear_num_key_heads=2 if a.tiny else 8,
        linear_num_value_heads=2 if a.tiny else 8,
        moe_intermediate_size=16 if a.tiny else 512,
        shared_expert_intermediate_size=16 if a.tiny else 512,
        num_experts=4 if a.tiny else 16,
        num_experts_per_tok=2 if a.tiny else 4,
        hc_count=2 if a.tiny else 4,
        hc_lowrank=8 if a.tiny else 64,
        ple_layer_ids=[2],
        ple_embed_dim=8 * heads if a.tiny else 160 * heads,  # 160 values per row, as the real
        ngram_size=3,
        heads_per_ngram=heads // 2,
        ngram_vocab_size_base=500 if a.tiny else a.ngram_vocab_size_base,
        eos_token_id=5 if a.tiny else 248044,
        pad_token_id=0,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16 if a.tiny else 128,
        indexer_budget=8 if a.tiny else 2048,
        indexer_compress_ratio=4,
        layer_types=kind,
    )
    return transformers.Qwen4ExpTextConfig(**text), transformers.Qwen4ExpForCausalLM


def build_model(a, device: torch.device):
    config, cls = _qwen(a) if a.model == "qwen4exp" else _gemma(a.model, a.tiny)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model = cls(config)
    finally:
        torch.set_default_dtype(default)
    model = model.to(torch.bfloat16).eval()
    if a.model == "qwen4exp":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("ngram_embedding.weight"):
                    p.normal_(0, 1.0)
                    step = 1 << 24  # rows at a time: no full-size temporaries
                    for i in range(0, p.shape[0] if a.fp8 else 0, step):
                        # e4m3 values in bf16: what transformers loads an FP8 table as
                        p[i : i + step] = p[i : i + step].to(torch.float8_e4m3fn).to(p.dtype)
                elif name.endswith("ple.conv1d.weight"):
                    p.normal_(0, 0.5)
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def _generate(model, ids, mask, n):
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False
    )


@torch.no_grad()
def time_decode(model, ids, mask, new_tokens: int, repeats: int, device) -> dict:
    """Median / p10 / p90 decode tok/s over `repeats` warm runs, and the generated tokens."""

    def timed(n: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        _generate(model, ids, mask, n)
        _sync(device)
        return time.perf_counter() - t0

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tokens = _generate(model, ids, mask, new_tokens)  # warm-up, and the tokens to compare
    timed(1)
    rates = []
    for _ in range(repeats):
        full, first = timed(new_tokens), timed(1)
        rates.append(ids.shape[0] * (new_tokens - 1) / max(full - first, 1e-9))
    p10, p50, p90 = np.percentile(rates, [10, 50, 90])
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {
        "tokens_per_s": float(p50),
        "p10": float(p10),
        "p90": float(p90),
        "runs": len(rates),
        "peak_gpu_bytes": peak,
        "host_rss_bytes": _rss(),
        "tokens": tokens.cpu(),
    }


def _modules(model):
    from plestore.integrations.transformers import NGramEmbedding, PerLayerEmbedding

    return [m for m in model.modules() if isinstance(m, (NGramEmbedding, PerLayerEmbedding))]


def set_tier(model, tier: str, device: torch.device, options: dict) -> None:
    """Serve the already packed tables from another tier (same files, same modules)."""
    import plestore

    for m in _modules(model):
        if m.table.tier.name != tier:
            path = str(m.table.file.meta_path)
            m.use_table(plestore.open_table(path, tier=tier, device=str(device), **options))


def _accelerate_variants(model, a, device, run) -> None:
    """Stock with its PLE tables on the CPU (transformers looks rows up there), then offloaded
    to disk by accelerate (its hook loads the weight onto the device for every forward)."""
    tables = [m.ngram_embedding for n, m in model.named_modules() if n.endswith("ple_embedding")]
    for t in tables:
        t.to("cpu")
    torch.cuda.empty_cache() if device.type == "cuda" else None
    run("accelerate-cpu", a.new_tokens)
    try:
        from accelerate.big_modeling import disk_offload
        from accelerate.hooks import remove_hook_from_module
    except ImportError as e:
        print(f"skipping accelerate-disk: {e}", file=sys.stderr)
        return
    work = Path(a.table_dir or tempfile.gettempdir())
    need = sum(t.weight.numel() * t.weight.element_size() for t in tables)
    if shutil.disk_usage(work).free < need + (1 << 30):
        print(
            f"skipping accelerate-disk: {need / 2**30:.1f} GiB do not fit {work}", file=sys.stderr
        )
        return
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        for i, t in enumerate(tables):
            disk_offload(t, f"{tmp}/{i}", execution_device=device)
        run("accelerate-disk", a.offload_tokens)
        for t in tables:
            remove_hook_from_module(t, recurse=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="plestore bench transformers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", default="gemma3n-e4b", choices=[*GEMMA, "qwen4exp"])
    ap.add_argument("--tiny", action="store_true", help="tiny config on the CPU (CI)")
    ap.add_argument("--fp8", action="store_true", help="Qwen4Exp: e4m3 table values (1 B)")
    ap.add_argument("--ngram-vocab-size-base", type=int, default=20_000_000)
    ap.add_argument("--hidden-size", type=int, default=1024, help="Qwen4Exp trunk width")
    ap.add_argument("--layers", type=int, default=4, help="Qwen4Exp trunk layers (PLE on 2)")
    ap.add_argument("--device", default=None, help="default: cuda if available (cpu if --tiny)")
    ap.add_argument("--tiers", default=",".join(TIERS), help="'' runs the stock variants only")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 64 (4 with --tiny)")
    ap.add_argument("--offload-tokens", type=int, default=None, help="accelerate-disk (4)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=None, help="default 5 (2 with --tiny)")
    ap.add_argument("--no-accelerate", action="store_true", help="skip the accelerate variants")
    ap.add_argument(
        "--table-dir", default=None, help="tables kept and reused here (default: a temp dir)"
    )
    ap.add_argument("--cache-bytes", default="1G", help="direct tier row cache")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    from plestore.bench.report import machine
    from plestore.integrations.transformers import offload_per_layer_embeddings
    from plestore.options import parse_bytes

    if a.fp8 and a.model != "qwen4exp":
        raise SystemExit("--fp8 is for --model qwen4exp")
    cuda = torch.cuda.is_available() and not a.tiny
    device = torch.device(a.device or ("cuda" if cuda else "cpu"))
    a.new_tokens = a.new_tokens or (4 if a.tiny else 64)
    a.offload_tokens = a.offload_tokens or 4
    repeats = a.repeats or (2 if a.tiny else 5)
    batches = [int(b) for b in a.batches.split(",")]
    tiers = [t for t in a.tiers.split(",") if t]
    options = {"cache_bytes": parse_bytes(a.cache_bytes)}
    log = (lambda m: print(m, file=sys.stderr)) if a.json else print
    if a.tiny:
        torch.set_num_threads(1)  # tiny bf16 matmuls: 10x faster on one thread

    t0 = time.perf_counter()
    model = build_model(a, device)
    log(f"built {a.model} on {device} in {time.perf_counter() - t0:.1f} s")
    vocab = (
        model.config.vocab_size
        if a.model == "qwen4exp"
        else model.config.vocab_size_per_layer_input
    )
    g = torch.Generator().manual_seed(1)
    prompts = {
        b: torch.randint(6, vocab, (b, a.prompt_len), generator=g).to(device) for b in batches
    }
    runs, stock_tokens = [], {}

    def run(variant: str, new_tokens: int, reps: int = repeats) -> None:
        for b in batches:
            ids = prompts[b]
            r = time_decode(model, ids, torch.ones_like(ids), new_tokens, reps, device)
            tokens = r.pop("tokens")
            if variant == "stock":
                stock_tokens[b] = tokens
            same = torch.equal(tokens, stock_tokens[b][:, : tokens.shape[1]])
            runs.append({"variant": variant, "batch": b, **r, "greedy_matches_stock": same})
            log(f"{variant:>16} b{b}: {r['tokens_per_s']:.1f} tok/s  same={same}")

    run("stock", a.new_tokens)
    report = None
    with tempfile.TemporaryDirectory() as tmp:
        if not tiers:  # only the stock variants
            tmp = None
        t0 = time.perf_counter()
        fmt = "fp8_e4m3" if a.fp8 else None
        if tmp is not None:  # --table-dir: packed once, reused by fingerprint
            report = offload_per_layer_embeddings(
                model, a.table_dir or tmp, tier=tiers[0], device=device, format=fmt, **options
            )
            log(f"offloaded in {time.perf_counter() - t0:.1f} s: {report}")
        for tier in tiers:
            try:
                set_tier(model, tier, device, options)
            except OSError as e:  # e.g. direct I/O unsupported on this filesystem
                log(f"skipping tier {tier}: {e}")
                continue
            run(tier, a.new_tokens)
            runs[-1]["table_stats"] = [m.table.stats() for m in _modules(model)]
        for m in _modules(model):
            m.close()
    if a.model == "qwen4exp" and not a.no_accelerate:
        del model
        model = build_model(a, device)  # again: offloading replaced the modules
        _accelerate_variants(
            model, a, device, lambda v, n: run(v, n, 1 if "disk" in v else repeats)
        )

    result = {
        "benchmark": "transformers",
        "model": a.model + (" (tiny)" if a.tiny else "") + (" fp8" if a.fp8 else ""),
        "device": str(device),
        "new_tokens": a.new_tokens,
        "prompt_len": a.prompt_len,
        "repeats": repeats,
        "machine": machine(),
        "table": None
        if report is None
        else {
            "rows": report.rows,
            "dim": report.dim,
            "format": report.format,
            "weight_bytes": report.weight_bytes,
            "table_bytes": report.table_bytes,
            "exact": report.exact,
            "reused": report.reused,
            "pack_seconds": report.pack_seconds,
        },
        "runs": [{k: v for k, v in r.items() if k != "table_stats"} for r in runs],
    }
    stock = {r["batch"]: r["tokens_per_s"] for r in runs if r["variant"] == "stock"}
    log(
        f"{'variant':>16} {'batch':>5} {'tok/s':>9} {'p10':>9} {'p90':>9} {'ratio':>6} "
        f"{'peak GiB':>8} {'RSS GiB':>7}  same"
    )
    for r in result["runs"]:
        r["ratio_to_stock"] = r["tokens_per_s"] / stock[r["batch"]]
        peak = "-" if r["peak_gpu_bytes"] is None else f"{r['peak_gpu_bytes'] / 2**30:.2f}"
        log(
            f"{r['variant']:>16} {r['batch']:>5} {r['tokens_per_s']:>9.1f} {r['p10']:>9.1f} "
            f"{r['p90']:>9.1f} {r['ratio_to_stock']:>6.3f} {peak:>8} "
            f"{r['host_rss_bytes'] / 2**30:>7.2f}  {r['greedy_matches_stock']}"
        )
    text = json.dumps(result, indent=1, default=str)
    if a.out:
        Path(a.out).write_text(text)
    if a.json:
        print(text)
    return 0 if all(r["greedy_matches_stock"] for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
