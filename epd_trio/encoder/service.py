"""The encoder service: the protocol-neutral runtime that every face calls.

A face (native HTTP, SGLang, vLLM, gRPC) parses its protocol inside
``parsing()`` (the one path by which a refused request is counted), builds
nothing but the request, and calls ``encode`` / ``send`` / ``abort`` /
``check_health`` / ``statistics``; SGLang's faces also reach the rendezvous
their receivers keep through ``announce_receiver`` / ``part_sizes`` /
``send_announced`` / ``sole_part``. Each accepted request becomes a **request
scope** (``encoder.scope``) run by ``_lifecycle`` in the service's request
nursery, and its embedding leaves through a **delivery**
(``epd_trio.delivery``) built from the request by ``delivery_for``. The
lifecycle never names a backend: what differs between transports is behind
the delivery's three calls.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, Final, Literal

import outcome
import trio

from epd_trio.config import EncoderConfig
from epd_trio.delivery import (
    Answer,
    Delivery,
    DeliveryContext,
    PulledDelivery,
    build_delivery,
    open_deliveries,
)
from epd_trio.encoder.health import HealthMonitor
from epd_trio.encoder.metrics import ServiceMetrics
from epd_trio.encoder.profiling import Profiler
from epd_trio.encoder.scope import Phase, RequestScope, ScopeRegistry
from epd_trio.engine import Engine, ModelInfo
from epd_trio.errors import (
    AbortedError,
    ConflictError,
    DeadlineExceeded,
    DrainingError,
    EncodeError,
    EPDError,
    NotReadyError,
    RequestError,
    UnknownRequestError,
)
from epd_trio.protocol.requests import EncodeMeta, EncodeRequest

__all__ = ["AbortResult", "EncoderService", "Health", "open_encoder_service"]

log = logging.getLogger(__name__)

# A final error notice to a receiver must not hold shutdown or a release for long.
_ERROR_NOTICE_TIMEOUT: Final = 5.0


@dataclass(frozen=True)
class Health:
    """What ``/health`` (or any face's health check) reports."""

    status: Literal["ok", "unhealthy", "draining"]
    probed: bool = False
    detail: str = ""
    dead_workers: tuple[str, ...] = ()

    @property
    def healthy(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class AbortResult:
    """What ``/abort`` answers: how many parts it matched, and whether they have all let go.

    ``released`` is true once every matched part has been released and no write
    it started can still land in its receiver's memory: only then may the
    receiver reuse that memory.
    """

    aborted: int
    released: bool


def _meta(request: EncodeRequest, modality: str, token_counts: Any, grid_thw: Any, dim: int,
          dtype: Any, extras: Any) -> EncodeMeta:
    counts = [int(c) for c in token_counts]
    return EncodeMeta(
        req_id=request.req_id, part_idx=request.part_idx, num_parts=request.num_parts,
        modality=modality, tokens=sum(counts), dim=dim, dtype=str(dtype).removeprefix("torch."),
        token_counts=counts, grid_thw=[list(g) for g in grid_thw],
        extras={key: list(values) for key, values in (extras or {}).items()})


class EncoderService:
    """Owns the live request scopes of one encoder; build with ``open_encoder_service``."""

    def __init__(self, config: EncoderConfig, engine: Engine, deliveries: DeliveryContext,
                 nursery: trio.Nursery) -> None:
        self.config = config
        self.engine = engine
        # Read once: building it per request cost the trio thread ~25 us (it never changes).
        self._info = engine.model_info
        self.deliveries = deliveries  # the transports deliveries borrow
        self.registry = ScopeRegistry()
        self.health = HealthMonitor(engine, nursery, timeout=config.health_timeout,
                                    fresh=config.health_fresh)
        self._nursery = nursery
        self.draining = False  # health checks (readiness) fail from the start of a shutdown
        self.admitting = True  # new requests are taken until the drain itself starts
        self.drain_started = trio.Event()  # faces that push status (gRPC health Watch) wait on it
        self.metrics = ServiceMetrics(self)
        self.profiler = Profiler(config.profile_dir, nursery)
        # The seam that builds a request's delivery; ``epd_trio.testing`` wraps it.
        self.delivery_for: Callable[[EncodeRequest], Delivery] = self._build_delivery

    def _build_delivery(self, request: EncodeRequest) -> Delivery:
        return build_delivery(request, self.deliveries)

    # ---- the faces' API -----------------------------------------------------
    @property
    def model_info(self) -> ModelInfo:
        return self.engine.model_info

    async def encode(self, request: EncodeRequest, delivery: Delivery | None = None, *,
                     deadline: float | None = None,
                     until_gone: Callable[[], Awaitable[None]] | None = None) -> Answer:
        """Run ``request`` in its own scope and wait for its one answer.

        ``delivery`` defaults to the one the request asks for. The scope's
        deadline is ``--request-timeout`` from now, or the caller's own
        ``deadline`` (trio clock; a gRPC client's) when that is sooner. If the
        caller leaves (a client disconnect, a cancellation) before the answer,
        the scope is aborted, and its receivers are told. A face that can wait
        for its client to leave passes that wait as ``until_gone`` (an HTTP
        route: ``asgi_route.UntilGone``); the client leaving is then an
        ``AbortedError``.
        """
        try:
            if not self.admitting:
                raise DrainingError("the encoder is draining and accepts no new requests")
            if delivery is None:
                delivery = self.delivery_for(request)
            ours = trio.current_time() + self.config.request_timeout
            scope = self.registry.admit(request, delivery,
                                        deadline=ours if deadline is None else min(ours, deadline))
        except EPDError as exc:  # refused before a scope existed (a scope counts its own outcome)
            self.metrics.request(request.modality, exc)
            raise
        delivery.admitted()  # only now: a refused duplicate changes nothing
        # start_soon, not start: the scope task begins in the request nursery, never
        # in this caller's context, so a caller cancelled now only aborts it.
        self._nursery.start_soon(self._lifecycle, scope, name=f"request {request.req_id}")
        try:
            return await scope.wait_answer(until_gone)  # bounded: the scope has the request deadline
        finally:
            # Our client left (a disconnect) or we were cancelled: an abort — unless the
            # scope's own deadline has come too (a gRPC caller's deadline is the scope's; both
            # fire in one pass), which the scope reports itself as DeadlineExceeded.
            if not scope.answered and trio.current_time() < scope.cancel_scope.deadline:
                scope.abort(AbortedError("the client went away", req_id=request.req_id))

    async def send(self, req_id: str, part_idx: int, *, session: str, address: int, length: int,
                   **order: Any) -> int:
        """A receiver's order for its copy (Mooncake ``/send``); the bytes written.

        ``order`` is what a face's protocol adds to it, for its delivery.
        """
        delivery = self.registry.get((req_id, part_idx)).delivery
        if not isinstance(delivery, PulledDelivery):
            raise RequestError(f"request {req_id!r} part {part_idx} is not a Mooncake delivery",
                               req_id=req_id)
        return await delivery.take_order(session, address, length, **order)

    @contextmanager
    def parsing(self) -> Iterator[None]:
        """Around a face's parsing of a request: an ``EPDError`` raised inside refuses it, and is
        counted here, as every face's refusals are (modality ``unknown``: the body's is not to
        be trusted), then raised on for the face to answer."""
        try:
            yield
        except EPDError as exc:
            self.metrics.request("unknown", exc)
            raise

    # ---- receivers that announce themselves (SGLang's rendezvous) -------------
    async def announce_receiver(self, req_id: str, receive_count: int, destination: str) -> None:
        """One of ``receive_count`` receivers of part ``req_id`` says where it takes the part,
        before or after its ``encode``; returns once a delivery holds it (``Rendezvous.register``:
        none within ``request_timeout`` is a 504)."""
        await self.deliveries.rendezvous.register(req_id, receive_count, destination,
                                                  timeout=self.config.request_timeout)

    async def part_sizes(self, req_id: str) -> dict[str, int]:
        """Part ``req_id``'s sizes, once its preprocessing knows them (within ``request_timeout``);
        its error if it failed first."""
        return await self.deliveries.rendezvous.wait_sizes(req_id, timeout=self.config.request_timeout)

    async def send_announced(self, req_id: str, part_idx: int, *, session: str, address: int,
                             length: int, **order: Any) -> int:
        """``send`` for a part the rendezvous knows: one already released answers how it ended."""
        try:
            return await self.send(req_id, part_idx, session=session, address=address, length=length,
                                   **order)
        except UnknownRequestError:
            self.deliveries.rendezvous.check_not_ended(req_id)
            raise

    async def sole_part(self, req_id: str) -> tuple[int, int]:
        """``(part_idx, nbytes)`` of the one live part of ``req_id``, once its size is known
        (within ``send_timeout``): for an order that names neither (SGLang's gRPC ``Send``).

        No live part is a 404; more than one a 409 (the rendezvous is failing all but one, and
        which one is not known yet).
        """
        parts = self.registry.parts_of(req_id)
        if not parts:
            raise UnknownRequestError(f"no live request {req_id!r}", req_id=req_id)
        if len(parts) > 1:
            raise ConflictError(f"parts {parts} of {req_id!r} are live; SGLang's Send names no part",
                                req_id=req_id)
        sizes = await self.deliveries.rendezvous.wait_sizes(req_id, timeout=self.config.send_timeout)
        return parts[0], sizes["embedding_size"]

    async def abort(self, req_id: str, part_idx: int | None) -> AbortResult:
        """Cancel the matching scopes and wait (up to ``send_timeout``) until they are released.

        A scope may be writing into its receiver's memory (Mooncake): the
        answer's ``released`` is the receiver's signal that it may reuse that
        memory, and is false when the wait ran out first or a write may still
        land (404 only when no part is live and none may still write).
        """
        scopes = self.registry.abort(req_id, part_idx, AbortedError("aborted by /abort", req_id=req_id))
        with trio.move_on_after(self.config.send_timeout):
            for scope in scopes:
                await scope.wait_released()
        return AbortResult(len(scopes), all(scope.let_go for scope in scopes))

    async def check_health(self) -> Health:
        if self.draining:
            return Health("draining")
        report = await self.health.check()
        return Health("ok" if report.healthy else "unhealthy", report.probed, report.detail,
                      tuple(report.dead_workers))

    # ---- one request, top to bottom -----------------------------------------
    async def _lifecycle(self, scope: RequestScope) -> None:
        """admitted → preprocessed → encoded → delivered | failed | aborted → released.

        The forward's output is delivered in this task, so the release in the
        ``finally`` can never overtake a send; every way out records how the
        scope ended once, answers the face once, and tells the receivers.
        """
        request, delivery, info = scope.request, scope.delivery, self._info

        def preprocessed(pre: Any) -> None:  # sized, before the forward
            scope.advance(Phase.PREPROCESSED)
            early = delivery.sized(_meta(request, pre.modality, pre.token_counts, pre.grid_thw,
                                         info.dim, info.dtype, pre.extras))
            if early is not None:  # e.g. Mooncake: receivers reserve while the forward runs
                scope.answer(outcome.Value(early))

        try:
            with scope.cancel_scope:  # the request deadline; /abort, a client gone, drain
                output = await self.engine.encode(request.mm_items, request.modality,
                                                  hashes=request.hashes, on_preprocessed=preprocessed)
                if output.forwarded:  # a cache hit proves nothing about the device
                    self.health.batch_completed()
                scope.advance(Phase.ENCODED)
                sending = trio.current_time()
                answer = await delivery.deliver(output.embedding, _meta(
                    request, output.modality, output.token_counts, output.grid_thw, info.dim,
                    output.embedding.dtype, output.extras))
                self.metrics.stage("send", trio.current_time() - sending)
                scope.end(None)
                if not scope.answered:
                    scope.answer(outcome.Value(answer))
            if scope.cancel_scope.cancelled_caught:
                raise scope.abort_reason or DeadlineExceeded(
                    f"request exceeded its deadline (--request-timeout {self.config.request_timeout} s, "
                    "or the caller's own)", req_id=request.req_id)
        except Exception as exc:  # noqa: BLE001 - _fail logs a bug, answers 500 and keeps serving
            await self._fail(scope, exc)
        finally:
            if not scope.ended:  # the request nursery itself was cancelled: a hard shutdown
                await self._fail(scope, NotReadyError("the encoder is shutting down"))
            await scope.release()
            self.metrics.request(request.modality, scope.error)
            self.metrics.stage("end_to_end", trio.current_time() - scope.started)

    async def _fail(self, scope: RequestScope, exc: Exception) -> None:
        """Record the failure, answer the face if it still waits, tell the receivers."""
        if isinstance(exc, EPDError):
            error = exc
        else:  # a bug: answer 500, keep serving
            log.error("request %s failed unexpectedly", scope.request.req_id, exc_info=exc)
            error = EncodeError("internal error in the encoder")
        scope.end(error)
        if not scope.answered:
            scope.answer(outcome.Error(error))
        log.info("request %s part %d %s: %s: %s", scope.request.req_id, scope.request.part_idx,
                 scope.phase.value, type(error).__name__, error)
        # Shielded with a short deadline: the receiver must hear of the failure
        # even when the scope was cancelled, but a dead receiver cannot hold us.
        notice_timeout = min(self.config.send_timeout, _ERROR_NOTICE_TIMEOUT)
        with trio.CancelScope(shield=True), trio.move_on_after(notice_timeout):
            try:
                await scope.delivery.fail(error)
            except EPDError as notice_failed:
                log.info("could not tell %s of its failure: %s", scope.request.req_id, notice_failed)
            except Exception:  # a bug in a delivery: logged, never let into the request nursery
                log.exception("telling %s of its failure failed unexpectedly", scope.request.req_id)

    # ---- lifecycle and observability ---------------------------------------
    def begin_shutdown(self) -> None:
        """Say "draining" to every health check from now on, so that a readiness probe or a
        registry's health loop takes this encoder out of rotation at once, while requests
        still arriving (from clients yet to hear of it) are admitted until ``drain``."""
        self.draining = True
        self.drain_started.set()

    async def drain(self) -> None:
        """Stop admitting, give live requests ``drain_timeout`` to finish, cancel the rest."""
        self.begin_shutdown()
        self.admitting = False
        with trio.move_on_after(self.config.drain_timeout):
            await self.registry.wait_idle()
        self.registry.cancel_all(NotReadyError("the encoder is shutting down"))

    def statistics(self) -> dict[str, Any]:
        registry, engine = self.registry.statistics(), self.engine.statistics()
        return {
            "live_requests": registry.live_requests, "queued": engine.queued,
            "requests_done": engine.requests_done, "batches_run": engine.batches_run,
            "errors": registry.failed, "draining": self.draining,
            "registry": dataclasses.asdict(registry), "engine": dataclasses.asdict(engine),
            "worker": dataclasses.asdict(self.engine.worker.statistics()),  # the first device's
            "workers": [dataclasses.asdict(w) for w in self.engine.worker_states()],
            "cache": dataclasses.asdict(engine.cache) if engine.cache is not None else None,
            "profiler": dataclasses.asdict(self.profiler.statistics()),
            "cpu_seconds": self.engine.cpu.statistics(),  # per thread-run stage, its own thread's
            **self.deliveries.statistics(),  # each transport's
            "health": dataclasses.asdict(self.health.statistics()),
        }

    def __repr__(self) -> str:
        s = self.registry.statistics()
        return (f"<EncoderService {s.live_requests} live, {s.completed} completed, {s.failed} failed, "
                f"{s.aborted} aborted{', draining' if self.draining else ''}>")


@asynccontextmanager
async def open_encoder_service(config: EncoderConfig, engine: Engine) -> AsyncIterator[EncoderService]:
    """The service with the transports its deliveries borrow and its request nursery; drains on exit."""
    async with open_deliveries(config) as deliveries, trio.open_nursery() as nursery:
        service = EncoderService(config, engine, deliveries, nursery)
        observers = (service.metrics, service.profiler)
        engine.observers.extend(observers)
        try:
            yield service
        finally:
            with trio.CancelScope(shield=True):
                await service.drain()
            nursery.cancel_scope.cancel()
            for observer in observers:
                engine.observers.remove(observer)
            service.profiler.close()
