"""The delivery contract: one registration per backend, transport errors mapped inside."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
import zmq

import epd_trio
from conftest import docstring_ids
from epd_trio.config import ENCODER_BACKENDS, SGLANG_BACKENDS
from epd_trio.delivery import FACTORIES, Delivery, PulledDelivery, build_delivery, map_exceptions
from epd_trio.delivery.base import DeliveryContext
from epd_trio.delivery.zmq import ZmqDelivery
from epd_trio.errors import EPDError, PeerUnavailable, RequestError, TransferTimeout, TransportError
from epd_trio.protocol.requests import BACKENDS, EncodeMeta, parse_encode_request
from epd_trio.protocol.sglang_requests import DELIVERIES as SGLANG_DELIVERIES
from epd_trio.protocol.vllm_requests import DELIVERIES as VLLM_DELIVERIES
from epd_trio.transport.zmq import PushSocketCache


def request(deliver: dict[str, Any]) -> Any:
    return parse_encode_request({"req_id": "r", "modality": "image", "mm_items": ["x"], "deliver": deliver})


def test_every_backend_the_protocols_accept_has_one_registered_delivery() -> None:
    assert set(FACTORIES) == set(BACKENDS) | set(SGLANG_DELIVERIES) | set(VLLM_DELIVERIES)


async def test_each_delivery_meets_the_contract() -> None:
    async with PushSocketCache() as sockets:
        context = DeliveryContext(sockets, None, 1.0, trio.CapacityLimiter(1))
        inline = build_delivery(request({"backend": "inline"}), context)
        pushed = build_delivery(request({"backend": "zmq", "endpoint": "tcp://127.0.0.1:9"}), context)
        assert isinstance(inline, Delivery) and not isinstance(inline, PulledDelivery)
        assert isinstance(pushed, Delivery) and not isinstance(pushed, PulledDelivery)
        with pytest.raises(RequestError, match="does not serve Mooncake"):
            build_delivery(request({"backend": "mooncake"}), context)


@pytest.mark.parametrize(("raised", "expected"), [
    (zmq.ZMQError(zmq.ETERM), TransportError),
    (trio.ClosedResourceError("closed"), TransportError),
    (trio.BrokenResourceError("gone"), PeerUnavailable),
    (trio.TooSlowError(), TransferTimeout),
])
async def test_zmq_transport_errors_leave_as_ours(raised: Exception, expected: type[EPDError]) -> None:
    class Sockets:  # a transport that fails the way pyzmq and trio do
        async def send(self, endpoint: str, frames: Any, timeout: float) -> None:
            raise raised

    req = request({"backend": "zmq", "endpoints": ["tcp://127.0.0.1:9", "tcp://127.0.0.1:10"]})
    delivery = ZmqDelivery(req, Sockets(), 1.0)  # type: ignore[arg-type]
    embedding = torch.zeros(2, 4)
    meta = EncodeMeta("r", 0, 1, "image", 2, 4, "float32", [2], [[1, 2, 4]])
    with pytest.raises(expected) as caught:
        await delivery.deliver(embedding, meta)
    assert type(caught.value) is expected  # one typed error, not a group of two
    with pytest.raises(expected):
        await delivery.fail(TransportError("the notice"))


def test_map_exceptions_passes_ours_and_bugs_through() -> None:
    mapping = {OSError: TransportError}
    with pytest.raises(TransportError, match="write: ConnectionResetError"):
        with map_exceptions(mapping, "write"):
            raise ConnectionResetError("reset")
    with pytest.raises(RequestError):
        with map_exceptions(mapping, "write"):
            raise RequestError("ours")
    with pytest.raises(KeyError):  # not a transport failure: a bug stays a bug
        with map_exceptions(mapping, "write"):
            raise KeyError("bug")


# Every name a request, a face's protocol or a flag gives a delivery or a transfer backend.
BACKEND_NAMES = frozenset({*BACKENDS, *SGLANG_DELIVERIES, *VLLM_DELIVERIES, *SGLANG_BACKENDS,
                           *ENCODER_BACKENDS})
# What only the runtime and the deliveries import.
TRANSPORT_MODULES = ("epd_trio.transport", "epd_trio.delivery", "zmq", "mooncake")


def _backends_named(tree: ast.AST) -> list[str]:
    prose = docstring_ids(tree)
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and n.value in BACKEND_NAMES and id(n) not in prose]


def _backend_comparisons(tree: ast.AST) -> list[int]:
    """Lines that compare a setting naming a backend or a connector (``x.transfer_backend == ...``)."""
    def names_a_backend(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and any(
            word in node.attr for word in ("backend", "mooncake", "storage", "vllm_ec"))

    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Compare)
            and any(names_a_backend(part) for side in (n.left, *n.comparators) for part in ast.walk(side))]


def test_no_module_of_the_encoder_names_a_backend_and_no_face_a_transport() -> None:
    """Variation lives behind the contract: no ``backend == "zmq"`` in the lifecycle or in any
    face (every module of ``epd_trio/encoder``: a new face is walked too), no transport or
    delivery import outside the runtime (the service and its scopes), which owns the deliveries."""
    root = Path(epd_trio.__file__).parent / "encoder"
    modules = sorted(root.glob("*.py"))
    assert {"service.py", "scope.py", "app.py", "sglang_app.py", "vllm_app.py", "grpc_sglang.py"} \
        <= {m.name for m in modules}
    for path in modules:
        tree = ast.parse(path.read_text())
        assert _backends_named(tree) == [], f"{path.name} names backends {_backends_named(tree)}"
        assert _backend_comparisons(tree) == [], f"{path.name} compares backends on lines " \
                                                 f"{_backend_comparisons(tree)}"
        imports = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        imports += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        if path.name not in ("service.py", "scope.py"):
            assert not [m for m in imports if m.startswith(TRANSPORT_MODULES)], (path.name, imports)
        assert not [m for m in imports if m.startswith("epd_trio.transport")], (path.name, imports)


def test_the_guard_sees_a_backend_named_or_compared() -> None:
    """The checks above can fail: the shapes they look for are found."""
    leaky = ast.parse('''"""A docstring may say mooncake."""
def f(config):
    """And so may this one: zmq."""
    if config.encoder_transfer_backend != "mooncake":
        return "inline"
    return config.vllm_ec.storage_path is None
''')
    assert sorted(_backends_named(leaky)) == ["inline", "mooncake"]
    assert _backend_comparisons(leaky) == [4, 6]


def test_every_registered_delivery_has_every_call_of_the_contract() -> None:
    """``admitted``, ``sized``, ``deliver``, ``fail`` and ``aclose`` on each class a factory
    builds (a protocol check at runtime sees only what was built, so look at all of them)."""
    calls = ("admitted", "sized", "deliver", "fail", "aclose")
    for name, factory in FACTORIES.items():
        cls = factory.__self__  # type: ignore[attr-defined]  # the classmethod's class
        missing = [call for call in calls if not callable(getattr(cls, call, None))]
        assert not missing, f"{name}: {cls.__name__} lacks {missing}"
