"""Fault points of the encoder service, installed by wrapping its deliveries."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from conftest import image_uri
from epd_trio.delivery.inline import InlineDelivery
from epd_trio.errors import AbortedError, RequestError, TransportError
from epd_trio.protocol.requests import parse_encode_request
from epd_trio.testing import Fault, FaultPlan, install_faults
from epd_trio.testing.encoder_faults import FaultyDelivery
from epd_trio.transport.zmq import PullReceiver


def zmq_request(req_id: str, endpoint: str) -> Any:
    return parse_encode_request({"req_id": req_id, "modality": "image", "mm_items": [image_uri()],
                                 "deliver": {"backend": "zmq", "endpoint": endpoint}})


@pytest.mark.parametrize(("fault", "expected"), [
    (Fault("send", error=lambda p: TransportError(f"injected at {p}")), TransportError),
    (Fault("send", cancel=True), AbortedError),
])
async def test_a_fault_at_send_fails_the_request_and_still_tells_the_receiver(
        encoder: Any, fault: Fault, expected: type[Exception]) -> None:
    async with encoder(send_timeout=1.0) as (server, _), PullReceiver() as pull:
        service = server.service
        plan = FaultPlan(0, [fault, Fault("release", error=lambda p: TransportError(p))])
        install_faults(plan, service)
        assert isinstance(service.delivery_for(zmq_request("probe", pull.last_endpoint)), FaultyDelivery)
        with pytest.raises(expected):
            await service.encode(zmq_request("faulty", pull.last_endpoint))
        with trio.fail_after(10):
            header, tensor = await pull.receive()
            await service.registry.wait_idle()  # the notice goes out before the release
        assert (header.req_id, header.kind, tensor) == ("faulty", "error", None)
        assert header.error is not None and header.error.type == expected.__name__
        assert plan.hits == {"send": 1, "release": 1}, plan.hits  # released despite its fault
        stats = service.registry.statistics()
        assert (stats.live_requests, stats.failed + stats.aborted) == (0, 1), stats
        install_faults(None, service)  # removed: the next request is clean
        await service.encode(zmq_request("clean", pull.last_endpoint))
        with trio.fail_after(10):
            header, _ = await pull.receive()
            await service.registry.wait_idle()
        assert (header.req_id, header.kind, plan.hits) == ("clean", "embedding", {"send": 1, "release": 1})


async def test_a_callers_deadline_that_is_the_scopes_counts_as_a_deadline_not_an_abort(
        encoder: Any) -> None:
    """A gRPC caller's deadline is also the scope's: both expire in one scheduler pass, in
    either order. Whichever task runs first, the request failed on its deadline (504 to its
    receivers), it was not aborted."""
    async with encoder() as (server, _):
        service = server.service
        install_faults(FaultPlan(0, [Fault("preprocess", delay=60.0)]), service.engine)  # never in time
        runs = 16  # the order is random: all 16 one way by chance is ~1 in 65 000
        for i in range(runs):
            deadline = trio.current_time() + 0.02
            with trio.CancelScope(deadline=deadline):
                await service.encode(parse_encode_request(
                    {"req_id": f"d{i}", "modality": "image", "mm_items": [image_uri()]}),
                    deadline=deadline)
            with trio.fail_after(10):
                await service.registry.wait_idle()
        stats = service.registry.statistics()
        assert (stats.failed, stats.aborted) == (runs, 0), stats
        metrics = service.metrics.exposition().decode()
        assert f'outcome="DeadlineExceeded"}} {float(runs)}' in metrics, metrics


async def test_a_delivery_whose_failure_notice_breaks_does_not_take_the_service_down(
        encoder: Any, caplog: pytest.LogCaptureFixture) -> None:
    """An error notice that raises something unexpected (it once could: a num_parts msgpack
    cannot write) is logged; the request nursery, and every other request, carry on."""
    class BrokenNotice(InlineDelivery):
        async def fail(self, error: Any) -> None:
            raise OverflowError("int too big to convert")

    async with encoder() as (server, http):
        service = server.service
        bad = parse_encode_request({"req_id": "bad", "modality": "image", "mm_items": ["data:image/png;base64,AAAA"]})
        with pytest.raises(RequestError):
            await service.encode(bad, BrokenNotice(threads=trio.CapacityLimiter(1)))
        ok = await http.post("/encode", json={"req_id": "next", "modality": "image", "mm_items": [image_uri()]})
        assert ok.status_code == 200
        assert service.registry.statistics().live_requests == 0
    assert "telling bad of its failure failed unexpectedly" in caplog.text
