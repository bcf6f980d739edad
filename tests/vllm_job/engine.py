"""Runs real vLLM engines in this process, one after another, and prints what each generated:
the tests start it as a subprocess (python engine.py JOBS_JSON), so no engine outlives its test.

JOBS: [{"model": dir, "dtype": "bfloat16", "plestore": {...} | null, "prompts": [[ids]],
        "max_tokens": 16, "tp": 1, "env": {}, "stop_feeds_after": tokens | absent}, ...]
(stop_feeds_after: a first generate of that many tokens, then the tables' host threads ended
before the generate whose tokens are printed.)
Engines of tp 1 run in this process (vLLM's in-process engine and executor: a start takes
seconds, not tens); tp > 1 runs vLLM's worker processes. Around each job's log it prints
`JOB i` and `RESULT {"tokens": [[ids]] | null, "error": str | null, "seconds": s}`.
"""

import gc
import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the tiny models need little
os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def run(job: dict) -> dict:
    """One engine: the job's environment for it alone (restored after)."""
    saved = dict(os.environ)
    try:
        return _generate(job)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _generate(job: dict) -> dict:
    os.environ.update(job.get("env", {}))
    from vllm import LLM, SamplingParams

    kw = {}
    if job.get("plestore") is not None:
        kw["additional_config"] = {"plestore": job["plestore"]}
    tp = job.get("tp", 1)
    if tp > 1:  # one core per worker (vLLM's CPU build binds them)
        kw["tensor_parallel_size"] = tp
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(tp))))
    else:
        kw["distributed_executor_backend"] = "uni"
    llm = LLM(
        model=job["model"],
        skip_tokenizer_init=True,
        dtype=job.get("dtype", "bfloat16"),
        max_model_len=512,
        max_num_batched_tokens=64,  # the longest prompt is prefilled in chunks
        max_num_seqs=4,
        enforce_eager=True,
        seed=0,
        **kw,
    )
    try:
        params = SamplingParams(
            max_tokens=job.get("max_tokens", 16), temperature=0, ignore_eos=True
        )
        params.detokenize = False
        prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
        if job.get("stop_feeds_after"):  # the tables' host sides killed mid-run
            first = SamplingParams(max_tokens=job["stop_feeds_after"], temperature=0)
            first.detokenize = False
            llm.generate(prompts, first)
            _stop_feeds()
        outs = llm.generate(prompts, params)
        return {"tokens": [list(o.outputs[0].token_ids) for o in outs]}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def _stop_feeds() -> None:
    """Every graph feed's host thread in this process (the in-process engine's) ended."""
    from plestore.lookup import graphfeed

    for feeder in graphfeed.live_feeds():
        feeder.stop()


def main() -> None:
    for i, job in enumerate(json.loads(sys.argv[1])):
        print(f"JOB {i}", flush=True)
        t0 = time.time()
        try:
            result = {**run(job), "error": None}
        except Exception as e:
            result = {"tokens": None, "error": f"{type(e).__name__}: {e}"}
        result["seconds"] = time.time() - t0
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
