"""The README and the docs site: short, buildable, free of outside words, examples that run.

Code blocks in README.md and docs/*.md follow one rule, so a reader can paste any of them:

* every ```` ```python ```` block runs as a script, as written, unless the line before it is
  ``<!-- test: skip, REASON -->`` (a GPU, a real checkpoint or SGLang: the reason says which);
* a ```` ```bash ```` block runs only where the line before it is ``<!-- test: run -->``
  (install commands and commands for other machines are not run); its ports 8000 and 30002
  become free ones, and the servers it starts in the background are stopped afterwards.

The runnable blocks of one file run in order in one fresh directory, so a block may read what
an earlier one wrote (the quick start's ``curl`` answer); the embedded tiny model is
generated once into a cache directory shared by all of them.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)
SKIP = re.compile(r"^<!-- test: skip, (\S.*\S) -->$")
RUN = "<!-- test: run -->"
PORTS = ("8000", "30002")
OUTSIDE = re.compile(r"lent (machine|gpu|device)|was lent|\bissue ?#?[0-9]{1,3}\b|this session"
                     r"|next session|device tool|a lease", re.I)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    code: str
    marker: str  # the line before the fence ("" when blank or none)

    @property
    def runs(self) -> bool:
        if self.language == "python":
            return not SKIP.match(self.marker)
        return self.language == "bash" and self.marker == RUN

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(page, line, match.group(1), match.group(2), before))
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---- the README ---------------------------------------------------------------------------
def test_the_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move detail into docs/"


def test_the_package_index_page_is_the_readme() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["readme"] == "README.md" and project["license"] == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]


# ---- words from outside the project ---------------------------------------------------------
def checked_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "mkdocs.yml", ROOT / "CHANGELOG.md"]
    for folder in ("docs", "tools", "epd_trio"):
        files += [p for p in sorted((ROOT / folder).rglob("*"))
                  if p.is_file() and p.suffix not in (".pyc", ".png") and "_pb2" not in p.name]
    return files


def test_no_words_about_how_the_project_was_built() -> None:
    """The project speaks of itself: no issue numbers, sessions or borrowed machines."""
    found = []
    for path in checked_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not found, "\n".join(found)


def test_the_outside_words_check_can_fail() -> None:
    for line in ("measured in issue 17", "Issue #38's table", "on a lent GPU machine",
                 "the device tool brings back", "before a lease is spent", "this session's run"):
        assert OUTSIDE.search(line), line
    assert not OUTSIDE.search("the issue is the GIL; a released slot; tissue 12")


# ---- code blocks ----------------------------------------------------------------------------
def test_every_block_says_whether_it_runs() -> None:
    """A skipped python block names its reason; a run marker stands right before a fence."""
    for page in PAGES:
        text = page.read_text()
        for number, line in enumerate(text.splitlines(), 1):
            if line.startswith("<!-- test:"):
                assert line == RUN or SKIP.match(line), f"{page.name}:{number}: {line}"
        for block in blocks(page):
            if block.marker == RUN:
                assert block.language == "bash", f"{block}: only bash blocks take {RUN}"
            if SKIP.match(block.marker):
                assert block.language == "python", f"{block}: only python blocks are skipped"
    markers = sum(line.startswith("<!-- test:") for page in PAGES for line in page.read_text().splitlines())
    assert markers == sum(1 for page in PAGES for b in blocks(page) if b.marker.startswith("<!-- test:"))


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("xdg-cache")


def run_block(block: Block, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    if block.language == "python":
        script = cwd / f"block_{block.line}.py"
        script.write_text(block.code)
        return subprocess.run([sys.executable, script.name], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=300)
    code = block.code
    for port in PORTS:
        code = code.replace(port, str(free_port()))
    # Servers the block started in the background are stopped (they drain on SIGTERM).
    wrapped = f"trap 'kill $(jobs -p) 2>/dev/null || true; wait' EXIT\nset -euo pipefail\n{code}"
    return subprocess.run(["bash", "-c", wrapped], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


RUNNABLE = [page for page in PAGES if any(b.runs for b in blocks(page))]


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE, ids=[p.name for p in RUNNABLE])
def test_the_examples_run_as_written(page: Path, tmp_path: Path, model_cache: Path) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(model_cache), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(
               [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    for block in blocks(page):
        if not block.runs:
            continue
        done = run_block(block, tmp_path, env)
        assert done.returncode == 0, f"{block} exited {done.returncode}:\n{done.stdout[-3000:]}\n" \
                                     f"{done.stderr[-3000:]}"


def test_the_readme_examples_are_found() -> None:
    """The runner sees the README's quick starts (a fence the regex missed would pass silently)."""
    readme = blocks(ROOT / "README.md")
    assert sum(b.runs and b.language == "python" for b in readme) == 2
    assert sum(b.runs and b.language == "bash" for b in readme) == 2


# ---- the site -------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_docs_site_builds_strictly(tmp_path: Path) -> None:
    """``mkdocs build --strict``: a dead link or anchor, a missing page or snippet fails it."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    assert (tmp_path / "site" / "reference" / "index.html").read_text().count("open_engine") > 1



def test_the_variables_an_encoder_and_a_registry_share_are_all_named() -> None:
    """Deployment says which EPD_* variables one shell environment gives both processes."""
    import dataclasses

    from epd_trio.config import BootstrapConfig, EncoderConfig, EngineConfig, env_name

    def names(cls: type) -> set[str]:
        return {f.name for f in dataclasses.fields(cls) if not f.metadata.get("nested")}

    shared = {env_name(n) for n in names(BootstrapConfig) & (names(EncoderConfig) | names(EngineConfig))}
    text = " ".join((ROOT / "docs" / "deployment.md").read_text().split())
    sentence = text[text.index("fields they both have:"):].split(". ", 1)[0]
    assert set(re.findall(r"`(EPD_\w+)`", sentence)) == shared
