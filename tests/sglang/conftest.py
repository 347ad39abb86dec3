"""The SGLang interop environment as a fixture: skipped when missing, unless required.

Tests that need SGLang's own code take ``sglang_env``. Without the environment
they skip, unless ``EPD_REQUIRE_SGLANG=1`` (CI), where a missing or stale one
fails them.
"""

from __future__ import annotations

import os

import pytest
from sglang_harness import STAMP_NAME, SGLangEnv, expected_stamp, sglang_dir


@pytest.fixture(scope="session")
def sglang_env() -> SGLangEnv:
    path = sglang_dir()
    stamp = path / STAMP_NAME
    have = stamp.read_text().strip() if stamp.is_file() else None
    if have == expected_stamp():
        return SGLangEnv(path)
    problem = (f"the SGLang interop environment in {path} is "
               f"{'missing' if have is None else 'stale'}: run `bash tools/sglang_env.sh`")
    if os.environ.get("EPD_REQUIRE_SGLANG") == "1":
        pytest.fail(problem)
    pytest.skip(problem)
