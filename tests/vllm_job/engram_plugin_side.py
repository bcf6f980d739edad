"""The plugin's side of tests/vllm_job/test_engram_plugin.py: one rank of a gloo group building
vLLM's DeepSeek-V4.1 `Engram` layers by vLLM's own constructors, twice on the same checkpoint:
as vLLM builds them (its `ParallelEngramEmbedding`, filled by its weight loader) and with the
plugin active (`register()` as vLLM's plugin loader calls it, and the names the model builds
them by rebound as the plugin's model class does: `deepseek.engram_classes`). Each layer then
takes the same ids and hidden states; what both return is written for the test to compare.

    python engram_plugin_side.py WORK RANK WORLD   # reads WORK/job.json + inputs.safetensors,
                                                   # writes WORK/out-RANK.safetensors + .json

vLLM's config holds the checkpoint's ModelConfig (vLLM forms its Engram DP group for
DeepseekV41ForCausalLM only; the checkpoint's config names it and its experts: DP token
metadata is kept for MoE models only). With `dp` > 1 in the job the WORLD processes are DP
replicas of `tp` ranks each (process `dp_rank · tp + tp_rank`), set up as vLLM's DP engines
are: each replica's ParallelConfig holds its data_parallel_size / rank and the one master port
vLLM's front end hands every engine. A step runs as vLLM's model runs it, in a forward context
of the replicas' token counts (vLLM's own DP all-reduce): the ids gathered over the Engram DP
group (`gather_engram_hashes`, each replica its own batch, padded with DEAD_ID), both layers'
rows prepared from them, then each layer (whose rows vLLM's DP exchange brings back).

vLLM's CPU GEMM (`wkv`) gives other bits for the same rows at another address (seen with one
thread too: an input cloned elsewhere changes kv), so both builds' `wkv` read their input from
one buffer (`one_wkv_input`); the rows themselves are compared on their own, bit for bit.

vLLM's kernels run under Triton's interpreter (engram_vllm_side.py says why and how). Two
torch.cuda queries vLLM's constructor makes for its lookup grid (the SM count) answer 4 here:
the CPU has no device to ask.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

from engram_vllm_side import import_engram, interpreter_masks_as_bool  # (sets TRITON_INTERPRET)


def _no_gpu_queries() -> None:
    import torch

    torch.cuda.get_device_properties = lambda *a: types.SimpleNamespace(multi_processor_count=4)
    torch.accelerator.current_device_index = lambda: 0


def _vllm_config(job: dict, dp_rank: int):
    """vLLM's config as its engine (a DP engine with DP > 1) holds it: the checkpoint's model
    config, the parallel config of TP and DP."""
    from vllm.config import EngramConfig, ModelConfig, ParallelConfig, VllmConfig

    dp = job["dp"]
    replica = {}
    if dp > 1:
        replica = {"data_parallel_rank": dp_rank, "data_parallel_rank_local": dp_rank}
    parallel = ParallelConfig(
        tensor_parallel_size=job["tp"],
        data_parallel_size=dp,
        data_parallel_master_ip="127.0.0.1",
        **replica,
    )
    if dp > 1:  # what vLLM's front end sends every DP engine at its handshake: one master port
        parallel.data_parallel_master_port = job["dp_port"]
        parallel._data_parallel_master_port_list = []
    model = ModelConfig(model=job["checkpoint"], skip_tokenizer_init=True)
    engram = EngramConfig(cpu_offload=False)  # (pinned host needs CUDA)
    return VllmConfig(model_config=model, parallel_config=parallel, engram_config=engram)


def _vllm_group(work: Path, job: dict, rank: int):
    """vLLM's config context and its groups over gloo (TP, DP and the Engram DP group)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    tp = job["tp"]
    dp_rank, tp_rank = divmod(rank, tp)
    config = _vllm_config(job, dp_rank)
    context = set_current_vllm_config(config)
    context.__enter__()
    ps.init_distributed_environment(  # (DP > 1: vLLM offsets the rank by the DP rank's)
        world_size=tp,
        rank=tp_rank,
        distributed_init_method=f"file://{work}/rendezvous",
        local_rank=rank,
        backend="gloo",
    )
    ps.initialize_model_parallel(tp, 1)
    return config, context  # (the context is left when it is collected: kept by the caller)


