"""``tools/gpu_wheels.py``: the wheels an offline GPU machine lacks, so that gpu_check.sh can import us.

The old hand-written list had fallen behind pyproject (msgspec and the gRPC packages were
missing): here the list is computed, and checked against every import epd_trio makes.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import gpu_wheels  # noqa: E402


def test_closure_follows_markers_extras_and_stops_at_what_is_provided() -> None:
    requires = {
        "app": ["lib-a>=1", 'old-backport; python_version < "3.11"', 'tester; extra == "test"',
                'docs-tool; extra == "docs"', "Big_Framework"],
        "lib-a": ["lib-b[fast]"],
        "lib-b": ['speedup; extra == "fast"', "lib-c"],
        "tester": ["lib-c"],
        "big-framework": ["its-own-dep"],  # the image has big-framework and what it needs
    }
    env = gpu_wheels.target_environment("3.12")
    got = gpu_wheels.closure("app", ["test"], requires, env, frozenset({"big-framework"}))
    assert got == {"lib-a", "lib-b", "speedup", "lib-c", "tester", "big-framework"}
    assert "old-backport" in gpu_wheels.closure("app", [], requires, gpu_wheels.target_environment("3.10"))


def test_to_carry_leaves_out_the_image_and_the_lazy_decoders_but_keeps_pinned_ones() -> None:
    carry = gpu_wheels.to_carry({"torch", "msgspec", "av", "grpcio", "werkzeug", "epd-trio"})
    assert carry == ["grpcio", "msgspec", "werkzeug"]


@pytest.fixture(scope="module")
def carried() -> set[str]:
    requires, versions = gpu_wheels.installed()
    if gpu_wheels.ROOT_PACKAGE not in requires:
        # The closure is read from installed metadata; tools/test.sh (the README's command, CI's)
        # always installs epd-trio, so this skips only a bare pytest on an uninstalled checkout.
        pytest.skip("needs epd-trio's installed metadata: run the suite with bash tools/test.sh")
    needed = gpu_wheels.closure(gpu_wheels.ROOT_PACKAGE, gpu_wheels.EXTRAS, requires,
                                gpu_wheels.target_environment("3.12"),
                                gpu_wheels.IMAGE - gpu_wheels.CARRY_ANYWAY)
    carry = set(gpu_wheels.to_carry(needed))
    assert carry <= set(versions), "every carried package has a version to pin"
    return carry


def test_the_real_list_has_what_the_image_lacks(carried: set[str]) -> None:
    assert {"msgspec", "pybase64", "smg-grpc-proto", "grpcio-health-checking", "grpcio-reflection",
            "pyzmq", "hypercorn", "quart-trio", "trio", "pytest-trio"} <= carried
    assert not carried & {"torch", "torchvision", "transformers", "numpy", "pillow", "av"}


# What tools/gpu_check.sh runs besides the package itself.
GPU_CHECK_RUNS = [ROOT / "tests" / "conftest.py", ROOT / "tests" / "test_gpu.py",
                  *(ROOT / "tools" / f"bench_{name}.py"
                    for name in ("engine", "service", "production", "preprocess", "capacity", "transfer"))]


def _imports(tree: ast.Module, *, module_level: bool) -> set[str]:
    """Top-level names imported when the module loads (``module_level``) or anywhere."""
    nodes = ast.walk(tree) if not module_level else _loaded_at_import(tree.body)
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    return names


def _loaded_at_import(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements run at import: ``if TYPE_CHECKING:`` and optional ``try`` imports excluded."""
    return [s for s in body if isinstance(s, (ast.Import, ast.ImportFrom))]


def _optional_extras() -> set[str]:
    """What epd-trio's other extras (Mooncake's builds) add: never needed to load it."""
    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in metadata.requires(gpu_wheels.ROOT_PACKAGE) or []]
    return {gpu_wheels.canonical(r.name) for r in reqs
            if r.marker is not None and "extra" in str(r.marker)
            and not any(r.marker.evaluate({"extra": e}) for e in gpu_wheels.EXTRAS)}


def test_every_import_gpu_check_makes_is_carried_or_in_the_image(carried: set[str]) -> None:
    providers = metadata.packages_distributions()
    not_at_load = gpu_wheels.LAZY | _optional_extras()
    own = {"epd_trio", "__future__"}
    available = carried | gpu_wheels.IMAGE
    missing: dict[str, str] = {}
    lazy_at_load: dict[str, str] = {}
    for path in [*sorted((ROOT / "epd_trio").rglob("*.py")), *GPU_CHECK_RUNS]:
        tree = ast.parse(path.read_text(), str(path))
        at_load = _imports(tree, module_level=True)
        for module in _imports(tree, module_level=False) - own - set(sys.stdlib_module_names):
            dists = {gpu_wheels.canonical(d) for d in providers.get(module, [])}
            where = str(path.relative_to(ROOT))
            if not dists:
                continue  # an optional module not installed here (mooncake's CUDA build)
            if dists & not_at_load:
                if module in at_load:
                    lazy_at_load[module] = where
            elif not dists & available:
                missing[module] = where
    assert not missing, f"imported but neither carried nor in the image: {missing}"
    assert not lazy_at_load, f"left out (lazy or optional), but imported when a module loads: {lazy_at_load}"
