"""The checked-in gRPC code is what ``encoder.proto`` generates (``tools/gen_proto.py``): editing
the .proto without regenerating fails here. And the service has its four RPCs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "epd_trio" / "protocol" / "proto"
GENERATED = ("encoder_pb2.py", "encoder_pb2.pyi", "encoder_pb2_grpc.py")
RPCS = {"Encode": ("EncodeRequest", "EncodeResponse"), "Send": ("SendRequest", "SendResponse"),
        "Abort": ("AbortRequest", "AbortResponse"), "GetModelInfo": ("ModelInfoRequest", "ModelInfo")}


def test_checked_in_code_is_what_the_proto_generates(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the test extra) brings protoc")
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_proto.py"), "--check", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    written = [Path(line) for line in done.stdout.split()]
    assert sorted(p.name for p in written) == sorted(GENERATED)
    for path in written:
        assert path.is_relative_to(tmp_path), path  # --check never writes into the repository
        assert path.read_bytes() == (PROTO_DIR / path.name).read_bytes(), \
            f"{path.name} is stale: run `python tools/gen_proto.py` and commit the result"


def test_the_service_has_its_four_rpcs() -> None:
    from epd_trio.protocol.proto import encoder_pb2, encoder_pb2_grpc

    text = (PROTO_DIR / "encoder.proto").read_text()
    rpc = re.compile(r"rpc\s+(\w+)\s*\(\s*(\w+)\s*\)\s*returns\s*\(\s*(\w+)\s*\)")
    declared = {name: (request, response) for name, request, response in rpc.findall(text)}
    assert declared == RPCS
    service = encoder_pb2.DESCRIPTOR.services_by_name["Encoder"]
    assert service.full_name == "epd_trio.v1.Encoder"
    assert {m.name: (m.input_type.name, m.output_type.name) for m in service.methods} == RPCS
    assert all(not (m.client_streaming or m.server_streaming) for m in service.methods)  # all unary
    assert all(hasattr(encoder_pb2_grpc.EncoderServicer, name) for name in RPCS)
