"""The delivery contract: one registration per backend, transport errors mapped inside."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import trio
import zmq

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


def test_the_service_and_its_face_name_no_backend_and_the_face_no_transport() -> None:
    """Variation lives behind the contract: no ``backend == "zmq"`` in the lifecycle,
    no transport import in a face."""
    import ast
    from pathlib import Path

    import epd_trio

    root = Path(epd_trio.__file__).parent
    for name in ("encoder/service.py", "encoder/scope.py", "encoder/app.py"):
        tree = ast.parse((root / name).read_text())
        names = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in BACKENDS]
        assert names == [], f"{name} names backends {names}"
        imports = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        assert not [m for m in imports if m.startswith("epd_trio.transport")], (name, imports)
    app = ast.parse((root / "encoder/app.py").read_text())
    modules = {n.module for n in ast.walk(app) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in modules if m and m.startswith(("epd_trio.delivery", "zmq"))}, modules


def test_every_registered_delivery_has_every_call_of_the_contract() -> None:
    """``admitted``, ``sized``, ``deliver``, ``fail`` and ``aclose`` on each class a factory
    builds (a protocol check at runtime sees only what was built, so look at all of them)."""
    calls = ("admitted", "sized", "deliver", "fail", "aclose")
    for name, factory in FACTORIES.items():
        cls = factory.__self__  # type: ignore[attr-defined]  # the classmethod's class
        missing = [call for call in calls if not callable(getattr(cls, call, None))]
        assert not missing, f"{name}: {cls.__name__} lacks {missing}"