def _load(layer, ck: Path, prefix: str, tables: bool) -> None:
    """The checkpoint's tensors through each parameter's own weight loader (vLLM's)."""
    from safetensors import safe_open
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    names = {"wkv.weight", "q_weight", "k_weight"}
    if tables:
        names |= {"embed_tokens.weight", "embed_tokens.weight_scale_inv"}
    params = dict(layer.named_parameters())
    assert set(params) == names, sorted(params)  # the plugin's layer has no table parameter
    with safe_open(str(ck / "model.safetensors"), framework="pt") as f:
        for name, param in params.items():
            w = f.get_tensor(prefix + name.replace("embed_tokens", "embed"))
            if name.endswith("weight_scale_inv"):  # DeepSeek's scales arrive as E8M0
                import torch

                w = w.view(torch.float8_e8m0fnu)
            getattr(param, "weight_loader", default_weight_loader)(param, w)
    for module in layer.modules():  # as vLLM's loader finishes each module after loading
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)


def _build(e, job, config, plugin: bool):
    from vllm.models.deepseek_v41.nvidia import model as vllm_model

    from plestore.integrations.vllm.config import PlestoreSettings
    from plestore.integrations.vllm.deepseek import engram_classes

    cfg = types.SimpleNamespace(**job["config"])
    layout = e.EngramLayout(cfg)
    settings = PlestoreSettings.parse(job["plestore"], "test", "vLLM") if plugin else None
    layers = {}
    engram_config = config.engram_config
    with engram_classes(settings, engram_config):
        if engram_config.dp_shared_memory:  # (as DeepseekV4Model checks, before its layers)
            engram_config.dp_shared_memory = e.can_share_engram_tables(layout)
        shared = bool(engram_config.dp_shared_memory)  # (the model keeps it for its steps)
        for i, lid in enumerate(cfg.engram_layer_ids):  # as DeepseekV4DecoderLayer builds it
            layers[lid] = vllm_model.Engram(
                cfg, None, layout, i, False, prefix=f"model.layers.{lid}.engram"
            )
    ck = Path(job["checkpoint"])
    for lid, layer in layers.items():
        _load(layer, ck, f"model.layers.{lid}.engram.", tables=not plugin)
        if plugin:
            layer.embed_tokens.open(str(ck), settings)
    return layers, shared


class _FixedInput:
    """`wkv` reading its input from one fixed buffer (the same address for both builds)."""

    def __init__(self, wkv, buf) -> None:
        self.wkv, self.buf = wkv, buf

    def __call__(self, x):
        n = x.shape[0]
        self.buf[:n].copy_(x)
        return self.wkv(self.buf[:n])


def one_wkv_input(a, b) -> None:
    import torch

    buf = torch.empty(a.staged_rows.shape[0], a.wkv.input_size, dtype=torch.bfloat16)
    for layer in (a, b):
        object.__setattr__(layer, "wkv", _FixedInput(layer._modules.pop("wkv"), buf))


def _step(config, layers, shared, ids, hidden, mask, out: dict, tag: str) -> None:
    """What the model does in a step: the ids gathered over the Engram DP group (vLLM's; as
    they are with DP = 1 or a DP-shared table), both layers' rows prepared from them before
    the decoder layers, then each layer (rows, the rank's part of them: every gathered token's
    rows of its heads, the layer's output). The rows' buffer is NaN before: what a build leaves
    unwritten shows."""
    from vllm.forward_context import set_forward_context
    from vllm.models.deepseek_v41.common.engram import gather_engram_hashes

    with set_forward_context(None, config, num_tokens=ids.shape[0]):
        gathered = gather_engram_hashes(ids, dp_shared_memory=shared)
        for layer in layers.values():
            layer.staged_rows.fill_(float("nan"))
        for layer in layers.values():
            layer.prepare_embeddings(gathered[:, layer.layer_hash_index])
        for lid, layer in layers.items():
            h, g = ids[:, layer.layer_hash_index], gathered[:, layer.layer_hash_index]
            out[f"{tag}/{lid}/rows"] = layer.embed(h).clone()  # (the plugin's rows land here)
            out[f"{tag}/{lid}/part"] = layer.staged_rows[: g.shape[0]].clone()  # its heads
            layer.prepare_embeddings(g)
            out[f"{tag}/{lid}/output"] = layer(hidden, h, mask)


