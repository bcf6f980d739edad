"""The SGLang contract tests (.ci/sglang): a package, so its conftest is not the suite's
`conftest` module that other tests import names from."""
