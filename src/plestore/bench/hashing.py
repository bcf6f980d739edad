"""Hashing throughput: row ids of one ragged batch, numpy and torch (one CPU thread), and CUDA
when present. Prints percentiles and appends one JSON line per run to hashing_results.jsonl.

    plestore bench hash                  # 65,536 tokens in 64 requests
    plestore bench hash --tokens 256 --repeat 3 --no-record   # CI size

Throughput is over the bytes the hash writes (int64 ids, T x heads x 8 B); the inputs are a
few bytes per token. Targets (issue): 65,536 tokens <= 50 ms on one CPU core, <= 1 ms on GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from plestore.hashing import EngramHash, Qwen4ExpHash
from plestore.spec import preset_config

RESULTS = Path("benchmarks") / "hashing_results.jsonl"  # relative to where it runs


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _batch(num_tokens: int, num_requests: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, num_tokens), num_requests - 1, replace=False))
    qsl = np.concatenate([[0], cuts, [num_tokens]]).astype(np.int64)
    return rng.integers(0, vocab, num_tokens, dtype=np.int64), qsl


def _time(fn, repeat: int, cuda: bool) -> np.ndarray:
    fn()  # warm-up: device tables, allocator, kernels
    out = []
    for _ in range(repeat):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return np.array(out)


def run(num_tokens: int, num_requests: int, repeat: int) -> list[dict]:
    torch.set_num_threads(1)
    qwen = Qwen4ExpHash.from_hf_config(preset_config("qwen3.8-flash-next"))
    engram = EngramHash.from_hf_config(preset_config("deepseek-v4.1-flash"))  # compressed ids
    ids, qsl = _batch(num_tokens, num_requests, 99092)
    ctx = qwen.fresh_context(num_requests)
    lb = np.full((num_requests, 3), -1, dtype=np.int64)
    pos = np.arange(num_tokens) - np.repeat(qsl[:-1], np.diff(qsl))
    cases = {
        "qwen4exp": (qwen, (ids, qsl, ctx), {}),
        "engram": (engram, (ids, qsl, lb), {"positions": pos}),
    }
    backends = ["numpy", "torch-cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows = []
    for name, (h, args, kw) in cases.items():
        for backend in backends:
            for check in (True, False):
                if backend == "numpy" and not check:
                    continue  # numpy checks cost no sync; one row is enough
                if backend == "numpy":
                    a, k = args, kw
                else:
                    dev = "cuda" if backend == "cuda" else "cpu"
                    a = tuple(torch.from_numpy(x).to(dev) for x in args)
                    k = {key: torch.from_numpy(v).to(dev) for key, v in kw.items()}
                ms = _time(
                    lambda h=h, a=a, k=k, c=check: h.row_ids(*a, **k, check=c),
                    repeat,
                    backend == "cuda",
                )
                out_bytes = num_tokens * h.heads * 8
                rows.append(
                    {
                        "hash": name,
                        "backend": backend,
                        "check": check,
                        "tokens": num_tokens,
                        "requests": num_requests,
                        "heads": h.heads,
                        "ms_p10": round(float(np.percentile(ms, 10)), 3),
                        "ms_p50": round(float(np.percentile(ms, 50)), 3),
                        "ms_p90": round(float(np.percentile(ms, 90)), 3),
                        "mtok_per_s": round(num_tokens / float(np.median(ms)) / 1e3, 2),
                        "out_gb_per_s": round(out_bytes / float(np.median(ms)) / 1e6, 2),
                    }
                )
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="plestore bench hash", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--no-record", action="store_true", help="do not append to the results file")
    args = p.parse_args(argv)
    rows = run(args.tokens, args.requests, args.repeat)
    machine = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu": _cpu_name(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "torch_threads": 1,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    print(json.dumps(machine))
    print(
        f"{'hash':9} {'backend':9} {'check':5} {'p10 ms':>8} {'p50 ms':>8} {'p90 ms':>8} "
        f"{'Mtok/s':>7} {'out GB/s':>8}"
    )
    for r in rows:
        print(
            f"{r['hash']:9} {r['backend']:9} {r['check']!s:5} {r['ms_p10']:8.3f} "
            f"{r['ms_p50']:8.3f} {r['ms_p90']:8.3f} {r['mtok_per_s']:7.2f} "
            f"{r['out_gb_per_s']:8.2f}"
        )
    if not args.no_record:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        with RESULTS.open("a") as f:
            f.write(json.dumps({"machine": machine, "rows": rows}) + "\n")
    return rows


if __name__ == "__main__":
    main()
