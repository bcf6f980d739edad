"""This CI machine's shims for the SGLang job (.ci/sglang; not the product's, and not SGLang's
either: SGLang runs on a GPU, CI has none). On the job's PYTHONPATH, so every process SGLang
starts (scheduler, detokenizer; spawned) gets them too. Each shim says why it exists; the list
and its reasons are in tests/sglang_job/README.md."""

import glob
import importlib.util
import os


def _define_missing_torchvision_ops() -> None:
    """PyPI's torchvision is CUDA-linked: its compiled ops do not load beside the CPU torch, and
    its fake-kernel registrations then fail at import ("operator torchvision::nms does not
    exist"); transformers' image utilities (Qwen4-Exp's processor, its vision model) import it.
    Defining the two op schemas first, only where the compiled ops do not load, lets the
    pure-Python parts import."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    import torch

    for so in glob.glob(os.path.join(spec.submodule_search_locations[0], "_C*.so")):
        try:
            torch.ops.load_library(so)
            return  # a working build: nothing to do
        except (OSError, RuntimeError):
            pass
    lib = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    globals()["_torchvision_ops"] = lib  # kept alive for the process


_define_missing_torchvision_ops()


# -- patches applied right after a module is first imported ----------------------------------------

_AFTER_IMPORT: dict = {}  # module name -> [fn(module)]


class _AfterImportFinder:
    """A meta-path finder that finds nothing itself: for a watched module it wraps the loader
    that the other finders return, so the patch runs once the module has executed."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name not in _AFTER_IMPORT:
            return None
        import sys

        for finder in sys.meta_path:
            if finder is _AfterImportFinder:
                continue
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def run_then_patch(module, _exec=exec_module):
                    _exec(module)
                    for fn in _AFTER_IMPORT[name]:
                        fn(module)

                spec.loader.exec_module = run_then_patch
                return spec
        return None


def after_import(name: str, fn) -> None:
    import sys

    _AFTER_IMPORT.setdefault(name, []).append(fn)
    if name in sys.modules:
        fn(sys.modules[name])
    elif _AfterImportFinder not in sys.meta_path:
        sys.meta_path.insert(0, _AfterImportFinder)


def _gdn_in_torch(module) -> None:
    """FLA's chunk_gated_delta_rule under Triton 3.8's interpreter gives wrong GDN states and
    NaN decodes: SGLang's Triton GDN kernel runs tests/sglang_job/gdn_torch.py's recurrence,
    the same in every engine of the job."""
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.append(os.path.join(here, "..", "..", "tests", "sglang_job"))
    import gdn_torch

    gdn_torch.install(module)


after_import("sglang.srt.layers.attention.linear.kernels.gdn_triton", _gdn_in_torch)


def _fla_sm_count(module) -> None:
    """FLA's gated RMSNorm sizes its launch grid by the GPU's SM count, which it reads through
    torch.cuda.get_device_properties (no CUDA in a CPU torch): one "SM" here (the grid's size
    changes how many rows a program takes, not the values)."""
    module._get_sm_count = lambda device: 1


after_import("sglang.kernels.ops.attention.fla.layernorm_gated", _fla_sm_count)


def _cpu_device_context() -> None:
    """SGLang's device_context and FLA's input_guard enter `torch.get_device_module(t.device)
    .device(index)` around Triton launches; for a CPU tensor that is torch.cpu, which has no
    `device` context (a CPU has nothing to switch): one that does nothing."""
    import contextlib

    import torch

    if not hasattr(torch.cpu, "device"):
        torch.cpu.device = lambda index=None: contextlib.nullcontext()


_cpu_device_context()


