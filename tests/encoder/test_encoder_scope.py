"""The request scope's state machine and the registry of live scopes."""

from __future__ import annotations

import outcome
import pytest
import trio

from epd_trio.delivery import Answer, InlineDelivery
from epd_trio.encoder.scope import Phase, RegistryStatistics, ScopeRegistry
from epd_trio.errors import AbortedError, DuplicateRequestError, TransportError, UnknownRequestError
from epd_trio.protocol.requests import EncodeMeta, EncodeRequest

META = EncodeMeta("r", 0, 1, "image", 1, 4, "float32", [1], [[1, 2, 2]])


def admit(registry: ScopeRegistry, req_id: str = "r", part_idx: int = 0):  # type: ignore[no-untyped-def]
    request = EncodeRequest(req_id, "image", ["x"], num_parts=part_idx + 1, part_idx=part_idx)
    return registry.admit(request, InlineDelivery(threads=trio.CapacityLimiter(1)), deadline=10.0)


async def test_a_delivered_scope_walks_every_phase_once_and_is_counted() -> None:
    registry = ScopeRegistry()
    scope = admit(registry)
    for phase in (Phase.PREPROCESSED, Phase.ENCODED):
        scope.advance(phase)
    scope.end(None)
    scope.answer(outcome.Value(Answer(META)))
    assert (scope.phase, scope.ending, scope.error) == (Phase.DELIVERED, Phase.DELIVERED, None)
    assert "delivered, answered" in repr(scope)
    with pytest.raises(RuntimeError, match="no way from delivered to encoded"):
        scope.advance(Phase.ENCODED)
    with pytest.raises(RuntimeError, match="already answered"):
        scope.answer(outcome.Error(TransportError("late")))
    assert (await scope.wait_answer()).meta == META
    await scope.release()
    assert scope.phase is Phase.RELEASED
    assert registry.statistics() == RegistryStatistics(0, 1, 1, 0, 0)
    await registry.wait_idle()


async def test_an_abort_ends_the_scope_aborted_with_its_first_reason() -> None:
    registry = ScopeRegistry()
    scope = admit(registry)
    first, second = AbortedError("by /abort"), AbortedError("client gone")
    assert registry.abort("r", None, first) == [scope]
    scope.abort(second)
    assert scope.cancel_scope.cancel_called and scope.abort_reason is first
    scope.end(first)
    scope.abort(AbortedError("after the end"))  # an ended scope is left alone
    assert (scope.phase, scope.error, scope.abort_reason) == (Phase.ABORTED, first, first)
    await scope.release()
    assert registry.statistics() == RegistryStatistics(0, 1, 0, 0, 1)


async def test_a_failure_is_counted_failed_and_its_error_kept() -> None:
    registry = ScopeRegistry()
    scope = admit(registry)
    scope.end(TransportError("the receiver is gone"))
    assert scope.statistics().error == "TransportError" and scope.phase is Phase.FAILED
    await scope.release()
    assert registry.statistics().failed == 1


async def test_live_keys_are_unique_and_known() -> None:
    registry = ScopeRegistry()
    scope = admit(registry, "a", 0)
    other_part = admit(registry, "a", 1)
    with pytest.raises(DuplicateRequestError):
        admit(registry, "a", 0)
    with pytest.raises(UnknownRequestError):
        registry.get(("b", 0))
    with pytest.raises(UnknownRequestError):
        registry.abort("b", None, AbortedError("x"))
    assert registry.get(("a", 1)) is other_part
    assert [s.phase for s in registry.live()] == ["admitted", "admitted"]
    assert "2 live" in repr(registry)
    for s in (scope, other_part):
        s.end(AbortedError("drained"))
        await s.release()
    with trio.fail_after(1):
        await registry.wait_idle()


async def test_shutdown_answers_every_waiter_and_releases_every_scope(
        qwen25_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests stuck in their send (nobody listens) when the service closes:
    the drain cancels them, each waiter gets a 503, each scope ends aborted."""
    # A failed scope's last error notice to that receiver waits out its bound (5 s)
    # before the scope is released: 0.1 s here.
    monkeypatch.setattr("epd_trio.encoder.service._ERROR_NOTICE_TIMEOUT", 0.1)
    from conftest import image_uri
    from epd_trio.config import EncoderConfig, EngineConfig
    from epd_trio.encoder.service import open_encoder_service
    from epd_trio.engine import open_engine
    from epd_trio.errors import NotReadyError
    from epd_trio.protocol.requests import parse_encode_request

    config = EncoderConfig(engine=EngineConfig(model_path=qwen25_path), send_timeout=60.0,
                           drain_timeout=0.2)
    answers: list[BaseException] = []

    async def waiter(service, req_id: str) -> None:  # type: ignore[no-untyped-def]
        request = parse_encode_request({"req_id": req_id, "modality": "image", "mm_items": [image_uri()],
                                        "deliver": {"backend": "zmq", "endpoint": "tcp://127.0.0.1:9"}})
        try:
            await service.encode(request)
        except NotReadyError as exc:
            answers.append(exc)

    with trio.fail_after(60):
        async with open_engine(config.engine) as engine, trio.open_nursery() as waiters:
            async with open_encoder_service(config, engine) as service:
                for req_id in ("a", "b"):
                    waiters.start_soon(waiter, service, req_id)
                while service.registry.statistics().live_requests < 2 or any(
                        s.phase != "encoded" for s in service.registry.live()):
                    await trio.sleep(0.01)
            registry = service.registry.statistics()
    assert len(answers) == 2 and registry == RegistryStatistics(0, 2, 0, 0, 2), (answers, registry)
