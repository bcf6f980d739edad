"""`measure_divergence(model_a, model_b, prompts)`: how far two models' outputs are apart —
the number to report when a lossy table format (fp8_e4m3, nvfp4) is opted into."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["measure_divergence"]


def _prompts(prompts_ids: Any) -> list[torch.Tensor]:
    if isinstance(prompts_ids, torch.Tensor):
        prompts_ids = [prompts_ids] if prompts_ids.dim() == 1 else list(prompts_ids)
    out = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in prompts_ids]
    if not out or any(p.numel() == 0 for p in out):
        raise ValueError("measure_divergence needs at least one non-empty prompt")
    return out


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def measure_divergence(
    model_a: nn.Module,
    model_b: nn.Module,
    prompts_ids: Sequence[Any] | torch.Tensor,
    max_new_tokens: int = 16,
) -> dict:
    """Run each prompt (a 1-D sequence of token ids) through both models, one at a time.

    Returns, over every prompt position: max / mean absolute logit error and its ratio to the
    mean |logit| of model_a, and how often the argmax agrees; over greedy generation of
    `max_new_tokens`: how many prompts give the same continuation, the fraction of generated
    tokens that agree position by position, and the first position where each prompt diverged.
    """
    prompts = _prompts(prompts_ids)
    max_err, sum_err, sum_ref, n_vals, argmax_same, n_pos = 0.0, 0.0, 0.0, 0, 0, 0
    exact, tok_same, tok_total, first_diff = 0, 0, 0, []
    for p in prompts:
        ids_a = p[None].to(_device(model_a))
        la = model_a(input_ids=ids_a).logits.float()
        lb = model_b(input_ids=p[None].to(_device(model_b))).logits.float().to(la.device)
        err = (la - lb).abs()
        max_err = max(max_err, float(err.max()))
        sum_err += float(err.sum())
        sum_ref += float(la.abs().sum())
        n_vals += err.numel()
        argmax_same += int((la.argmax(-1) == lb.argmax(-1)).sum())
        n_pos += la.shape[1]
        kw = {"max_new_tokens": max_new_tokens, "do_sample": False, "min_new_tokens": 0}
        ga = model_a.generate(ids_a, **kw)[0, p.numel() :].cpu()
        gb = model_b.generate(p[None].to(_device(model_b)), **kw)[0, p.numel() :].cpu()
        n = min(len(ga), len(gb))
        same = (ga[:n] == gb[:n]).tolist() + [False] * (max(len(ga), len(gb)) - n)
        exact += all(same)
        tok_same += sum(same)
        tok_total += len(same)
        first_diff.append(None if all(same) else same.index(False))
    mean_err = sum_err / n_vals
    return {
        "prompts": len(prompts),
        "positions": n_pos,
        "max_abs_logit_error": max_err,
        "mean_abs_logit_error": mean_err,
        "mean_abs_logit": sum_ref / n_vals,
        "relative_mean_logit_error": mean_err / (sum_ref / n_vals) if sum_ref else 0.0,
        "argmax_agreement": argmax_same / n_pos,
        "greedy_exact_prompts": exact,
        "greedy_exact_fraction": exact / len(prompts),
        "greedy_token_agreement": tok_same / tok_total if tok_total else 1.0,
        "greedy_first_divergence": first_diff,
        "max_new_tokens": max_new_tokens,
    }
