"""The plugin's step hooks (integrations/vllm/steps.py) on the installed release's real model
runner classes: every runner the release has is wrapped, and V1's synced sample_tokens output
raises FeedError, naming the table, when a feed's step failed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="the contract job's venvs have vLLM (.ci/vllm-contract)")

import plestore
from plestore.integrations.contract import resolve
from plestore.integrations.vllm import steps
from plestore.lookup.graphfeed import FeedError
from tier_tables import FORMATS, ROWS, make_table


def _present(target: str):
    try:
        return resolve(target)
    except (ImportError, AttributeError):
        return None


def test_every_runner_of_this_release_is_wrapped(release):
    steps.install()
    found = 0
    for runner, output in steps.RUNNERS:
        runner_cls, output_cls = _present(runner), _present(output)
        if runner_cls is None:
            continue
        found += 1
        assert output_cls is not None, output
        for fn in (runner_cls.execute_model, runner_cls.sample_tokens, output_cls.get_output):
            assert hasattr(fn, "__wrapped__"), fn
    assert found, f"vLLM {release.version} has none of {[r for r, _ in steps.RUNNERS]}"


def test_a_failed_feed_fails_v1s_synced_sample_tokens(release, tmp_path):
    if not release.v1_runner:
        pytest.skip(f"vLLM {release.version} has no V1 model runner")
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    steps.install()
    runner = object.__new__(GPUModelRunner)  # (a step with nothing to sample: its own output)
    runner.execute_model_state, runner.kv_connector_output = None, None
    runner.use_async_scheduling = False
    path, _ = make_table(tmp_path, "bf16", FORMATS["bf16"], block=512)
    with plestore.open_table(path, tier="mapped", device="cpu", timeout_s=5) as t:
        ids = torch.zeros(1, 4, dtype=torch.int64)
        feed = t.staged((1, 4), ids=ids, feed=True)
        assert runner.sample_tokens(None) is not None  # no failure: the output returned
        ids.copy_(torch.from_numpy(np.full((1, 4), ROWS + 1)))
        feed.post()
        feed.decode()
        with pytest.raises(FeedError, match=rf"table {t.spec.name}: step 1's host read failed"):
            runner.sample_tokens(None)
