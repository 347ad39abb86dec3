"""The public face: __all__ is sorted and complete."""

from __future__ import annotations

import subprocess
import sys

import pytest

import epd_trio


def test_all_is_sorted_and_complete() -> None:
    assert epd_trio.__all__ == sorted(epd_trio.__all__)
    public = {name for name in vars(epd_trio) if not name.startswith("_")} | set(epd_trio._LAZY)
    modules = {name for name in public if type(getattr(epd_trio, name)).__name__ == "module"}
    assert set(epd_trio.__all__) == public - modules
    assert all(hasattr(epd_trio, name) for name in epd_trio.__all__)
    assert dir(epd_trio) == epd_trio.__all__
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        epd_trio.nothing  # noqa: B018


def test_the_command_and_the_errors_load_without_torch() -> None:
    """``epd-trio`` watches for SIGTERM from its first seconds (the model's imports after)."""
    code = "import sys, epd_trio.cli, epd_trio.errors; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_every_error_derives_from_the_root() -> None:
    from epd_trio import errors

    for name in errors.__all__:
        obj = getattr(errors, name)
        if isinstance(obj, type):
            assert issubclass(obj, epd_trio.EPDError), name
            assert 400 <= obj.status_code <= 599


def test_no_unpickling_anywhere_in_the_package() -> None:
    import re
    from pathlib import Path

    root = Path(epd_trio.__file__).parent
    hits = [str(p) for p in root.rglob("*.py")
            if re.search(r"pickle\.loads?\(|recv_pyobj|torch\.load\(", p.read_text())]
    assert hits == []
