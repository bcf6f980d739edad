"""The plugin's step hooks inside SGLang's own classes (integrations/sglang/steps.py): a step
wakes the graph feeds, and a step result whose host side failed raises FeedError, naming the
table, before SGLang's batch result processor appends or streams any of its tokens."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import plestore
from plestore.lookup.graphfeed import FeedError
from plestore.native.constants import W_WAKE
from tier_tables import FORMATS, ROWS, make_table


@pytest.fixture(scope="module")
def table_file(tmp_path_factory):
    return make_table(tmp_path_factory.mktemp("bf16"), "bf16", FORMATS["bf16"], block=512)


def test_a_failed_step_fails_before_its_result_is_processed(plugin, table_file):
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor,
    )
    from sglang.srt.managers.tp_worker import TpModelWorker

    path, _ = table_file
    with plestore.open_table(path, tier="mapped", device="cpu", timeout_s=5) as t:
        ids = torch.zeros(1, 4, dtype=torch.int64)
        feed = t.staged((1, 4), ids=ids, feed=True)
        wakes = int(feed.feeder.header[W_WAKE])
        with pytest.raises(Exception):  # noqa: B017 (the hook ran first; SGLang's own code fails on None)
            TpModelWorker.forward_batch_generation(None, None)
        assert int(feed.feeder.header[W_WAKE]) == wakes + 1  # woken as the step began
        ids.copy_(torch.from_numpy(np.full((1, 4), ROWS + 1)))
        feed.post()
        assert torch.isnan(feed.decode().float()).all()
        processor = object.__new__(SchedulerBatchResultProcessor)  # (touched only after the hook)
        result = SimpleNamespace(copy_done=None)
        with pytest.raises(FeedError, match=rf"table {t.spec.name}: step 1's host read failed"):
            processor.process_batch_result_decode(None, result)
