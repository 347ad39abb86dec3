"""The encoder service: request scopes around the engine, and their delivery.

Each accepted ``/encode`` becomes a **request scope**, a task in the service's
request nursery (DESIGN §3). Inside it a nursery runs *encode*, then *send* to
each destination as child tasks; *release* is the scope's ``finally``, after
that nursery has closed — so a release never overtakes a send, by
construction. A failed, aborted or timed-out scope still *delivers*: its ZMQ
destinations get an ``error`` message so receivers fail fast. The HTTP handler
only waits for the scope's answer (and cancels the scope if its client leaves).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import outcome
import trio

from epd_trio._util import first_leaf
from epd_trio.config import EncoderConfig
from epd_trio.encoder.health import HealthMonitor
from epd_trio.encoder.metrics import ServiceMetrics
from epd_trio.encoder.profiling import Profiler
from epd_trio.encoder.requests import RequestRegistry, RequestScope
from epd_trio.encoder.staging import Mailbox, SendOrder, serve_send_orders
from epd_trio.engine import Engine
from epd_trio.errors import (
    AbortedError,
    DeadlineExceeded,
    EncodeError,
    EPDError,
    NotReadyError,
    RequestError,
    UnknownRequestError,
)
from epd_trio.model.adapters import PreprocessResult
from epd_trio.protocol.codec import encode_zmq_message, error_message, header_for
from epd_trio.protocol.requests import EncodeMeta, EncodeRequest
from epd_trio.transport.mooncake import MooncakeTransport, open_mooncake
from epd_trio.transport.zmq import PushSocketCache

if TYPE_CHECKING:
    from epd_trio.testing import FaultPlan

__all__ = ["EncoderService", "open_encoder_service"]

log = logging.getLogger(__name__)

# A final error notice to a receiver must not hold shutdown or a release for long.
_ERROR_NOTICE_TIMEOUT = 5.0


@dataclass(frozen=True)
class EncodeAnswer:
    """What the HTTP handler turns into a response.

    For Mooncake it is given before the forward (``embedding`` is None): the
    receiver needs ``nbytes`` early to reserve memory.
    """

    request: EncodeRequest
    modality: str
    token_counts: list[int]
    grid_thw: list[list[int]]
    dim: int
    dtype: str
    embedding: Any = None  # torch.Tensor [tokens, dim] once encoded
    extras: dict[str, list[Any]] = dataclasses.field(default_factory=dict)  # per item

    @property
    def tokens(self) -> int:
        return sum(self.token_counts)

    @property
    def nbytes(self) -> int:
        import torch

        return self.tokens * self.dim * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    def meta(self) -> EncodeMeta:
        return EncodeMeta(
            req_id=self.request.req_id, part_idx=self.request.part_idx,
            num_parts=self.request.num_parts, modality=self.modality, tokens=self.tokens,
            dim=self.dim, dtype=self.dtype, token_counts=self.token_counts, grid_thw=self.grid_thw,
            extras=self.extras)


def _released(request: EncodeRequest) -> EPDError:
    return UnknownRequestError(f"request {request.req_id!r} part {request.part_idx} was released",
                               req_id=request.req_id)


def _answer(request: EncodeRequest, modality: str, token_counts: Any, grid_thw: Any, dim: int,
            dtype: Any, embedding: Any = None, extras: Any = None) -> EncodeAnswer:
    return EncodeAnswer(request, modality, list(token_counts), [list(g) for g in grid_thw], dim,
                        str(dtype).removeprefix("torch."), embedding,
                        {key: list(values) for key, values in (extras or {}).items()})


class EncoderService:
    """Owns the live request scopes of one encoder; build with ``open_encoder_service``."""

    def __init__(self, config: EncoderConfig, engine: Engine, zmq: PushSocketCache,
                 nursery: trio.Nursery, mooncake: MooncakeTransport | None = None) -> None:
        self.config = config
        self.engine = engine
        self.zmq = zmq
        self.mooncake = mooncake
        self.registry = RequestRegistry()
        self.health = HealthMonitor(engine, nursery, timeout=config.health_timeout,
                                    fresh=config.health_fresh)
        self._nursery = nursery
        self.draining = False
        self.faults: FaultPlan | None = None  # epd_trio.testing installs one; never the network
        self.metrics = ServiceMetrics(self)
        self.profiler = Profiler(config.profile_dir, nursery)

    # ---- the HTTP handler's side ------------------------------------------
    async def encode(self, request: EncodeRequest) -> EncodeAnswer:
        """Run ``request`` in its own scope and wait for the answer to give."""
        try:
            scope = await self._start_scope(request)
        except EPDError as exc:  # refused before a scope existed (a scope counts its own outcome)
            self.metrics.request(request.modality, exc)
            raise
        try:
            await scope.ready.wait()  # bounded: the scope has the request deadline
        finally:
            if not scope.ready.is_set():  # our client left (disconnect) or we were cancelled
                scope.cancel(AbortedError("the client went away", req_id=request.req_id))
        assert scope.result is not None
        return scope.result.unwrap()

    async def _start_scope(self, request: EncodeRequest) -> RequestScope:
        if self.draining:
            raise NotReadyError("the encoder is draining and accepts no new requests")
        if request.deliver.backend == "mooncake" and self.mooncake is None:
            raise RequestError("this encoder does not serve Mooncake delivery "
                               "(start it with --transfer-backend mooncake)", req_id=request.req_id)
        # The hand-off is shielded. Were this caller cancelled (its client gone)
        # before the scope's first step, trio would leave the scope in the
        # caller's cancelled context instead of moving it to the request
        # nursery: it would die of the caller's Cancelled, counted as failed,
        # its receivers never told. ``_run_scope`` calls ``started`` before its
        # first checkpoint, so the shield lasts one scheduling pass; a
        # cancellation meanwhile lands at ``ready.wait()`` and aborts the scope.
        with trio.CancelScope(shield=True):
            return await self._nursery.start(self._run_scope, request)

    async def send(self, req_id: str, part_idx: int, order: SendOrder) -> int:
        """A Mooncake ``/send``: have the request's scope write its bytes; wait until in place."""
        scope = self.registry.get((req_id, part_idx))
        if not isinstance(scope.mailbox, Mailbox):
            raise RequestError(f"request {req_id!r} part {part_idx} is not a Mooncake delivery",
                               req_id=req_id)
        scope.mailbox.post(order)
        await order.done.wait()  # bounded: the scope finishes every order it was given
        assert order.result is not None
        return order.result.unwrap()

    async def abort(self, req_id: str, part_idx: int | None) -> int:
        """Cancel the matching scopes; Mooncake ones are waited for (bounded).

        A Mooncake scope may be writing into the receiver's memory: the answer
        to ``/abort`` is the receiver's signal that it may reuse that memory.
        """
        scopes = self.registry.abort(req_id, part_idx, AbortedError("aborted by /abort", req_id=req_id))
        with trio.move_on_after(self.config.send_timeout):
            for scope in scopes:
                if scope.mailbox is not None:
                    await scope.finished.wait()
        return len(scopes)

    # ---- the request scope --------------------------------------------------
    async def _run_scope(self, request: EncodeRequest, *,
                         task_status: trio.TaskStatus[RequestScope]) -> None:
        with self.registry.register(request.key) as scope:
            started = trio.current_time()
            scope.cancel_scope.deadline = started + self.config.request_timeout
            task_status.started(scope)
            succeeded = False
            try:
                with scope.cancel_scope:
                    await self._encode_and_deliver(request, scope)
                if scope.cancel_scope.cancelled_caught:
                    raise scope.cancel_reason or DeadlineExceeded(
                        f"request exceeded its {self.config.request_timeout} s deadline",
                        req_id=request.req_id)
                succeeded = True
            except EPDError as exc:
                await self._fail(request, scope, exc)
            except Exception as exc:  # a bug: answer 500, keep serving
                log.exception("request %s failed unexpectedly", request.req_id)
                await self._fail(request, scope, exc)
            finally:
                # Shutdown cancels the request nursery: answer, never leave the handler waiting.
                scope.set_result(outcome.Error(NotReadyError("the encoder is shutting down")))
                self._count(request, started, None if succeeded else
                            scope.failure or NotReadyError("the encoder is shutting down"))
                if self.faults is not None:
                    await self._release_fault(request)
            # release: leaving register() drops the scope and what it held

    async def _encode_and_deliver(self, request: EncodeRequest, scope: RequestScope) -> None:
        info = self.engine.model_info
        mooncake = request.deliver.backend == "mooncake"
        if mooncake:
            scope.mailbox = Mailbox(request.deliver.receive_count)

        def sized(pre: PreprocessResult) -> None:
            if mooncake:  # answer now: the receiver reserves memory while we run the forward
                scope.set_result(outcome.Value(_answer(
                    request, pre.modality, pre.token_counts, pre.grid_thw, info.dim, info.dtype,
                    extras=pre.extras)))

        try:
            output = await self.engine.encode(request.mm_items, request.modality,
                                              hashes=request.hashes, on_preprocessed=sized)
            self.health.batch_completed()
            answer = _answer(request, output.modality, output.token_counts, output.grid_thw,
                             info.dim, output.embedding.dtype, output.embedding, output.extras)
            if self.faults is not None and request.deliver.backend != "inline":
                await self.faults.inject("send", cancel=lambda: scope.cancel(
                    AbortedError("injected cancellation", req_id=request.req_id)))
            sending = trio.current_time()
            if mooncake:
                assert self.mooncake is not None
                await serve_send_orders(self.mooncake, scope.mailbox, output.embedding,
                                        self.config.send_timeout)
            elif request.deliver.backend == "zmq":
                header = header_for(
                    output.embedding, req_id=request.req_id, part_idx=request.part_idx,
                    num_parts=request.num_parts, modality=output.modality,
                    token_counts=output.token_counts, grid_thw=output.grid_thw,
                    extras=output.extras)
                await self._send_all(request, encode_zmq_message(header, output.embedding))
            if request.deliver.backend != "inline":  # inline: the HTTP handler times its body
                self.metrics.stage("send", trio.current_time() - sending)
            scope.set_result(outcome.Value(answer))
        except BaseException as exc:
            if mooncake:  # /send callers waiting for this request learn why it ended
                reason = exc if isinstance(exc, EPDError) else scope.cancel_reason
                scope.mailbox.close(reason or _released(request))
            raise
        else:
            if mooncake:
                scope.mailbox.close(_released(request))

    def _count(self, request: EncodeRequest, started: float, failure: BaseException | None) -> None:
        self.metrics.request(request.modality, failure)
        self.metrics.stage("end_to_end", trio.current_time() - started)

    async def _release_fault(self, request: EncodeRequest) -> None:
        """The "release" fault point: a delay or error here must not stop the release."""
        assert self.faults is not None
        with trio.CancelScope(shield=True):
            try:
                await self.faults.inject("release")
            except EPDError as exc:
                log.info("fault at release of %s: %s (released anyway)", request.req_id, exc)

    async def _send_all(self, request: EncodeRequest, frames: list[Any]) -> None:
        """Send to every destination as child tasks; the first failure fails the request."""
        try:
            async with trio.open_nursery() as nursery:
                for endpoint in request.deliver.endpoints:
                    nursery.start_soon(self.zmq.send, endpoint, frames, self.config.send_timeout)
        except* EPDError as group:
            raise first_leaf(group) from None

    async def _fail(self, request: EncodeRequest, scope: RequestScope, exc: BaseException) -> None:
        error = exc if isinstance(exc, EPDError) else EncodeError("internal error in the encoder")
        scope.failure = error
        scope.set_result(outcome.Error(error))
        log.info("request %s part %d failed: %s: %s", request.req_id, request.part_idx,
                 type(error).__name__, error)
        if request.deliver.backend != "zmq":
            return
        frames = error_message(request.req_id, request.part_idx, request.num_parts,
                               request.modality, error)
        # Shielded with a short deadline: the receiver must hear of the failure
        # even when the scope was cancelled, but a dead receiver cannot hold us.
        notice_timeout = min(self.config.send_timeout, _ERROR_NOTICE_TIMEOUT)
        with trio.CancelScope(shield=True), trio.move_on_after(notice_timeout):
            try:
                await self._send_all(request, frames)
            except EPDError as notice_failed:
                log.info("could not tell %s of its failure: %s", request.req_id, notice_failed)

    # ---- lifecycle and observability ---------------------------------------
    async def drain(self) -> None:
        """Stop admitting, give live requests ``drain_timeout`` to finish, cancel the rest."""
        self.draining = True
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
            "zmq": dataclasses.asdict(self.zmq.statistics()),
            "mooncake": dataclasses.asdict(self.mooncake.statistics()) if self.mooncake else None,
            "health": dataclasses.asdict(self.health.statistics()),
        }


@asynccontextmanager
async def open_encoder_service(config: EncoderConfig, engine: Engine) -> AsyncIterator[EncoderService]:
    """The service with its ZMQ socket cache and request nursery; drains on exit."""
    async with PushSocketCache(max_sockets=config.zmq_max_sockets,
                               idle_close=config.zmq_idle_close) as zmq, \
            _maybe_mooncake(config) as mooncake, trio.open_nursery() as nursery:
        service = EncoderService(config, engine, zmq, nursery, mooncake)
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


@asynccontextmanager
async def _maybe_mooncake(config: EncoderConfig) -> AsyncIterator[MooncakeTransport | None]:
    if config.transfer_backend != "mooncake":
        yield None
        return
    host = config.mooncake_host or ("127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host)
    async with open_mooncake(host, config.mooncake_protocol, config.mooncake_device) as mooncake:
        yield mooncake
