"""The plugin's side of tests/vllm_job/test_engram_plugin.py: one rank of a gloo group building
vLLM's DeepSeek-V4.1 `Engram` layers by vLLM's own constructors, twice on the same checkpoint:
as vLLM builds them (its `ParallelEngramEmbedding`, filled by its weight loader) and with the
plugin active (`register()` as vLLM's plugin loader calls it, and the names the model builds
them by rebound as the plugin's model class does: `deepseek.engram_classes`). Each layer then
takes the same ids and hidden states; what both return is written for the test to compare.

    python engram_plugin_side.py WORK RANK WORLD   # reads WORK/job.json + inputs.safetensors,
                                                   # writes WORK/out-RANK.safetensors + .json

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


def _vllm_group(work: Path, rank: int, world: int):
    """vLLM's config context and its TP group over gloo (TP = world)."""
    from vllm.config import EngramConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    config = VllmConfig()
    config.engram_config = EngramConfig(cpu_offload=False)  # (pinned host needs CUDA)
    context = set_current_vllm_config(config)
    context.__enter__()
    ps.init_distributed_environment(
        world_size=world,
        rank=rank,
        distributed_init_method=f"file://{work}/rendezvous",
        local_rank=rank,
        backend="gloo",
    )
    ps.initialize_model_parallel(world, 1)
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
    with engram_classes(settings, config.engram_config):
        for i, lid in enumerate(cfg.engram_layer_ids):  # as DeepseekV4DecoderLayer builds it
            layers[lid] = vllm_model.Engram(
                cfg, None, layout, i, False, prefix=f"model.layers.{lid}.engram"
            )
    ck = Path(job["checkpoint"])
    for lid, layer in layers.items():
        _load(layer, ck, f"model.layers.{lid}.engram.", tables=not plugin)
        if plugin:
            layer.embed_tokens.open(str(ck), settings)
    return layers


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


def _step(layers, ids, hidden, mask, out: dict, tag: str) -> None:
    """What the model does in a step: both layers' rows prepared before the decoder layers,
    then each layer (rows, the rank's part of them, the layer's output). The rows' buffer is
    NaN before: what a build leaves unwritten shows."""
    for layer in layers.values():
        layer.staged_rows.fill_(float("nan"))
    for layer in layers.values():
        layer.prepare_embeddings(ids[:, layer.layer_hash_index])
    for lid, layer in layers.items():
        n = ids.shape[0]
        h = ids[:, layer.layer_hash_index]
        out[f"{tag}/{lid}/rows"] = layer.embed(h).clone()  # (the plugin's rows land here)
        out[f"{tag}/{lid}/part"] = layer.staged_rows[:n].clone()  # this rank's heads
        layer.prepare_embeddings(h)
        out[f"{tag}/{lid}/output"] = layer(hidden, h, mask)


def main(work: Path, rank: int, world: int) -> None:
    interpreter_masks_as_bool()
    _no_gpu_queries()
    from safetensors.torch import load_file, save_file

    e = import_engram()
    import plestore.integrations.vllm as plugin

    job = json.loads((work / "job.json").read_text())
    config, _context = _vllm_group(work, rank, world)
    plugin.register()  # what vLLM's plugin loader runs in every process
    inp = load_file(work / "inputs.safetensors")
    out, info = {}, {"rank": rank}
    mask = inp.get("token_mask")
    try:
        ours = _build(e, job, config, plugin=True)
    except Exception as err:  # a bad table: the one line the engine's start would print
        info["error"] = f"{type(err).__name__}: {err}"
        ours = None
    if ours is not None:
        vllm_layers = _build(e, job, config, plugin=False)
        for lid, layer in ours.items():  # (see the module's docstring)
            one_wkv_input(layer, vllm_layers[lid])
        info["classes"] = sorted({type(m).__name__ for m in ours.values()})
        info["tiers"] = [m.embed_tokens.rows.table.tier.name for m in ours.values()]
        info["split"] = {
            str(lid): [m.embed_tokens.head_start, m.embed_tokens.vocab_start_idx,
                       m.embed_tokens.vocab_end_idx] for lid, m in ours.items()
        }  # fmt: skip
        for name in job["batches"]:
            ids, hidden = inp[f"{name}/ids"], inp[f"{name}/hidden"]
            m = mask if name == "model" else None
            _step(vllm_layers, ids, hidden, m, out, f"vllm/{name}")
            _step(ours, ids, hidden, m, out, f"plestore/{name}")
    save_file({k: v.contiguous() for k, v in out.items()}, work / f"out-{rank}.safetensors")
    (work / f"out-{rank}.json").write_text(json.dumps(info))
    from vllm.distributed import parallel_state as ps

    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
