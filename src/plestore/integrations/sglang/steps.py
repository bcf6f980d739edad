"""SGLang's scheduler around each step, where plestore serves tables in the process (the
vLLM plugin's `steps.py`, through SGLang's HookRegistry):

- BEFORE `TpModelWorker.forward_batch_generation` (before the step's graph replays): every
  graph feed's host side woken from its sleep between polls (`wake_feeds`);
- BEFORE the batch result processor's decode and prefill results: the step's copy of its
  sampled tokens synchronised (the event the processor synchronises first itself; a second
  synchronize returns at once), then every feed checked (`check_feeds`): a step whose host side
  failed or whose rows did not come raises FeedError naming the table and the cause before any
  of its tokens is appended to a request or streamed.
"""

from __future__ import annotations

from plestore.lookup.graphfeed import check_feeds, wake_feeds

__all__ = ["HOOKS", "checked_result", "woken_step"]

_RESULTS = "sglang.srt.managers.scheduler_components.batch_result_processor"
_WORKER = "sglang.srt.managers.tp_worker.TpModelWorker"


def woken_step(*args, **kwargs) -> None:
    wake_feeds()


def checked_result(processor, batch, result, *args, **kwargs) -> None:
    copy_done = getattr(result, "copy_done", None)
    if copy_done is not None:
        copy_done.synchronize()
    check_feeds()


#: (target, hook) pairs, each a BEFORE hook
HOOKS = (
    (f"{_WORKER}.forward_batch_generation", woken_step),
    (f"{_RESULTS}.SchedulerBatchResultProcessor.process_batch_result_decode", checked_result),
    (f"{_RESULTS}.SchedulerBatchResultProcessor.process_batch_result_prefill", checked_result),
)
