"""The static checks: ruff over the repository and mypy over the package, both clean.

Both read their configuration from pyproject.toml (``[tool.ruff]``, ``[tool.mypy]``), so
what runs here is what ``ruff check`` and ``mypy`` run from the repository root.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow  # two subprocesses; mypy takes ~30 s without its cache


def run(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m <args>`` from the repository root, with the test's own interpreter."""
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=False)


def test_ruff_finds_nothing() -> None:
    done = run("ruff", "check", "--output-format", "concise")
    assert done.returncode == 0, f"ruff check failed:\n{done.stdout}{done.stderr}"


def test_mypy_finds_nothing() -> None:
    done = run("mypy")
    assert done.returncode == 0, f"mypy failed:\n{done.stdout}{done.stderr}"
    assert "Success: no issues found" in done.stdout, done.stdout


def test_both_read_the_configuration(tmp_path: Path) -> None:
    """The clean runs above mean something: each tool took pyproject.toml's settings."""
    settings = run("ruff", "check", "--show-settings", "epd_trio/__init__.py")
    assert "linter.line_length = 120" in settings.stdout, settings.stdout[-2000:] + settings.stderr
    # An untyped def is an error only under the configuration's disallow_untyped_defs.
    probe = tmp_path / "probe.py"
    probe.write_text("def f(x):\n    return x\n")
    untyped = run("mypy", str(probe))
    assert untyped.returncode == 1 and "[no-untyped-def]" in untyped.stdout, untyped.stdout + untyped.stderr
