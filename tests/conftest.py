"""Shared fixtures: golden vectors, device parametrisation, bit-exact comparison helpers."""

from __future__ import annotations

import json
import os
from pathlib import Path

# The tests run offline: no hub downloads, and no hub kernels (transformers >= 5.x looks up
# kernels-community/* through the `kernels` package where it is installed). Set before anything
# imports transformers, which reads these at import in some releases; docs/transformers.md.
OFFLINE = {"HF_HUB_OFFLINE": "1", "USE_HUB_KERNELS": "0"}
os.environ.update(OFFLINE)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

GOLDEN = Path(__file__).parent / "data"

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA GPU (CI has none; run on the H200 test machine)"
)


def pytest_runtest_logreport(report) -> None:
    """-ra's summary: one SKIPPED line per reason (`needs a CUDA GPU` once, not per test line)."""
    if report.skipped and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        report.longrepr = (str(Path(__file__).parent), None, report.longrepr[2])


def load_golden(name: str) -> dict:
    return json.loads((GOLDEN / name).read_text())


def devices() -> list:
    """torch devices to test: cpu always, cuda where present (the cuda case skips in CI)."""
    return ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.gpu])]


def as_bits(x) -> np.ndarray:
    """float values (torch bf16 / fp16 / fp32, or float32 arrays) -> their float32 bit patterns
    (every bf16 and fp16 value is exact in float32), with every NaN mapped to one canonical
    pattern (payloads may differ across backends)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().float().cpu().numpy()
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32).copy()
    bits[np.isnan(x)] = 0x7FC00000
    return bits


def assert_bit_identical(a, b) -> None:
    ba, bb = as_bits(a), as_bits(b)
    assert ba.shape == bb.shape, (ba.shape, bb.shape)
    bad = np.argwhere(ba != bb)
    if bad.size:
        i = tuple(bad[0])
        raise AssertionError(
            f"{len(bad)} of {ba.size} values differ; first at {list(i)}: "
            f"{ba[i]:#010x} vs {bb[i]:#010x}; others at {[b.tolist() for b in bad[1:6]]}"
        )


#: Test-sized scale per preset family: tables of 1.5-6 MB that still have every shard.
SMALL_BASES = {"qwen": 1000, "deepseek": 500, "gemma": 300}
#: (preset, format) of every table kind synth writes, for round-trip parametrisation.
ALL_KINDS = [
    ("qwen3.8-flash-next", "fp8_e4m3"),
    ("qwen3.8-flash-next", "nvfp4"),
    ("qwen3.8-flash-next", "bf16"),
    ("deepseek-v4.1-flash", "fp8_ue8m0"),
    ("gemma3n-e2b", "bf16"),
]


@pytest.fixture(scope="session")
def small_checkpoint(tmp_path_factory):
    """make(preset, format, **synth kwargs) -> a cached small synthetic checkpoint directory.

    Shared across tests: copy it (shutil.copytree) before changing anything in it."""
    cache: dict = {}

    def make(preset: str, format: str | None = None, **kw):
        key = (preset, format, tuple(sorted(kw.items())))
        if key not in cache:
            from plestore.checkpoint import synth_checkpoint

            base = next(v for k, v in SMALL_BASES.items() if preset.startswith(k))
            kw.setdefault("ngram_vocab_size_base", base)
            kw.setdefault("hidden_size", 64)
            out = tmp_path_factory.mktemp("ckpt")
            synth_checkpoint(out, preset, format, **kw)
            cache[key] = out
        return cache[key]

    return make


#: the host core's two implementations (plestore.native): its numpy reference and the compiled
#: one (built in place by `python3 setup.py build_ext --inplace`, by pip install)
requires_native = pytest.mark.skipif(
    not __import__("plestore.native").native.available(),
    reason="plestore's native core is not built (python3 setup.py build_ext --inplace)",
)
HOST_CORES = ["reference", pytest.param("native", marks=requires_native)]


def pytest_generate_tests(metafunc):
    """The tier conformance tests (every test of a tiers or staged module taking `tier`) run
    against both host cores: the same rows, bit for bit, from either."""
    module = metafunc.module.__name__.rpartition(".")[2]
    if "tier" in metafunc.fixturenames and module.startswith(("test_tier", "test_staged")):
        metafunc.parametrize("host_core", HOST_CORES, indirect=True)


@pytest.fixture(autouse=True)
def host_core(request):
    """The host core of the tables a test opens (`plestore.defaults`' native): off (reference)
    or on (native) where the test is parametrised over HOST_CORES; the default (auto)
    elsewhere. Whatever a test sets in the defaults is undone after it."""
    import plestore

    mode = getattr(request, "param", None)
    if mode == "native" and request.node.callspec.params.get("tier") == "device":
        pytest.skip("the device tier has no host path")
    native = {} if mode is None else {"native": "on" if mode == "native" else "off"}
    with plestore.defaults.set(**native):
        yield mode
