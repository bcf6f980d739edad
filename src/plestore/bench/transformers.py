"""plestore bench transformers: stock transformers vs plestore per tier, Gemma and Qwen4Exp.

    plestore bench transformers --model gemma3n-e2b              # on the H200
    plestore bench transformers --model qwen4exp --fp8           # the real 320M-row table, FP8
    plestore bench transformers --model qwen4exp --tiny --json   # CI: CPU, seconds

Builds a random-weight model of the real transformers class on the device, the per-layer
table(s) at their real shape — Gemma: the preset's [262144, layers * 256]; Qwen4Exp: the n-gram
table of `--ngram-vocab-size-base` (20,000,000: 320,001,536 rows x 160) on a small trunk
(`--hidden-size`, `--layers`; the table does not depend on them) — packs the table once and
opens it on every tier, then times, interleaved (round r runs every variant, in an order rotated
by r, so the machine's drift falls on all of them alike):

  stock            greedy generate, the table resident on the device (what transformers does)
  <tier>           the same model with plestore's modules swapped in, rows from that tier
                   (device, pinned, mapped, direct); tokens checked against stock

and after those rounds, in sequence (Qwen4Exp; the model is rebuilt for them):

  accelerate-cpu   stock with the tables on the CPU (what device_map does with them when they
                   do not fit: transformers then looks rows up on the CPU)
  accelerate-disk  stock with accelerate's disk offload of the tables (hooks load the whole
                   weight per forward: --offload-tokens bounds it)

--fp8 (Qwen4Exp): the model holds e4m3 values in bf16, as transformers loads an FP8 checkpoint,
and plestore keeps them in an fp8_e4m3 table (1 byte per value), exactly.
Decode tok/s = batch / the median decode step (the gaps between the sampler's calls, a logits
processor that changes nothing; the prefill left out) over every step of every round; p10 / p90
over rounds (batch / each round's median step); `paired`: the median (p10-p90) of each round's
rate over stock's in that round. No garbage collection inside a timed generate (between rounds).
`ple ms`: the median CPU wall time per decode step inside the PLE modules (stock: its embedding,
and for Qwen4Exp its hashing; plestore: its modules and prefetch), from one extra run: where the
step time goes. Peak GPU memory is torch's max_memory_allocated over the variant's runs, less
the stock weights held aside meanwhile; host memory, what the variant's tables hold (the
process's RSS once, at the end).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from plestore.bench.transformers_models import GEMMA

TIERS = ("pinned", "mapped", "direct", "device")  # the first one is offloaded to


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def _generate(model, ids, n, steps=None):
    mask = torch.ones_like(ids)
    extra = {} if steps is None else {"logits_processor": steps.processors()}
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, **extra
    )


class StepTimes:
    """When each generated token's logits reach generate's sampler (a logits processor that
    changes nothing): the gaps are the decode steps' periods, each whole forward and the
    sampler's sync, the prefill left out. With a PleClock, also its seconds at those times."""

    def __init__(self, clock=None) -> None:
        self.clock = clock
        self.marks: list[tuple[float, float]] = []

    def processors(self):
        from transformers import LogitsProcessor, LogitsProcessorList

        times = self

        class Mark(LogitsProcessor):
            def __call__(self, input_ids, scores):
                times.marks.append((time.perf_counter(), times.clock.seconds if times.clock else 0))
                return scores

        return LogitsProcessorList([Mark()])

    def steps(self) -> np.ndarray:
        """Seconds per decode step [new_tokens - 1]."""
        return np.diff([t for t, _ in self.marks])

    def ple_steps(self) -> np.ndarray:
        """PleClock seconds per decode step [new_tokens - 1]."""
        return np.diff([c for _, c in self.marks])


