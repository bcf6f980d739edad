"""The contract job's fixtures (.ci/vllm-contract): the installed vLLM release's adapter, and a
one-process vLLM world (its distributed state with TP = ETP = 1, gloo) for building vLLM's
modules on CPU tensors."""

from __future__ import annotations

import os
import socket

import pytest


@pytest.fixture(scope="session")
def release():
    """The installed vLLM's adapter; the job names the release it put on the path."""
    import vllm

    from plestore.integrations.vllm import current_release
    from plestore.integrations.vllm.releases import release_line

    expected = os.environ.get("CONTRACT_VLLM_RELEASE")
    if expected:
        assert release_line(vllm.__version__) == release_line(expected), vllm.__file__
    return current_release()


def cpu_config():
    """A VllmConfig on the CPU device (a CUDA build here finds no platform of its own)."""
    from vllm.config import DeviceConfig, VllmConfig

    return VllmConfig(device_config=DeviceConfig(device="cpu"))


@pytest.fixture(scope="session")
def vllm_world():
    """vLLM's parallel state for one process (what its modules' constructors ask for); yields
    cpu_config, for the modules built under it."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(cpu_config()):
        ps.init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=0,
            backend="gloo",
        )
        ps.initialize_model_parallel(1, 1)
    yield cpu_config
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()
