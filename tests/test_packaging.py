"""The installed package: every folder of `compiler/`, `passes/` and `backends/` with an
`__init__.py` is listed in pyproject.toml's packages (a folder left out installs in editable mode
and is missing from a wheel: the driver and hardware packages were split from modules)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFIXES = {"compiler": "shardc", "passes": "shardc.passes", "backends": "shardc.backends"}


def test_every_package_folder_is_listed_in_pyproject() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for folder, name in PREFIXES.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *rel)))
    missing = sorted(found - listed)
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {missing}: add them"
    assert not sorted(listed - found), f"pyproject.toml lists packages with no folder: {sorted(listed - found)}"
