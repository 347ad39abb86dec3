"""Print the configuration table of docs/configuration.md from the config dataclasses.

`python tools/config_table.py` — tests check that docs/configuration.md contains its output,
so the documented flags can never drift from the code.
"""

from __future__ import annotations

import dataclasses
import sys

from epd_trio.config import BootstrapConfig, EncoderConfig, EngineConfig, env_name, flag_name

COMPONENTS = (EncoderConfig, EngineConfig, BootstrapConfig)


def table(cls: type) -> str:
    rows = [f"**{cls.__name__}** — {cls.__doc__.strip()}", "",
            "| flag | environment | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.metadata.get("nested"):
            continue
        env = f"`{env_name(f.name)}`"
        if alias := f.metadata.get("sglang_env"):
            env += f" (with `--api sglang` also `{alias}`, below ours)"
        rows.append(f"| `{flag_name(f.name)}` | {env} | `{f.default!r}` | "
                    f"{f.metadata['help']} |")
    return "\n".join(rows)


def main() -> int:
    print("\n\n".join(table(cls) for cls in COMPONENTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
