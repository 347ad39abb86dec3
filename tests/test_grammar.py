"""Every module parses with the grammar of the oldest Python that pyproject.toml declares.

The code uses ``except*`` (3.11): a declared 3.10 would install where the package
cannot import. ``feature_version`` makes the parser refuse newer syntax.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "epd_trio").rglob("*.py"), *(ROOT / "tools").rglob("*.py")])


def declared_minimum() -> tuple[int, int]:
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    found = re.fullmatch(r">=\s*3\.(\d+)", spec.strip())
    assert found, f"requires-python {spec!r}: expected a plain '>=3.N'"
    return 3, int(found.group(1))


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(ROOT)) for p in SOURCES])
def test_parses_with_the_declared_minimum_grammar(path: Path) -> None:
    ast.parse(path.read_text(), filename=str(path), feature_version=declared_minimum())


def test_the_grammar_check_refuses_newer_syntax() -> None:
    with pytest.raises(SyntaxError):
        ast.parse("try:\n    pass\nexcept* ValueError:\n    pass\n", feature_version=(3, 10))
