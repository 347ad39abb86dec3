"""``tools/gpu_check.sh`` asks of each tool what the tool still accepts.

A GPU run is short and rare, and the script runs untested here (no CUDA): a benchmark
flag renamed since it was written would waste the whole run. So every
``step`` line is read out of the script and its arguments are handed to the tool's own
argument parser, and each pytest step must still select tests.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
import sys
from pathlib import Path
from types import ModuleType

import pytest

from test_gpu_wheels import GPU_CHECK_RUNS

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
# The script's own variables, as they would expand on the GPU machine.
VARIABLES = {"$PY": sys.executable, "$CKPT": "/tmp/ckpt", "$LOGS": "/tmp/logs", "$ROOT": str(ROOT)}


def steps(script: str) -> dict[str, list[str]]:
    """``step NAME TIMEOUT COMMAND...`` lines, continuations joined: name → command words
    (a name must be unique: a step in two branches of an ``if`` would be checked only once)."""
    joined = re.sub(r"\\\n\s*", " ", script)
    found: dict[str, list[str]] = {}
    for line in joined.splitlines():
        words = shlex.split(line.strip(), comments=True)
        if len(words) >= 4 and words[0] == "step":
            assert words[1] not in found, f"step {words[1]} twice in the script"
            found[words[1]] = [_expand(w) for w in words[3:]]
    return found


def _expand(word: str) -> str:
    for name, value in VARIABLES.items():
        word = word.replace(name, value).replace("${" + name[1:] + "}", value)
    return word


def tool_args(command: list[str]) -> tuple[Path, list[str]]:
    """The ``tools/*.py`` a command runs and its arguments (after ``env A=B`` and the python)."""
    for i, word in enumerate(command):
        if word.startswith("tools/") and word.endswith(".py"):
            return ROOT / word, command[i + 1:]
    raise ValueError(f"no tools/*.py in {command}")


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"gpu_check_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


STEPS = steps(SCRIPT.read_text())
PYTESTS = {name: cmd[cmd.index("pytest") + 1:] for name, cmd in STEPS.items() if "pytest" in cmd}
BENCHMARKS = {name: cmd for name, cmd in STEPS.items() if name not in PYTESTS}


def test_the_script_is_read_as_it_runs() -> None:
    """Guards the parsing above: a script that changed shape must not leave nothing to check."""
    assert {"gpu_tests", "gpu_tests:compile", "sglang_mooncake"} <= set(PYTESTS)
    assert {"bench_engine", "bench_service", "bench_capacity", "bench_transfer"} <= set(BENCHMARKS)
    assert all(cmd[0] == sys.executable for cmd in BENCHMARKS.values()), BENCHMARKS
    script = "step a 10 \"$PY\" tools/x.py --one \\\n    --two $CKPT  # note\nstep\n"
    assert steps(script) == {"a": [sys.executable, "tools/x.py", "--one", "--two", "/tmp/ckpt"]}


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_each_benchmark_accepts_its_arguments(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    path, args = tool_args(BENCHMARKS[name])
    module = load(path)
    try:
        parsed = module.parse_args(args)
    except SystemExit:
        pytest.fail(f"{path.name} refuses the arguments gpu_check.sh gives it: {args}\n"
                    f"{capsys.readouterr().err}")
    if "--device" in args:  # the whole point of the step: it must not fall back to the CPU
        assert parsed.device == args[args.index("--device") + 1]


@pytest.mark.parametrize("name", sorted(PYTESTS))
def test_each_pytest_step_selects_tests(name: str) -> None:
    command = PYTESTS[name]
    files = [ROOT / w for w in command if w.startswith("tests/") and w.endswith(".py")]
    assert files and all(f.exists() for f in files), command
    tests = {n.name for f in files for n in ast.walk(ast.parse(f.read_text()))
             if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name.startswith("test_")}
    if "-k" in command:
        keyword = command[command.index("-k") + 1]
        negated = keyword.removeprefix("not ")
        chosen = [t for t in tests if (negated not in t) == (negated != keyword)]
        assert chosen and negated.isidentifier(), f"-k {keyword} selects nothing in {files}"
    if "-m" in command:
        marker = command[command.index("-m") + 1]
        text = "".join(f.read_text() for f in files)
        assert f"pytest.mark.{marker}" in text, f"-m {marker}: no test in {files} has that mark"


def test_the_wheel_check_covers_every_tool_the_script_runs() -> None:
    assert {tool_args(cmd)[0] for cmd in BENCHMARKS.values()} <= set(GPU_CHECK_RUNS)


def _wheel(folder: Path, name: str) -> Path:
    """A minimal pure-Python wheel: one module that says where it was installed."""
    import zipfile

    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{name}.py", "HERE = __file__\n")
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "")
    return path


def test_the_venv_sees_a_venv_pythons_packages_and_the_wheels_first(tmp_path: Path) -> None:
    """The GPU image's python3 is itself a venv's (/opt/torch/.venv): a venv made from it with
    --system-site-packages saw the base interpreter's packages, not torch. The script's
    environment block, run here from this venv's python, must give a python that imports both
    what only this venv has (pytest_trio) and the carried wheel, installed in the new venv."""
    import subprocess

    script = SCRIPT.read_text()
    block = script[script.index("# ---- environment"):script.index('"$PY" - <<')]
    block = re.sub(r'^NEEDED=.*$', 'NEEDED="import pytest_trio, epd_probe_wheel"', block, count=1, flags=re.M)
    wheels = tmp_path / "whl"
    wheels.mkdir()
    _wheel(wheels, "epd_probe_wheel")
    prelude = (f"ROOT={shlex.quote(str(ROOT))}; PY={shlex.quote(sys.executable)}; "
               f"WHEELS={shlex.quote(str(wheels))}; VENV={shlex.quote(str(tmp_path / 'venv'))}\n")
    tail = '\n"$PY" -c "import epd_probe_wheel, pytest_trio; print(epd_probe_wheel.HERE)"\n'
    done = subprocess.run(["bash", "-c", "set -uo pipefail\n" + prelude + block + tail],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith(str(tmp_path / "venv")), done.stdout