def _decode_steps(model, ids, new_tokens: int, clock=None) -> StepTimes:
    """One generate's decode step times (no garbage collection inside: its pauses land in some
    runs, not others; collected between rounds instead)."""
    times = StepTimes(clock)
    gc.disable()
    try:
        _generate(model, ids, new_tokens, times)
    finally:
        gc.enable()
    return times


def _ple_ms(model, variants, ids, new_tokens: int) -> tuple[float, float]:
    """(median ms per decode step, of which ms in the PLE modules) from one generate."""
    from plestore.bench.transformers_variants import PleClock

    clock = PleClock(variants.ple_modules())
    try:
        times = _decode_steps(model, ids, new_tokens, clock)
    finally:
        clock.close()
    return float(np.median(times.steps())) * 1e3, float(np.median(times.ple_steps())) * 1e3


@torch.no_grad()
def interleaved(model, variants, prompts: dict, new_tokens: int, repeats: int, device, log) -> list:
    """Every variant, warm, `repeats` rounds (per batch, the variants one after another in an
    order rotated per round); one result per variant and batch."""
    names = variants.names
    stock_tokens, out = {}, {}
    for v in names:  # warm-up, the tokens to compare, and where the step time goes
        variants.use(v)
        for b, ids in prompts.items():
            tokens = _generate(model, ids, new_tokens).cpu()
            stock_tokens.setdefault(b, tokens)
            step_ms, ple_ms = _ple_ms(model, variants, ids, new_tokens)
            out[v, b] = {
                "variant": v,
                "batch": b,
                "greedy_matches_stock": torch.equal(tokens, stock_tokens[b]),
                "step_ms": step_ms,
                "ple_ms_per_step": ple_ms,
                "rates": [],  # per round: batch / its median step
                "steps": [],  # every decode step's seconds, all rounds
                "peak_gpu_bytes": None,
                "table_host_bytes": variants.table_host_bytes(),
                "interleaved": True,
            }
    gc.collect()
    gc.freeze()  # the model's objects: later collections need not walk them
    peak = dict.fromkeys(names, 0)
    for r in range(repeats):
        gc.collect()
        for b, ids in prompts.items():  # a batch's variants back to back: what drifts over
            for v in names[r % len(names) :] + names[: r % len(names)]:  # seconds cancels
                variants.use(v)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                steps = _decode_steps(model, ids, new_tokens).steps()
                out[v, b]["rates"].append(b / float(np.median(steps)))
                out[v, b]["steps"].extend(steps.tolist())
                if device.type == "cuda":
                    used = torch.cuda.max_memory_allocated(device) - variants.parked_device_bytes()
                    peak[v] = max(peak[v], used)
        log(f"round {r + 1}/{repeats} done")
    if device.type == "cuda":
        for (v, _), rec in out.items():
            rec["peak_gpu_bytes"] = peak[v]
    for v in names:
        for b in prompts:
            # each round's rate over stock's in the same round: drift between rounds cancels
            paired = np.divide(out[v, b]["rates"], out["stock", b]["rates"])
            out[v, b]["paired_ratio"] = [float(x) for x in np.percentile(paired, [10, 50, 90])]
    return [_summary(r) for r in out.values()]


def _summary(r: dict) -> dict:
    """tok/s: batch / the median of every decode step of every round (a stall moves a few steps,
    not the median); p10 / p90 over rounds (batch / each round's median step)."""
    rates, steps = r.pop("rates"), r.pop("steps")
    p10, p90 = np.percentile(rates, [10, 90])
    return {
        **r,
        "tokens_per_s": r["batch"] / float(np.median(steps)),
        "p10": float(p10),
        "p90": float(p90),
        "runs": len(rates),
        "steps": len(steps),
    }