def _split(layers) -> dict:
    """Each layer's (head_start, part columns, first row, end row) as its embedding splits."""
    return {
        str(lid): [m.embed_tokens.head_start, m.embed_tokens.part_n_hash_cols,
                   m.embed_tokens.vocab_start_idx, m.embed_tokens.vocab_end_idx]
        for lid, m in layers.items()
    }  # fmt: skip


def _node_copies(layers, rank: int) -> dict:
    """Each layer's pinned copy (its segment, whether this rank built it) and, seen by rank 0
    once every rank has opened its tables, the copies in the segment directory and their
    users (`plestore shm list`'s view)."""
    import os

    import torch.distributed as dist
    from vllm.distributed import get_world_group

    from plestore.io.shmlist import list_copies

    got = {"pid": os.getpid(), "copies": {}}
    for lid, m in layers.items():
        d = m.embed_tokens.rows.table.tier.describe()
        got["copies"][str(lid)] = [d["shared_copy"], d["built_shared_copy"]]
    group = get_world_group().cpu_group
    dist.barrier(group=group)
    if rank == 0:
        got["listed"] = [[c.path, sorted(c.users), c.state] for c in list_copies()]
    dist.barrier(group=group)
    return got


def _vllm_dp_shared_table(e, layers) -> str:
    """vLLM's own DP-shared table (cpu_offload + dp_shared_memory), built by its constructor:
    what the CPU build answers."""
    m = next(iter(layers.values())).embed_tokens
    try:
        e.ParallelEngramEmbedding(
            m.num_embeddings, m.dim, m.head_sizes, cpu_offload=True, dp_shared_memory=True
        )
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "built"


def main(work: Path, rank: int, world: int) -> None:
    interpreter_masks_as_bool()
    _no_gpu_queries()
    from safetensors.torch import load_file, save_file

    e = import_engram()
    import plestore.integrations.vllm as plugin

    job = {"tp": world, "dp": 1, **json.loads((work / "job.json").read_text())}
    config, _context = _vllm_group(work, job, rank)
    plugin.register()  # what vLLM's plugin loader runs in every process
    inp = load_file(work / "inputs.safetensors")
    out, info = {}, {"rank": rank}
    mask = inp.get("token_mask")
    try:
        ours, shared = _build(e, job, config, plugin=True)
    except Exception as err:  # a bad table: the one line the engine's start would print
        info["error"] = f"{type(err).__name__}: {err}"
        ours = None
    if ours is not None:
        vllm_layers, vllm_shared = _build(e, job, config, plugin=False)
        for lid, layer in ours.items():  # (see the module's docstring)
            one_wkv_input(layer, vllm_layers[lid])
        info["classes"] = sorted({type(m).__name__ for m in ours.values()})
        info["tiers"] = [m.embed_tokens.rows.table.tier.name for m in ours.values()]
        info["split"], info["vllm_split"] = _split(ours), _split(vllm_layers)
        info["slot"] = [list(m.embed_tokens.shard) for m in ours.values()]
        info["dp_shared"] = [shared, vllm_shared]
        if shared:
            info["node"] = _node_copies(ours, rank)
            info["vllm_dp_shared"] = _vllm_dp_shared_table(e, ours)
        batches = job["batches"][rank // job["tp"]] if job["dp"] > 1 else job["batches"]
        for name in batches:  # (DP: each replica its own batch a step)
            ids, hidden = inp[f"{name}/ids"], inp[f"{name}/hidden"]
            m = mask if name == "model" else None
            _step(config, vllm_layers, vllm_shared, ids, hidden, m, out, f"vllm/{name}")
            _step(config, ours, shared, ids, hidden, m, out, f"plestore/{name}")
    save_file({k: v.contiguous() for k, v in out.items()}, work / f"out-{rank}.safetensors")
    (work / f"out-{rank}.json").write_text(json.dumps(info))
    from vllm.distributed import parallel_state as ps

    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
