"""Stock SGLang 0.5.23 (sglang.Engine, device="cpu", under the CI shims) serves the tiny Qwen4-Exp
checkpoints with transformers' greedy tokens: four concurrent prompts (EOS inside two, one
prefilled in two chunks), 16 tokens each, bf16 and FP8 tables. The ground of the plugin's
end-to-end tests: tokens(stock) == tokens(plestore, tier X) on the same engine."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", reason="the SGLang job's venv has SGLang (.ci/sglang)")

from sglang_fixtures import KINDS, checkpoints, stock  # noqa: E402, F401 (fixtures)
from sglang_models import NEW_TOKENS, PROMPTS  # noqa: E402

#: a token SGLang (bf16) picks where float32 transformers ranks another first must be within
#: this of its logit (a near-tie: the tiny random models' logits lie within ~0.1 of each other)
NEAR_TIE = 5e-3


@pytest.mark.parametrize("kind", KINDS)
def test_stock_sglang_equals_transformers(kind, checkpoints, stock):
    """Every token SGLang picks is float32 transformers' argmax, or within NEAR_TIE of it."""
    from sglang_models import greedy_ties, reference_model

    tokens = stock[kind].tokens
    assert [len(t) for t in tokens] == [NEW_TOKENS] * len(PROMPTS)
    checked, ties = greedy_ties(reference_model(checkpoints(kind)), PROMPTS, tokens)
    assert checked == len(PROMPTS) * NEW_TOKENS
    assert all(gap < NEAR_TIE for *_, gap in ties), ties
    assert len(ties) <= checked // 16, ties  # rare: the others are equal


def test_tensor_parallel_engine_equals_one_rank(stock):
    """TP2 on gloo (each rank one core; the GDN recurrence in both ranks) gives TP1's tokens."""
    run = stock["bf16-tp2"]
    assert run.tokens == stock["bf16"].tokens
    assert run.log.count("gdn_torch: TritonGDNKernel runs the torch recurrence") == 2
    assert "TP1] Load weight end" in run.log


def test_sglang_ple_offload_equals_its_device_table(stock):
    """SGLang's PLE offload (file backend: its host table, gather kernel and prefetch stream on
    the CPU) gives the tokens of the table in the model's memory."""
    run = stock["bf16-offload"]
    assert run.tokens == stock["bf16"].tokens
    assert run.log.count("PLE table: file-backed mmap") == 2  # (a table a PLE layer)


@pytest.mark.parametrize("kind", KINDS)
def test_engine_ran_as_the_job_sets_it_up(kind, stock):
    """The GDN recurrence in torch (in the scheduler process), the model SGLang's own class,
    plestore's entry point installed (SGLang logs plugins before it configures logging: only a
    failing one shows, as logger.exception reaches stderr)."""
    from importlib.metadata import entry_points

    log = stock[kind].log
    assert "gdn_torch: TritonGDNKernel runs the torch recurrence" in log
    assert "type=Qwen4ExpForConditionalGeneration" in log
    plugins = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert plugins.get("plestore") == "plestore.integrations.sglang:register"
    assert "Failed to execute general plugin" not in log
    assert "Failed to load plugin" not in log
