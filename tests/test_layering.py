"""The house's layering, read from the package's own imports (docs/architecture.md, Layering).

Every ``import`` and ``from ... import`` in ``epd_trio/`` counts, wherever it
sits: at module level, inside a function, under ``TYPE_CHECKING``. A module
belongs to its part, the first name under ``epd_trio`` (``epd_trio.engine.cache``
is ``engine``; ``epd_trio.config`` is ``config``). Each rule names what a part
must not import; the test lists every violation as ``file:line``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "epd_trio"

# part → the parts it must not import (lower layers never reach up).
FORBIDDEN: dict[str, frozenset[str]] = {
    "protocol": frozenset({"transport", "encoder", "client", "bootstrap", "proxy"}),
    "model": frozenset({"encoder", "transport", "client", "proxy"}),
    "scheduling": frozenset({"encoder", "transport", "client", "proxy"}),
    "transport": frozenset({"encoder", "client", "proxy"}),
    "client": frozenset({"encoder", "proxy"}),
    # An encoder's registration with a registry may live in bootstrap/: the encoder imports it.
    "bootstrap": frozenset({"encoder", "client", "proxy"}),
    "engine": frozenset({"encoder", "transport", "client", "bootstrap", "proxy"}),
    "delivery": frozenset({"encoder", "client", "proxy"}),
    # The proxy reaches encoders over HTTP only, through the client.
    "proxy": frozenset({"encoder", "engine", "model", "scheduling", "delivery"}),
}

# The base: these import no other epd_trio module but each other.
BASE = frozenset({"errors", "config", "_options", "_util", "_version"})
BASE_MAY_IMPORT = frozenset({"errors", "_options", "_util", "_version"})
# The one module above the base that the base may use: the encoder-URL rule, which
# configuration checks its URLs with. It must itself stay a leaf (see the test below).
BASE_MAY_IMPORT_MODULES = frozenset({"epd_trio.protocol.urls"})

# Known violations in code other work is moving right now, as (file, imported module).
# Each is named so that it cannot hide another; remove an entry when its move lands
# (``test_known_exceptions_are_still_needed`` says when).
KNOWN_EXCEPTIONS: frozenset[tuple[str, str]] = frozenset()


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, module: str, is_package: bool, known: set[str]) -> Iterator[str]:
    """The modules one import statement names (``from a import b`` names a, and a.b if a module)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        if node.level:  # relative: resolve against this module's package
            base = module.split(".")
            base = base[:len(base) - node.level + (1 if is_package else 0)]
            target = ".".join([*base, node.module] if node.module else base)
        else:
            target = node.module or ""
        yield target
        yield from (f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known)


def _part(module: str) -> str | None:
    """``epd_trio.x.y`` → ``x``; the package root (the public face, above all) → ``epd_trio``."""
    names = module.split(".")
    if names[0] != "epd_trio":
        return None
    return names[1] if len(names) > 1 else "epd_trio"


def _known_modules() -> set[str]:
    return {_module_name(p) for p in PACKAGE.rglob("*.py")}


def imports() -> Iterator[tuple[str, int, str, str]]:
    """``(file, line, importing module, imported epd_trio module)`` for the whole package."""
    known = _known_modules()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imported(node, module, path.name == "__init__.py", known):
                if _part(name) is not None:
                    yield str(path.relative_to(PACKAGE.parent)), node.lineno, module, name


def violations() -> list[tuple[str, int, str, str]]:
    found = []
    for file, line, module, imported in imports():
        source, target = _part(module), _part(imported)
        if source is None or target is None or source == target or source == "epd_trio":
            continue
        if source in BASE:
            bad = target not in BASE_MAY_IMPORT and imported not in BASE_MAY_IMPORT_MODULES
        else:
            bad = target == "epd_trio" or target in FORBIDDEN.get(source, frozenset())
        if bad:
            found.append((file, line, module, imported))
    return found


def _shown(found: list[tuple[str, int, str, str]]) -> str:
    return "\n".join(f"{file}:{line}: {module} imports {imported}" for file, line, module, imported in found)


def test_no_part_imports_a_part_above_it() -> None:
    found = [v for v in violations() if (v[0], v[3]) not in KNOWN_EXCEPTIONS]
    assert not found, "layering violations:\n" + _shown(found)


def test_known_exceptions_are_still_needed() -> None:
    present = {(file, imported) for file, _, _, imported in violations()}
    stale = sorted(KNOWN_EXCEPTIONS - present)
    assert not stale, f"these exceptions no longer occur; remove them from KNOWN_EXCEPTIONS: {stale}"


def test_the_url_rule_the_base_uses_is_a_leaf() -> None:
    for file, line, module, imported in imports():
        if module in BASE_MAY_IMPORT_MODULES:
            assert _part(imported) in BASE_MAY_IMPORT | {None}, f"{file}:{line}: {module} imports {imported}"


def test_the_reader_sees_imports_everywhere(tmp_path: Path) -> None:
    """Imports inside functions, under TYPE_CHECKING and relative ones all count."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from epd_trio.encoder.service import EncoderService\n"
        "def f():\n"
        "    import epd_trio.client.client\n"
        "from ..transport import zmq\n"
        "from epd_trio import bootstrap\n"
    )
    tree = ast.parse(source)
    names = {n for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
             for n in _imported(node, "epd_trio.protocol.codec", False, _known_modules())}
    assert {_part(n) for n in names} >= {"encoder", "client", "transport", "bootstrap"}


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_each_rule_names_real_parts(part: str) -> None:
    parts = {_part(m) for m in _known_modules()}
    assert part in parts and FORBIDDEN[part] <= parts