@torch.no_grad()
def _accelerate_variants(model, a, prompts, stock_tokens, device, log) -> list:
    """Stock with its PLE tables on the CPU (transformers looks rows up there), then offloaded
    to disk by accelerate (its hook loads the weight onto the device for every forward), each
    timed in sequence after the interleaved rounds."""
    tables = [m.ngram_embedding for n, m in model.named_modules() if n.endswith("ple_embedding")]
    need = sum(t.weight.numel() * t.weight.element_size() for t in tables)
    runs = []

    def run(variant: str, new_tokens: int, repeats: int) -> None:
        for b, ids in prompts.items():
            tokens = _generate(model, ids, new_tokens).cpu()
            same = torch.equal(tokens, stock_tokens[b][:, : tokens.shape[1]])
            steps = [_decode_steps(model, ids, new_tokens).steps() for _ in range(repeats)]
            host = need if variant == "accelerate-cpu" else 0
            runs.append(
                _summary(
                    {
                        "variant": variant,
                        "batch": b,
                        "greedy_matches_stock": same,
                        "rates": [b / float(np.median(x)) for x in steps],
                        "steps": np.concatenate(steps).tolist(),
                        "peak_gpu_bytes": None,
                        "table_host_bytes": host,
                        "interleaved": False,
                    }
                )
            )
            log(f"{variant:>16} b{b}: {runs[-1]['tokens_per_s']:.1f} tok/s  same={same}")

    for t in tables:
        t.to("cpu")
    torch.cuda.empty_cache() if device.type == "cuda" else None
    run("accelerate-cpu", a.new_tokens, a.repeats)
    try:
        from accelerate.big_modeling import disk_offload
        from accelerate.hooks import remove_hook_from_module
    except ImportError as e:
        log(f"skipping accelerate-disk: {e}")
        return runs
    work = Path(a.table_dir or tempfile.gettempdir())
    if shutil.disk_usage(work).free < need + (1 << 30):
        log(f"skipping accelerate-disk: {need / 2**30:.1f} GiB do not fit {work}")
        return runs
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        for i, t in enumerate(tables):
            disk_offload(t, f"{tmp}/{i}", execution_device=device)
        run("accelerate-disk", a.offload_tokens, 1)
        for t in tables:
            remove_hook_from_module(t, recurse=True)
    return runs


def _args(argv):
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
    ap.add_argument("--new-tokens", type=int, default=None, help="default 32 (4 with --tiny)")
    ap.add_argument("--offload-tokens", type=int, default=4, help="accelerate-disk")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=None, help="rounds; default 7 (2 with --tiny)")
    ap.add_argument("--no-accelerate", action="store_true", help="skip the accelerate variants")
    ap.add_argument(
        "--table-dir", default=None, help="tables kept and reused here (default: a temp dir)"
    )
    ap.add_argument("--cache-bytes", default="1G", help="direct tier row cache")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    if a.fp8 and a.model != "qwen4exp":
        ap.error("--fp8 is for --model qwen4exp")
    a.new_tokens = a.new_tokens or (4 if a.tiny else 32)
    a.repeats = a.repeats or (2 if a.tiny else 7)
    return a


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    from plestore.bench.transformers_models import build_model
    from plestore.bench.transformers_variants import Variants
    from plestore.options import parse_bytes

    cuda = torch.cuda.is_available() and not a.tiny
    device = torch.device(a.device or ("cuda" if cuda else "cpu"))
    batches = [int(b) for b in a.batches.split(",")]
    tiers = [t for t in a.tiers.split(",") if t]
    options = {"cache_bytes": parse_bytes(a.cache_bytes)}
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if a.json else print
    if a.tiny:
        torch.set_num_threads(1)  # tiny bf16 matmuls: faster on one thread than on a pool

    t0 = time.perf_counter()
    model = build_model(a, device)
    log(f"built {a.model} on {device} in {time.perf_counter() - t0:.1f} s")
    qwen = a.model == "qwen4exp"
    vocab = model.config.vocab_size if qwen else model.config.vocab_size_per_layer_input
    g = torch.Generator().manual_seed(1)
    prompts = {
        b: torch.randint(6, vocab, (b, a.prompt_len), generator=g).to(device) for b in batches
    }
    variants = Variants(model)
    report = None
    with tempfile.TemporaryDirectory() as tmp:
        if tiers:  # --table-dir: packed once, reused by fingerprint
            t0 = time.perf_counter()
            fmt = "fp8_e4m3" if a.fp8 else None
            report = variants.offload(a.table_dir or tmp, tiers, device, format=fmt, **options)
            log(f"offloaded in {time.perf_counter() - t0:.1f} s: {report}")
        try:
            runs = interleaved(model, variants, prompts, a.new_tokens, a.repeats, device, log)
        finally:
            variants.use("stock")
            variants.close()
    result = _result(a, device, report, runs)
    if qwen and not a.no_accelerate:
        _write(a, result, final=False)  # kept should the sequential variants not finish
        del model, variants
        model = build_model(a, device)  # again: the stock modules moved back and forth
        stock_tokens = {b: _generate(model, ids, a.new_tokens).cpu() for b, ids in prompts.items()}
        runs += _accelerate_variants(model, a, prompts, stock_tokens, device, log)
        result = _result(a, device, report, runs)
    _print(result, log)
    _write(a, result)
    return 0 if all(r["greedy_matches_stock"] for r in result["runs"]) else 1


