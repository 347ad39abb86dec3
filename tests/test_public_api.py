"""The public face: __all__ is sorted and complete."""

from __future__ import annotations

import epd_trio


def test_all_is_sorted_and_complete() -> None:
    assert epd_trio.__all__ == sorted(epd_trio.__all__)
    public = {name for name in vars(epd_trio) if not name.startswith("_")}
    modules = {name for name in public if type(getattr(epd_trio, name)).__name__ == "module"}
    assert set(epd_trio.__all__) == public - modules
    assert all(hasattr(epd_trio, name) for name in epd_trio.__all__)


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
