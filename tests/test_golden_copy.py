"""The clone is self-contained: the golden vectors live in tests/data (with their digests), and
no product file points into the project's workspace, which a clone does not have."""

import hashlib
from pathlib import Path

from conftest import GOLDEN

ROOT = Path(__file__).resolve().parents[1]
#: the project's shared workspace, where it sits beside this checkout (a clone has none)
SHARED = ROOT.parent / "shared" / "golden"
PRODUCT = ["src", "docs", "README.md", "CONTRIBUTING.md", "pyproject.toml", "setup.py"]


def _digests() -> dict[str, str]:
    lines = (GOLDEN / "SHA256SUMS").read_text().splitlines()
    return {name: digest for digest, name in (line.split() for line in lines if line)}


def test_golden_vectors_are_in_the_repo_and_unchanged():
    digests = _digests()
    assert sorted(digests) == sorted(p.name for p in GOLDEN.glob("*.json")), "SHA256SUMS"
    for name, digest in digests.items():
        assert hashlib.sha256((GOLDEN / name).read_bytes()).hexdigest() == digest, name
    for p in SHARED.glob("*.json"):  # where the workspace is beside the checkout: no drift
        assert digests.get(p.name) == hashlib.sha256(p.read_bytes()).hexdigest(), p.name


def test_no_product_file_names_the_workspace():
    files = [f for p in PRODUCT for f in [ROOT / p, *(ROOT / p).rglob("*")]]
    named = [
        str(f.relative_to(ROOT))
        for f in files
        if f.is_file()
        and f.suffix not in (".so", ".o")
        and not any(part.endswith((".egg-info", "__pycache__")) for part in f.parts)  # built
        and b"../shared" in f.read_bytes()
    ]
    assert not named, f"these name ../shared, which a clone does not have: {named}"


def test_the_license_pyproject_names_is_in_the_repo():
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
