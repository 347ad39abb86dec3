"""Fuzz every JSON endpoint longer than CI does: `python tools/fuzz.py --examples 5000`.

Runs tests/hardening/test_fuzz_endpoints.py (real encoder and registry on
loopback; hypothesis bodies for /encode, /send, /abort, the registry and raw
bytes) with more examples per endpoint. Exit status is pytest's: non-zero when
any example got a 5xx, hung, or left the server unhealthy or not quiescent —
hypothesis then prints the smallest failing body to replay.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=2000, help="examples per endpoint")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed, to replay a run")
    args = parser.parse_args()
    env = {**os.environ, "EPD_FUZZ_EXAMPLES": str(args.examples), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", str(ROOT / "tests/hardening/test_fuzz_endpoints.py")]
    if args.seed is not None:
        cmd.append(f"--hypothesis-seed={args.seed}")
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
