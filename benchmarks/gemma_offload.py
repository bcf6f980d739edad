"""Gemma per-layer embeddings, stock vs plestore: GPU memory and decode speed per tier.

    python benchmarks/gemma_offload.py --preset gemma3n-e4b --json out.json     # on the H200
    python benchmarks/gemma_offload.py --tiny                                   # CI: CPU, tiny

Builds a random-weight Gemma model in bf16 on the device — the per-layer table at its real
shape (plestore.spec.PRESETS: vocab 262144 x layers*256); hidden size and layer count from the
preset, the rest from transformers' config defaults (Gemma 3n: intermediate size, KV-shared layers
and activation sparsity as in E2B's / E4B's config.json; Gemma 4: intermediate 4 x hidden, an
approximation — the table, the part this measures, is exact).
Then, one after the other on the same model:

  stock            greedy generate, the table resident in HBM (what transformers does)
  offload          offload_per_layer_embeddings: memory_allocated before / after
  <tier> x batch   the same generate with rows served from each tier (device, pinned, mapped,
                   direct), tokens checked against stock

Decode tok/s = batch * (new_tokens - 1) / (t(generate new_tokens) - t(generate 1 token)), so the
prefill is left out; each point is the median of --repeats warm runs (p10/p90 alongside).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import plestore
from plestore.integrations.transformers import PerLayerEmbedding, offload_per_layer_embeddings
from plestore.options import parse_bytes
from plestore.spec import preset_config

TIERS = ("pinned", "mapped", "direct", "device")  # the first one is offloaded to
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


def build_model(preset: str, tiny: bool, device: torch.device):
    import transformers

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
        family = preset.split("-")[0]
        if family == "gemma3n":
            text.update(laurel_rank=8)
    else:
        cfg = preset_config(preset)
        family = cfg["model_type"]
        text = {k: v for k, v in cfg["text_config"].items() if k != "model_type"}
        if family == "gemma3n":
            text.update(_GEMMA3N[preset])
        else:
            text.update(intermediate_size=4 * text["hidden_size"])
    if family == "gemma3n":
        config, cls = transformers.Gemma3nTextConfig(**text), transformers.Gemma3nForCausalLM
    else:
        config, cls = transformers.Gemma4TextConfig(**text), transformers.Gemma4ForCausalLM
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model = cls(config)
    finally:
        torch.set_default_dtype(default)
    return model.to(torch.bfloat16).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _generate(model, ids, mask, new_tokens):
    return model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
    )


def time_decode(model, ids, mask, new_tokens: int, repeats: int, device) -> dict:
    """Median / p10 / p90 decode tok/s over `repeats` warm runs, and the generated tokens."""

    def timed(n: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        _generate(model, ids, mask, n)
        _sync(device)
        return time.perf_counter() - t0

    with torch.no_grad():
        tokens = _generate(model, ids, mask, new_tokens)  # warm-up (and the tokens to compare)
        timed(1)
        rates = []
        for _ in range(repeats):
            full, first = timed(new_tokens), timed(1)
            rates.append(ids.shape[0] * (new_tokens - 1) / max(full - first, 1e-9))
    p10, p50, p90 = np.percentile(rates, [10, 50, 90])
    return {"tokens_per_s": p50, "p10": p10, "p90": p90, "tokens": tokens.cpu()}


def set_tier(model, tier: str, device: torch.device, options: dict) -> None:
    """Serve the already packed table from another tier (same file, same module)."""
    module = next(m for m in model.modules() if isinstance(m, PerLayerEmbedding))
    if module.table.tier.name == tier:
        return
    path = str(module.table.file.meta_path)
    module.use_table(plestore.open_table(path, tier=tier, device=str(device), **options))


def machine(device: torch.device) -> dict:
    info = {
        "host": platform.node(),
        "cpu_cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=p.name, gpu_memory=p.total_memory)
    return info


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gemma3n-e4b", help="gemma3n-e2b|e4b, gemma4-e2b|e4b")
    ap.add_argument("--tiny", action="store_true", help="tiny config on the CPU (CI)")
    ap.add_argument("--device", default=None, help="default: cuda if available (cpu if --tiny)")
    ap.add_argument("--tiers", default=",".join(TIERS))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 64 (4 with --tiny)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=None, help="default 3 (2 with --tiny)")
    ap.add_argument("--table-dir", default=None, help="default: a temporary directory")
    ap.add_argument("--cache-bytes", default="1G", help="direct tier row cache")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--append", default=None, help="append one JSON line to this file")
    a = ap.parse_args(argv)

    if a.device:
        device = torch.device(a.device)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    new_tokens = a.new_tokens or (4 if a.tiny else 64)
    repeats = a.repeats or (2 if a.tiny else 3)
    batches = [int(b) for b in a.batches.split(",")]
    tiers = [t for t in a.tiers.split(",") if t]
    options = {"cache_bytes": parse_bytes(a.cache_bytes)}

    model = build_model(a.preset, a.tiny, device)
    vocab = model.config.vocab_size_per_layer_input
    g = torch.Generator().manual_seed(1)
    prompts = {
        b: torch.randint(3, vocab, (b, a.prompt_len), generator=g).to(device) for b in batches
    }
    masks = {b: torch.ones_like(p) for b, p in prompts.items()}

    _sync(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    runs, stock_tokens = [], {}
    for b in batches:
        r = time_decode(model, prompts[b], masks[b], new_tokens, repeats, device)
        stock_tokens[b] = r.pop("tokens")
        runs.append(
            {"variant": "stock", "batch": b, **r, "greedy_matches_stock": True, "allocated": before}
        )
    with tempfile.TemporaryDirectory() as tmp:
        table_dir = a.table_dir or tmp
        report = offload_per_layer_embeddings(
            model, table_dir, tier=tiers[0], device=device, **options
        )
        _sync(device)
        after = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        for tier in tiers:
            try:
                set_tier(model, tier, device, options)
            except OSError as e:  # e.g. direct I/O unsupported on this filesystem
                print(f"skipping tier {tier}: {e}", file=sys.stderr)
                continue
            module = next(m for m in model.modules() if isinstance(m, PerLayerEmbedding))
            _sync(device)
            held = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
            for b in batches:
                r = time_decode(model, prompts[b], masks[b], new_tokens, repeats, device)
                same = torch.equal(r.pop("tokens"), stock_tokens[b])
                runs.append(
                    {
                        "variant": tier,
                        "batch": b,
                        **r,
                        "greedy_matches_stock": same,
                        "allocated": held,
                    }
                )
            runs[-1]["table_stats"] = module.table.stats()
        next(m for m in model.modules() if isinstance(m, PerLayerEmbedding)).close()

    result = {
        "benchmark": "gemma_offload",
        "preset": "tiny" if a.tiny else a.preset,
        "device": str(device),
        "new_tokens": new_tokens,
        "prompt_len": a.prompt_len,
        "repeats": repeats,
        "machine": machine(device),
        "table": {"rows": report.rows, "dim": report.dim, "bytes": report.weight_bytes},
        "memory": {
            "allocated_before": before,
            "allocated_after": after,
            "freed_bytes": report.freed_bytes,
            "pack_seconds": report.pack_seconds,
        },
        "runs": runs,
    }
    print(
        f"{result['preset']} on {device}: table [{report.rows}, {report.dim}] "
        f"{report.weight_bytes / 2**30:.2f} GiB bf16"
    )
    if before is not None:
        print(
            f"GPU memory allocated (weights): {before / 2**30:.2f} GiB stock -> "
            f"{after / 2**30:.2f} GiB offloaded to {tiers[0]}"
        )
    print(f"{'variant':>8} {'batch':>5} {'tok/s':>10} {'p10':>10} {'p90':>10} {'GiB':>7}  same")
    for r in runs:
        gib = "-" if r["allocated"] is None else f"{r['allocated'] / 2**30:.2f}"
        print(
            f"{r['variant']:>8} {r['batch']:>5} {r['tokens_per_s']:>10.1f} {r['p10']:>10.1f} "
            f"{r['p90']:>10.1f} {gib:>7}  {r['greedy_matches_stock']}"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1, default=str))
    if a.append:
        with open(a.append, "a") as f:
            f.write(json.dumps(result, default=str) + "\n")
    return result


if __name__ == "__main__":
    main()
