"""One real SGLang engine (sglang.Engine, device="cpu") in this process: started, asked for
greedy tokens, shut down. The tests start it as a subprocess of a session of its own
(sglang_engines.py: `python sglang_engine.py JOB_JSON`), so nothing it starts outlives its test.

JOB: {"model": dir, "prompts": [[ids]], "max_new_tokens": 16, "engine_args": {...}}; the
environment (PLESTORE_SGLANG, TRITON_INTERPRET, the shims' PYTHONPATH) is the process's own,
set by sglang_engines.py, so SGLang's plugins see the same one here and in every process it spawns.
Prints `RESULT {"tokens": [[ids]] | null, "error": str | null, "start_s": s, "generate_s": s}`
as its last line.
"""

import json
import sys
import time

#: what every engine of the job runs with (a job's engine_args replace or add to these)
ENGINE_ARGS = dict(
    device="cpu",
    skip_tokenizer_init=True,
    dtype="bfloat16",
    disable_cuda_graph=True,
    sampling_backend="pytorch",
    max_running_requests=4,  # the four prompts decode together
    chunked_prefill_size=64,  # the long prompt is prefilled in two chunks
    disable_radix_cache=True,  # (the mamba radix cache's state snapshots need a GPU)
    random_seed=0,
    log_level="info",
)


def generate(job: dict) -> dict:
    import sglang

    t0 = time.time()
    engine = sglang.Engine(model_path=job["model"], **{**ENGINE_ARGS, **job.get("engine_args", {})})
    started = time.time()
    try:
        params = {
            "max_new_tokens": job.get("max_new_tokens", 16),
            "temperature": 0.0,
            "ignore_eos": True,
        }
        outs = engine.generate(input_ids=job["prompts"], sampling_params=params)
        tokens = [list(o["output_ids"]) for o in outs]
    finally:
        done = time.time()
        engine.shutdown()
    return {"tokens": tokens, "start_s": started - t0, "generate_s": done - started}


def main() -> None:
    try:
        result = {**generate(json.loads(sys.argv[1])), "error": None}
    except Exception as e:
        result = {"tokens": None, "error": f"{type(e).__name__}: {e}"}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":  # (SGLang spawns its processes: they re-import this file)
    main()
