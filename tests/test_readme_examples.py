"""Every ```python block of every README runs, so the documented examples cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
READMES = [ROOT / "README.md", *sorted(ROOT.glob("packages/*/README.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _examples() -> list[tuple[str, str]]:
    found = []
    for readme in READMES:
        for index, match in enumerate(BLOCK.finditer(readme.read_text())):
            found.append((f"{readme.relative_to(ROOT)}#{index}", match.group(1)))
    return found


def test_every_package_readme_has_an_example() -> None:
    documented = {name.split("#")[0] for name, _ in _examples()}
    for readme in READMES[1:]:
        assert str(readme.relative_to(ROOT)) in documented, f"{readme} has no python example"


@pytest.mark.parametrize(("name", "code"), _examples(), ids=[n for n, _ in _examples()])
def test_readme_example_runs(name: str, code: str) -> None:
    exec(compile(code, name, "exec"), {"__name__": "__readme__"})
