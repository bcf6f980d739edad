"""vLLM's own Triton kernels of the Qwen4Exp ops, run on the CPU by Triton's interpreter, beside
plestore's torch versions (integrations/vllm/cpu_ops.py) on the same random inputs. Run as a
script (the interpreter and the real-triton rebinding must precede every vLLM import, so they
stay out of the test process); prints one JSON line per op:
{"op", "dtype", "max_rel", "values"}: the largest difference relative to max(|value|, 1)."""

import json
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import vllm.triton_utils as vllm_triton  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

vllm_triton.triton, vllm_triton.tl = triton, tl  # the CPU build has a placeholder there


def _bool_masks(access, at: int):
    """The interpreter takes only boolean masks; `int_arg & bool_tensor` (ple_conv's
    has_token_map, has_init) makes an integer one, which a GPU compiles as a truth value."""

    def masked(self, *args):
        args = list(args)
        args[at] = interpreter.TensorHandle(args[at].data.astype(bool), tl.int1)
        return access(self, *args)

    return masked


builder = interpreter.InterpreterBuilder
builder.create_masked_load = _bool_masks(builder.create_masked_load, 1)  # (ptrs, mask, ...)
builder.create_masked_store = _bool_masks(builder.create_masked_store, 2)  # (ptrs, value, mask)

from vllm.models.qwen4_exp.common.ops import ple as vllm_ple  # noqa: E402
from vllm.models.qwen4_exp.nvidia.ops import hc as vllm_hc  # noqa: E402

from plestore.integrations.vllm import cpu_ops  # noqa: E402

T, H, HC, EPS = 7, 64, 2, 1e-6


def report(op: str, theirs, ours) -> None:
    theirs = (theirs,) if torch.is_tensor(theirs) else theirs
    ours = (ours,) if torch.is_tensor(ours) else ours
    worst, n = 0.0, 0
    for a, b in zip(theirs, ours, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (op, a.shape, b.shape)
        rel = (a.double() - b.double()).abs() / a.double().abs().clamp_min(1.0)
        worst, n = max(worst, float(rel.max())), n + a.numel()
    dtype = str(theirs[0].dtype).removeprefix("torch.")
    print(json.dumps({"op": op, "dtype": dtype, "max_rel": worst, "values": n}))


def hc_ops(dtype: torch.dtype) -> None:
    x = torch.randn(T, HC * H, dtype=dtype)
    g = torch.randn(T, HC * H, dtype=dtype)
    block = torch.randn(T, H, dtype=dtype)
    inj = torch.randn(T, HC, dtype=dtype)
    for w in (torch.randn(H, dtype=dtype), torch.randn(HC * H, dtype=dtype)):
        report(
            f"grouped_gemma_rmsnorm[{w.numel()}]",
            vllm_hc._grouped_gemma_rmsnorm(x, w, EPS, HC),
            cpu_ops.grouped_gemma_rmsnorm(x, w, EPS, HC),
        )
        for j in (None, inj):
            name = f"hc_combine_norm[{w.numel()},{'inj' if j is not None else '-'}]"
            report(
                name,
                vllm_hc._hc_combine_norm(x, block, j, w, EPS, HC),
                cpu_ops.hc_combine_norm(x, block, j, w, EPS, HC),
            )
    report("hc_silu", vllm_hc._hc_silu(x, HC), cpu_ops.hc_silu(x, HC))
    report("hc_gate_mix", vllm_hc._hc_gate_mix(x, g, HC), cpu_ops.hc_gate_mix(x, g, HC))
    for j in (None, inj):
        report(
            f"hc_combine[{'inj' if j is not None else '-'}]",
            vllm_hc._hc_combine(x, block, j, HC),
            cpu_ops.hc_combine(x, block, j, HC),
        )


def gate() -> None:
    dt = torch.bfloat16
    kv = torch.randn(T, HC * H + H, dtype=dt)
    key, value = kv[:, : HC * H], kv[:, HC * H :]  # strided views, as vLLM passes them
    hidden = torch.randn(T, HC * H, dtype=dt)
    ws = [torch.randn(HC * H, dtype=dt) * 0.1 for _ in range(3)]
    report(
        "ple_gate",
        vllm_ple._ple_gate(key, value, hidden, *ws, EPS),
        cpu_ops.ple_gate(key, value, hidden, *ws, EPS),
    )


def conv(dt: torch.dtype, mode: str, fused: bool, mapped: bool) -> None:
    c, k, d = 96, 4, 3
    state_len = (k - 1) * d
    qsl = torch.tensor([0, 5, 5, 12, 13], dtype=torch.int32)  # an empty request among them
    reqs = qsl.numel() - 1
    n = int(qsl[-1]) if mode == "prefill" else reqs
    rows = n + 2 if mode == "prefill" else n  # prefill: two padded rows past the batch
    x = torch.randn(rows, c, dtype=dt)
    residual = torch.randn(rows, c, dtype=dt)
    outer = torch.randn(rows, c, dtype=dt) if fused else None
    w = torch.randn(c, k, dtype=dt) * 0.5
    slots = torch.tensor([3, 1, 0, 2][:reqs], dtype=torch.int32)  # slot 0: the null slot
    init = torch.tensor([True, False, True, True][:reqs])
    state = torch.randn(5, state_len + 2, c, dtype=dt).transpose(1, 2)  # [slot, C, W] strided
    token_indices = torch.randperm(rows)[:n] if mapped else None
    outs = []
    for fn in (vllm_ple.ple_conv, cpu_ops.ple_conv):
        res, st = residual.clone(), state.clone()
        kw = dict(mode=mode, dilation=d, has_initial_states=init, token_indices=token_indices)
        if mode == "prefill":
            kw["query_start_loc"] = qsl
        fn(x, res, st, w, slots, outer, **kw)
        outs.append((res, st))
    name = f"ple_conv[{mode},{'fused' if fused else 'plain'},{'mapped' if mapped else 'rows'}]"
    report(name, outs[0], outs[1])


if __name__ == "__main__":
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        hc_ops(dtype)
        for mode in ("prefill", "decode"):
            for fused in (False, True):
                for mapped in (False, True):
                    conv(dtype, mode, fused, mapped)
    gate()
