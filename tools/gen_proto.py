"""Regenerate the checked-in gRPC code of ``epd_trio/protocol/proto/encoder.proto``.

``python tools/gen_proto.py`` writes ``encoder_pb2.py``, ``encoder_pb2.pyi`` and
``encoder_pb2_grpc.py`` beside the ``.proto`` with grpcio-tools' bundled protoc
(the ``test`` extra); ``--check DIR`` writes them into DIR instead, which the test
compares with the checked-in files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = Path("epd_trio/protocol/proto/encoder.proto")


def generate(out: Path) -> list[Path]:
    """Run protoc on the one .proto (paths relative to the repo root); the files written."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    out.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", str(ROOT / PROTO)]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    stem = PROTO.with_suffix("")
    return [out / f"{stem}_pb2.py", out / f"{stem}_pb2.pyi", out / f"{stem}_pb2_grpc.py"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", type=Path, help="write into this directory instead of the repo")
    args = parser.parse_args(argv)
    for path in generate(args.check or ROOT):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