def _result(a, device, report, runs: list) -> dict:
    import transformers

    from plestore.bench.report import machine

    stock = {r["batch"]: r["tokens_per_s"] for r in runs if r["variant"] == "stock"}
    for r in runs:
        r["ratio_to_stock"] = r["tokens_per_s"] / stock[r["batch"]]
    return {
        "benchmark": "transformers",
        "model": a.model + (" (tiny)" if a.tiny else "") + (" fp8" if a.fp8 else ""),
        "transformers": transformers.__version__,
        "device": str(device),
        "new_tokens": a.new_tokens,
        "prompt_len": a.prompt_len,
        "rounds": a.repeats,
        "machine": machine(),
        "host_rss_bytes": _rss(),
        "table": None if report is None else _table(report),
        "runs": runs,
    }


def _write(a, result: dict, final: bool = True) -> None:
    text = json.dumps(result, indent=1, default=str)
    if a.out:
        Path(a.out).write_text(text)
    if a.json and final:
        print(text)


def _table(report) -> dict:
    keys = ("rows", "dim", "format", "weight_bytes", "table_bytes", "exact", "reused")
    return {**{k: getattr(report, k) for k in keys}, "pack_seconds": report.pack_seconds}


def _print(result: dict, log) -> None:
    log(
        f"{'variant':>16} {'batch':>5} {'tok/s':>9} {'p10':>9} {'p90':>9} {'ratio':>6} "
        f"{'paired (p10-p90)':>18} {'step ms':>7} {'ple ms':>6} {'peak GiB':>8} "
        f"{'host GiB':>8}  same"
    )
    for r in result["runs"]:
        peak = "-" if r["peak_gpu_bytes"] is None else f"{r['peak_gpu_bytes'] / 2**30:.2f}"
        step = f"{r['step_ms']:.2f}" if "step_ms" in r else "-"
        ple = f"{r['ple_ms_per_step']:.3f}" if "ple_ms_per_step" in r else "-"
        lo, mid, hi = r.get("paired_ratio") or (0, 0, 0)
        paired = f"{mid:.3f} ({lo:.2f}-{hi:.2f})" if mid else "-"
        log(
            f"{r['variant']:>16} {r['batch']:>5} {r['tokens_per_s']:>9.1f} {r['p10']:>9.1f} "
            f"{r['p90']:>9.1f} {r['ratio_to_stock']:>6.3f} {paired:>18} {step:>7} {ple:>6} "
            f"{peak:>8} {r['table_host_bytes'] / 2**30:>8.2f}  {r['greedy_matches_stock']}"
        )


if __name__ == "__main__":
    sys.exit(main())
