"""vLLM's model runner around each step, where plestore serves tables in the process:

- as `execute_model` begins (before the step's graph replays), every graph feed's host side is
  woken from its sleep between polls (`wake_feeds`): a step after a quiet spell waits for no
  sleep to end;
- after vLLM's own sync for the step's sampled tokens and before they are returned
  (`sample_tokens`' output, or the async output's `get_output`), every feed is checked
  (`check_feeds`): a step whose host side failed or whose rows did not reach the GPU raises
  FeedError naming the table and the cause, so the engine fails that step and none of its
  tokens (sampled from NaN rows) is returned.

Both runners are wrapped where the release has them: V1's (`gpu_model_runner`, the CPU build's
runner too) and Model Runner V2's (`gpu/model_runner.py`). `install()` is idempotent and cheap
(a step with no live feed iterates an empty set).
"""

from __future__ import annotations

import functools
import threading

from plestore.integrations.contract import resolve
from plestore.lookup.graphfeed import check_feeds, wake_feeds

__all__ = ["RUNNERS", "install"]

#: (runner class, its async output class): "module:Class", V1's first
RUNNERS = (
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner",
     "vllm.v1.worker.gpu_model_runner:AsyncGPUModelRunnerOutput"),
    ("vllm.v1.worker.gpu.model_runner:GPUModelRunner",
     "vllm.v1.worker.gpu.async_utils:AsyncOutput"),
)  # fmt: skip
_lock = threading.Lock()
_done = False


def install() -> None:
    """The wake and the check around every runner this vLLM has."""
    global _done
    with _lock:
        if _done:
            return
        _done = True
        for runner, output in RUNNERS:
            runner_cls, output_cls = _find(runner), _find(output)
            if runner_cls is None or output_cls is None:
                continue  # (a release without that runner)
            runner_cls.execute_model = _waking(runner_cls.execute_model)
            runner_cls.sample_tokens = _checking(runner_cls.sample_tokens, output_cls)
            output_cls.get_output = _checked(output_cls.get_output)


def _find(target: str):
    try:
        return resolve(target)
    except (ImportError, AttributeError):
        return None


def _waking(execute_model):
    @functools.wraps(execute_model)
    def wrapper(self, *args, **kwargs):
        wake_feeds()
        return execute_model(self, *args, **kwargs)

    return wrapper


def _checking(sample_tokens, async_output):
    """sample_tokens' synced output checked (an async one is checked in its get_output)."""

    @functools.wraps(sample_tokens)
    def wrapper(self, *args, **kwargs):
        out = sample_tokens(self, *args, **kwargs)
        if out is not None and not isinstance(out, async_output):
            check_feeds()
        return out

    return wrapper


def _checked(get_output):
    @functools.wraps(get_output)
    def wrapper(self):
        out = get_output(self)
        check_feeds()  # (after the copy's sync: the step's FAILED / TIMED_OUT words are final)
        return out

    return wrapper
