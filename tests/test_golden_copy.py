from pathlib import Path

import pytest

from conftest import GOLDEN

SHARED = Path(__file__).resolve().parents[2] / "shared" / "golden"


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/golden is not beside this checkout")
def test_golden_copies_match_shared():
    names = sorted(p.name for p in SHARED.glob("*.json"))
    assert names, "shared golden folder is empty"
    for name in names:
        assert (GOLDEN / name).read_bytes() == (SHARED / name).read_bytes(), name
