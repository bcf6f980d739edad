"""The oldest release of a requirement that pyproject.toml declares (`name>=X` in the test
extra), for .ci/run's job at that release: `python3 .ci/oldest.py transformers` -> 5.17."""

import re
import sys
import tomllib
from pathlib import Path

name = sys.argv[1]
pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
for req in pyproject["project"]["optional-dependencies"]["test"]:
    m = re.fullmatch(rf"{re.escape(name)}>=([0-9.]+)(,.*)?", req.replace(" ", ""))
    if m:
        print(m.group(1))
        break
else:
    sys.exit(f"pyproject.toml's test extra declares no {name}>=")
