"""The faces stay thin: each parses on threads of its own, refuses through the service's one
path, reaches the service only through its methods, and is imported only where it is registered."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
import trio

import epd_trio
from epd_trio._http import OFFLOAD_BODY_BYTES
from epd_trio.encoder import grpc_native, grpc_sglang
from epd_trio.encoder.server import FACES

PACKAGE = Path(epd_trio.__file__).parent
# The runtime and what serves it; every other module of the encoder is a face or part of one.
RUNTIME = frozenset({"__init__", "service", "scope", "health", "metrics", "profiling", "server"})
# What a face may not reach past the service's methods for.
SERVICE_INSIDES = frozenset({"registry", "deliveries", "rendezvous"})


def _vllm_face(tmp_path: Path) -> dict[str, Any]:
    return {"api": "vllm", "ec_transfer_config": json.dumps({
        "ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
        "ec_connector_extra_config": {"shared_storage_path": str(tmp_path)}})}


# Each HTTP face's request route, and the settings that serve it.
FACE_ROUTES = {
    "native": ("/encode", lambda tmp_path: {}),
    "sglang": ("/encode", lambda tmp_path: {"api": "sglang"}),
    "vllm": ("/v1/chat/completions", _vllm_face),
}


def unknown_refusals(metrics: str) -> float:
    prefix = 'epd_encoder_requests_total{modality="unknown",outcome="RequestError"} '
    return sum(float(line[len(prefix):]) for line in metrics.splitlines() if line.startswith(prefix))


@pytest.mark.parametrize("api", sorted(FACE_ROUTES))
async def test_a_large_body_is_parsed_while_every_delivery_thread_is_busy(
        api: str, encoder: Any, tmp_path: Path) -> None:
    """A face parses a large JSON body on threads of its own: with the deliveries' threads all
    held (inline answers being built, files being written), it is still answered, refused
    once and counted once."""
    path, settings = FACE_ROUTES[api]
    assert set(FACES) == set(FACE_ROUTES)
    large = json.dumps({"pad": "x" * (2 * OFFLOAD_BODY_BYTES)})  # parsed off the loop; no request
    async with encoder(**settings(tmp_path)) as (server, http):
        threads = server.service.deliveries.threads
        holders = [object() for _ in range(int(threads.total_tokens))]
        for holder in holders:
            threads.acquire_on_behalf_of_nowait(holder)
        try:
            with trio.fail_after(20):
                response = await http.post(path, content=large,
                                           headers={"content-type": "application/json"})
        finally:
            for holder in holders:
                threads.release_on_behalf_of(holder)
        metrics = (await http.get("/metrics")).text
    assert response.status_code == 400, response.text
    assert unknown_refusals(metrics) == 1


def _faces() -> list[Path]:
    return [p for p in sorted((PACKAGE / "encoder").glob("*.py")) if p.stem not in RUNTIME]


def _reaches_inside(tree: ast.AST) -> list[str]:
    """``service.registry``, ``.deliveries``, ``.rendezvous``, or a refusal counted by hand."""
    found = [f"{n.lineno}: .{n.attr}" for n in ast.walk(tree)
             if isinstance(n, ast.Attribute) and n.attr in SERVICE_INSIDES]
    found += [f"{n.lineno}: .metrics.request" for n in ast.walk(tree)
              if isinstance(n, ast.Attribute) and n.attr == "request"
              and isinstance(n.value, ast.Attribute) and n.value.attr == "metrics"]
    return found


def test_the_faces_reach_the_service_only_through_its_methods() -> None:
    faces = _faces()
    assert {"app.py", "sglang_app.py", "vllm_app.py", "vllm_items.py", "grpc_native.py",
            "grpc_sglang.py", "http_face.py"} <= {p.name for p in faces}
    for path in faces:
        assert _reaches_inside(ast.parse(path.read_text())) == [], path.name


def test_the_inside_check_can_fail() -> None:
    tree = ast.parse("service.deliveries.rendezvous.register(1)\n"
                     "service.metrics.request('unknown', exc)\n"
                     "[s for s in service.registry.live()]\n")
    assert _reaches_inside(tree) == ["1: .rendezvous", "1: .deliveries", "3: .registry",
                                     "2: .metrics.request"]


def _module(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: Path) -> set[str]:
    """Every module an ``import`` in ``path`` names (``from a import b``: a, and a.b)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_nothing_imports_a_face_but_the_server_that_registers_it() -> None:
    """The HTTP faces are ``FACES``' (``encoder.server``), the gRPC ones ``grpc_server``'s: a face
    shares what it shares through ``http_face`` or ``grpc_bridge``, never through another face."""
    registrar = {create.__module__: "epd_trio.encoder.server" for create in FACES.values()}
    registrar |= {grpc_native.__name__: "epd_trio.encoder.grpc_server",
                  grpc_sglang.__name__: "epd_trio.encoder.grpc_server"}
    assert set(registrar) >= {"epd_trio.encoder.app", "epd_trio.encoder.sglang_app",
                              "epd_trio.encoder.vllm_app"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module(path)
        found += [f"{module} imports {face}" for face in sorted(_imports(path) & set(registrar))
                  if registrar[face] != module]
    assert found == []