def _interpreter_bf16_by_value(interp) -> None:
    """Triton's interpreter (TRITON_INTERPRET=1: how SGLang's Triton kernels run on a CPU)
    stores bfloat16 as its uint16 bit pattern and runs numpy's ops on that storage: bf16
    products, sums, dots, comparisons and reductions come out as integer arithmetic on the
    bits (NaN or 1e10-sized values; "not supported" per Triton's docs, triton-lang/triton
    #10945 / #11584 / #11604 unmerged). Computing those ops on the values, in float32 and
    rounded back to bf16 (round to nearest even) as a GPU does, makes the kernels right: the
    causal convolution, the gated RMSNorm and the fused MoE of a bf16 model included."""
    import numpy as np

    tl = interp.tl
    TensorHandle, Builder, Reduce = interp.TensorHandle, interp.InterpreterBuilder, interp.ReduceOps

    def is_bf16(h):
        return h.dtype.scalar == tl.bfloat16 and h.data.dtype == np.uint16

    def value(h):
        return (h.data.astype(np.uint32) << 16).view(np.float32)

    def bits(x):
        x = np.asarray(x, dtype=np.float32)
        u = x.view(np.uint32)
        rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)

    def back(out):  # a float result in bf16, a comparison's in int1
        if out.dtype == np.bool_:
            return TensorHandle(out, tl.int1)
        return TensorHandle(bits(out), tl.bfloat16)

    binary_op, unary_op, ternary_op = Builder.binary_op, Builder.unary_op, Builder.ternary_op
    fma, rsqrt, erf, dot, cast = (
        Builder.create_fma,
        Builder.create_rsqrt,
        Builder.create_erf,
        Builder.create_dot,
        Builder.cast_impl,
    )

    def binary_op_(self, lhs, rhs, op):
        if is_bf16(lhs) and is_bf16(rhs):
            return back(op(value(lhs), value(rhs)))
        return binary_op(self, lhs, rhs, op)

    def unary_op_(self, arg, op):
        return back(op(value(arg))) if is_bf16(arg) else unary_op(self, arg, op)

    def ternary_op_(self, a, b, c, op):
        if op is np.clip and is_bf16(a):
            return back(op(value(a), value(b), value(c)))
        return ternary_op(self, a, b, c, op)

    def fma_(self, x, y, z):
        if is_bf16(x) and is_bf16(y) and is_bf16(z):
            return back(value(x) * value(y) + value(z))
        return fma(self, x, y, z)

    def rsqrt_(self, arg):
        return back(1 / np.sqrt(value(arg))) if is_bf16(arg) else rsqrt(self, arg)

    def erf_(self, arg):
        if is_bf16(arg):
            return back(erf(self, TensorHandle(value(arg), tl.float32)).data)
        return erf(self, arg)

    def dot_(self, a, b, d, input_precision, max_num_imprecise_acc):
        if is_bf16(a) or is_bf16(b):
            a = TensorHandle(value(a), tl.float32) if is_bf16(a) else a
            b = TensorHandle(value(b), tl.float32) if is_bf16(b) else b
            if is_bf16(d):
                out = dot(
                    self,
                    a,
                    b,
                    TensorHandle(value(d), tl.float32),
                    input_precision,
                    max_num_imprecise_acc,
                )
                return back(out.data)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_(self, src, dst_type):
        if is_bf16(src) and dst_type.scalar != tl.float32:
            src = TensorHandle(value(src), tl.float32)
        return cast(self, src, dst_type)

    Builder.binary_op, Builder.unary_op, Builder.ternary_op = binary_op_, unary_op_, ternary_op_
    Builder.create_fma, Builder.create_rsqrt, Builder.create_erf = fma_, rsqrt_, erf_
    Builder.create_dot, Builder.cast_impl = dot_, cast_

    reduce_sum, reduce_min_max = Reduce.sum, Reduce.min_max

    def sum_(self, input):
        if is_bf16(input.handle):
            total = np.sum(value(input.handle), axis=self.axis, keepdims=self.keep_dims)
            return self.to_tensor(bits(total), input.dtype)
        return reduce_sum(self, input)

    def min_max_(self, input, val_reduce_op, idx_reduce_op=None):
        x = input[0] if isinstance(input, tuple) else input
        if is_bf16(x.handle):
            v = value(x.handle)
            val = idx = None
            if val_reduce_op:
                val = self.to_tensor(
                    bits(val_reduce_op(v, axis=self.axis, keepdims=self.keep_dims)), x.dtype
                )
            if idx_reduce_op:
                idx = self.to_tensor(
                    idx_reduce_op(v, axis=self.axis, keepdims=self.keep_dims), tl.int32
                )
            return (
                (val, idx) if val is not None and idx is not None else (val if idx is None else idx)
            )
        return reduce_min_max(self, input, val_reduce_op, idx_reduce_op)

    Reduce.sum, Reduce.min_max = sum_, min_max_


after_import("triton.runtime.interpreter", _interpreter_bf16_by_value)


def _autotune_without_benchmarks(autotuner) -> None:
    """Triton's autotuner times every candidate config on the first call of each shape; in the
    interpreter that needs a GPU driver ("0 active drivers") or runs the kernel in Python many
    times, measuring nothing of a GPU: the first candidate runs, untimed."""
    bench = autotuner.Autotuner._bench

    def first_config(self, *args, config, **meta):
        if os.environ.get("TRITON_INTERPRET") == "1":
            return [0.0, 0.0, 0.0]
        return bench(self, *args, config=config, **meta)

    autotuner.Autotuner._bench = first_config


after_import("triton.runtime.autotuner", _autotune_without_benchmarks)


def _cuda_streams_on_cpu() -> None:
    """Qwen4-Exp's PLE offload (`ple_offload_embedding`, the Qwen4ExpPinnedHostEmbedding path
    a plugin hooks) prefetches each layer's rows on a side `torch.cuda.Stream`; a CPU torch has
    none and raises at construction. On a CPU one stream is all there is: streams whose waits
    and switches do nothing (only where CUDA is absent)."""
    import contextlib

    import torch

    if torch.cuda.is_available():
        return

    class CpuStream:
        def __init__(self, *args, **kwargs):
            pass

        def wait_stream(self, other):
            pass

        def wait_event(self, event):
            pass

        def record_event(self, event=None):
            return event

        def synchronize(self):
            pass

        def query(self):
            return True

    torch.cuda.Stream = CpuStream
    torch.cuda.current_stream = lambda device=None: CpuStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.Tensor.record_stream = lambda self, stream: None


if os.environ.get("TRITON_INTERPRET") == "1":
    _cuda_streams_on_cpu()
