"""The vLLM contract job's tests (.ci/vllm-contract): a package, so its conftest is not the
suite's `conftest` module that other tests import names from."""
