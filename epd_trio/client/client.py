"""``EncoderClient``: split a request over encoders, gather the parts, stitch them.

A thin owner of the client's resources (one HTTP client, one gRPC channel per
``grpc://`` encoder, the ``EmbeddingPool``, its receiver, one nursery)
composing three parts, each with its own ``statistics()``: the ``Router``
(``router``: placement, failover, outstanding counts, ``/abort``), the
``Receiver`` (``receiver``: how parts come back, one per ``transfer_backend``,
see ``receiving``) and the ``Discovery`` task (``discovery``: the registry's
list, with ``bootstrap_url``, and a DNS name's, with ``discovery_dns``).

A request is one ``req_id`` and several parts (see ``routing``). Its parts run
as sibling tasks under one cancel scope; each posts its ``/encode`` with the
``deliver`` its receiver chooses for that encoder and hands the answer to the
receiver (``take``); once all are taken, the receiver gathers them into one
pool slot (``gather``). The first failure (an encoder's HTTP error, an error
message, an unreachable encoder) is recorded and cancels the rest. Whatever
ends a request early — failure, deadline, the caller's cancellation, the
client closing — the parts an encoder may still be working on are aborted
there (best effort, shielded, short deadline), and only then does the receiver
release the request's slot (``release_failed``: an encoder writing in place
may still be writing until it hears of the failure); the request leaves
nothing behind: ``statistics()`` proves it.

``encode_for_vllm`` runs a request the same way (plan, routing, deadline,
clean-up) over encoder instances of vLLM's EPD instead: each part is an OpenAI
chat request that the encoder answers once it has stored the items for the
language server (``vllm_parts``); nothing comes back to the client's pool, so
the receiver takes no part in it.

Fault plans (``epd_trio.testing``) wrap three seams and nothing here checks for
one: ``router.post`` (``client_dispatch``), ``receiver.gather``
(``client_gather``) and, where the receiver has one, ``receiver.demux.hand_off``
(``demux``).
"""

from __future__ import annotations

import dataclasses
import functools
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any, Final, Self, TypeVar

import httpx
import trio

from epd_trio.client.addresses import advertised_endpoint
from epd_trio.client.answers import Answer, http_error
from epd_trio.client.calls import EncoderCalls, encoder_transport
from epd_trio.client.discovery import Discovery, merge_urls
from epd_trio.client.grpc_channel import GrpcChannels
from epd_trio.client.items import is_heavy, to_wire_items
from epd_trio.client.metrics import ClientMetrics
from epd_trio.client.pool import EmbeddingPool
from epd_trio.client.receiving import Receiver, build_receiver
from epd_trio.client.result import EncodedRequest
from epd_trio.client.router import Router
from epd_trio.client.state import ClientStatistics, LiveRequest, PartState
from epd_trio.client.vllm_parts import (
    CHAT_PATH,
    StoredRequest,
    merge_transfer_params,
    part_body,
    part_request_id,
    retryable,
    transfer_params,
)
from epd_trio.config import ClientConfig
from epd_trio.errors import (
    AbortedError,
    DuplicateRequestError,
    EncodeTimeout,
    EPDError,
    PeerUnavailable,
    ProtocolError,
    RequestError,
)
from epd_trio.protocol.messages import validate_req_id

__all__ = [
    "ClientStatistics",
    "EncoderClient",
    "advertised_endpoint",
    "open_encoder_client",
]

_T = TypeVar("_T")

# An HTTP answer may exceed the pool by its header and metadata, no more.
_ANSWER_SLACK: Final = 1 << 20


class EncoderClient:
    """The receiver side of EPD; build with ``open_encoder_client``, use in ``async with``.

    It composes a ``Router`` (placement, failover, outstanding counts, aborts),
    a ``Receiver`` (how parts come back: ``config.transfer_backend`` picks it
    from ``receiving.RECEIVERS``) and, with ``bootstrap_url`` or
    ``discovery_dns``, a ``Discovery`` task; what remains here is a request's
    own course: register, run the parts, gather, clean up.
    """

    def __init__(self, config: ClientConfig, *,
                 http_transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        self.router = Router(merge_urls(config.encoder_urls))
        self.discovery = Discovery(
            config.encoder_urls, config.bootstrap_url, interval=config.refresh_interval,
            timeout=config.registry_timeout, on_list=self.router.set_encoders,
            dns=config.discovery_dns,
        ) if config.bootstrap_url or config.discovery_dns else None
        self.pool = EmbeddingPool(config.pool_bytes)
        self.receiver: Receiver = build_receiver(config, self.pool, self.router.settle)
        self._transport = http_transport
        self._http: httpx.AsyncClient | None = None
        self._calls: EncoderCalls | None = None
        self.grpc = GrpcChannels()  # grpc:// encoders' channels, opened on first use
        self._stack = AsyncExitStack()
        self._closed = False
        self._drained: trio.Event | None = None  # set when the last request is gone, on close
        self._requests: dict[str, LiveRequest] = {}
        self._done = 0
        self._failed = 0
        self.metrics = ClientMetrics(self.statistics)

    @property
    def encoders(self) -> tuple[str, ...]:
        """The encoders new requests are planned over (static, then the registry's)."""
        return self.router.encoders

    @property
    def endpoint(self) -> str:
        """The one address every encoder is told to deliver to, when the configuration names
        one (``zmq_bind`` that is no wildcard, or ``zmq_advertise``); "" otherwise."""
        return self.receiver.endpoint

    @property
    def metrics_registry(self) -> Any:
        """This client's ``prometheus_client.CollectorRegistry`` (see ``client.metrics``)."""
        return self.metrics.registry

    # ---- lifecycle ----------------------------------------------------------
    async def __aenter__(self) -> Self:
        if self._closed or self._http is not None:
            raise RuntimeError("an EncoderClient can be opened once")
        try:
            await self._stack.enter_async_context(self.receiver)
            timeout = httpx.Timeout(None, connect=self.config.connect_timeout)  # deadlines are ours
            self._http = http = await self._stack.enter_async_context(
                httpx.AsyncClient(timeout=timeout, transport=self._transport or encoder_transport()))
            probes = None if self._transport is not None else await self._stack.enter_async_context(
                httpx.AsyncClient(timeout=timeout, transport=encoder_transport()))
            # A part's answer holds at most its embedding (inline), which must fit the pool.
            self._calls = EncoderCalls(http, await self._stack.enter_async_context(self.grpc),
                                       max_answer_bytes=self.config.pool_bytes + _ANSWER_SLACK,
                                       probes=probes)
            nursery = await self._stack.enter_async_context(trio.open_nursery())
            if self.discovery is not None:
                await nursery.start(self.discovery.run, http)  # the first list before any request
            self._stack.callback(nursery.cancel_scope.cancel)  # runs before the nursery exits
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        # The body's exception is not passed to the nursery, so it is not wrapped in a group.
        self._closed = True
        if self._requests:
            # Requests still running in other tasks fail now; give them the time their
            # /abort calls need before the HTTP client goes (shielded, bounded).
            self._drained = trio.Event()
            for req in list(self._requests.values()):
                req.fail(AbortedError("the encoder client was closed", req_id=req.req_id))
            with trio.CancelScope(shield=True), trio.move_on_after(self.config.abort_timeout + 1):
                await self._drained.wait()
        await self._stack.aclose()

    # ---- the public API -----------------------------------------------------
    async def encode(self, items: Mapping[str, Sequence[Any]], *, timeout: float | None = None,
                     req_id: str | None = None) -> EncodedRequest:
        """Encode ``{"image": [...], "video": [...], "audio": [...]}`` on the encoders.

        Items are bytes, ``data:``/``http(s)`` URL strings or PIL images. The
        result holds a pool slot: use ``async with await client.encode(...)``.
        Raises ``EncodeError`` (an encoder failed), ``EncodeTimeout``
        (``timeout``, default ``config.timeout``, passed), ``PeerUnavailable``
        (no encoder reachable), ``RequestError`` (bad items or too big for the pool).
        """
        self._require_open()

        async def run(limit: float, deadline: float) -> EncodedRequest:
            wire = await trio.to_thread.run_sync(to_wire_items, items) if is_heavy(items) \
                else to_wire_items(items)
            return await self._run(self._register(req_id, wire), limit, deadline, self._complete)

        return await self._measured(timeout, run)

    async def encode_for_vllm(self, parts: Mapping[str, Sequence[Mapping[str, Any]]], *,
                              options: Mapping[str, Any] | None = None,
                              timeout: float | None = None,
                              req_id: str | None = None) -> StoredRequest:
        """Have encoder instances of vLLM's EPD store a chat request's media items.

        ``parts`` maps each modality to its OpenAI content parts, verbatim
        (``{"type": "image_url", "image_url": {...}, "uuid": ...}``); ``options``
        is the original request (``vllm_parts.FORWARDED_OPTIONS`` are copied from
        it). The parts are planned, routed and bounded as ``encode``'s are; each
        is one ``POST /v1/chat/completions`` (``vllm_parts``), done when it answers
        200. A part whose encoder fails (unreachable, connection lost, a 5xx)
        moves to another; an encoder's 4xx fails the request as a
        ``RemoteEncodeError`` with that status. Ending a part's call early is its
        abort: the connection closes, and an encoder instance drops the work.
        """
        self._require_open()
        wire = {modality: list(items) for modality, items in parts.items()}

        async def run(limit: float, deadline: float) -> StoredRequest:
            complete = functools.partial(self._complete_for_vllm, options=options or {})
            return await self._run(self._register(req_id, wire), limit, deadline, complete)

        return await self._measured(timeout, run)

    async def _measured(self, timeout: float | None,
                        run: Callable[[float, float], Awaitable[_T]]) -> _T:
        """``run(limit, deadline)``, counted in the client's metrics."""
        limit = self.config.timeout if timeout is None else timeout
        started = trio.current_time()
        try:
            result = await run(limit, started + limit)
        except BaseException as exc:
            self.metrics.request(trio.current_time() - started, exc)
            raise
        self.metrics.request(trio.current_time() - started, None)
        return result

    async def _run(self, req: LiveRequest, limit: float, deadline: float,
                   complete: Callable[[LiveRequest], Awaitable[_T]]) -> _T:
        """``complete(req)`` by ``deadline``; whatever ends it early aborts and unregisters."""
        try:
            with trio.move_on_at(deadline):
                result = await complete(req)
                self._done += 1
                return result
            raise EncodeTimeout(f"request {req.req_id} was not encoded within {limit:g} s",
                                req_id=req.req_id)
        except BaseException:
            self._failed += 1
            confirmed = False
            try:
                if self._calls is not None:
                    confirmed = await self.router.abort(self._calls, req, self.config.abort_timeout)
            finally:
                # Only now: an encoder may write into the slot until it hears of the abort.
                if req.slot is not None:
                    self.receiver.release_failed(req, req.slot, confirmed)
            raise
        finally:
            self._unregister(req)

    def statistics(self) -> ClientStatistics:
        routed, received = self.router.statistics(), self.receiver.statistics()
        return ClientStatistics(
            encoders=routed.encoders, outstanding=routed.outstanding,
            requests_live=len(self._requests),
            parts_live=sum(len(req.parts) for req in self._requests.values()),
            requests_done=self._done, requests_failed=self._failed, retries=routed.retries,
            messages_received=received.messages_received,
            messages_dropped=received.messages_dropped,
            malformed_messages=received.malformed_messages, aborts_sent=routed.aborts_sent,
            aborts_failed=routed.aborts_failed,
            refresh_failures=self._refresh_failures(),
            slots_held_after_abort=received.slots_held_after_abort,
            pool=self.pool.statistics(),
            mooncake=received.transfer_engine,
        )

    def _refresh_failures(self) -> int:
        if self.discovery is None:
            return 0
        s = self.discovery.statistics()
        return s.refresh_failures + s.dns_failures

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<EncoderClient {len(s.encoders)} encoders, {s.requests_live} requests live"
            f" ({sum(s.outstanding.values())} parts out), done {s.requests_done},"
            f" failed {s.requests_failed}, dropped messages {s.messages_dropped}; {self.pool!r}>"
        )

    # ---- one request --------------------------------------------------------
    def _register(self, req_id: str | None, wire: dict[str, list[Any]]) -> LiveRequest:
        """Plan the parts and make them findable by what delivers them (synchronously)."""
        self._still_open()  # the client may have closed while the items were converted
        if not self.router.encoders:
            raise PeerUnavailable("no encoder is available (no static URL, none healthy in the registry)")
        req_id = f"epd-{uuid.uuid4().hex}" if req_id is None else req_id
        try:
            validate_req_id(req_id)
        except ProtocolError as exc:
            raise RequestError(exc.message) from None
        if req_id in self._requests:
            raise DuplicateRequestError(f"request {req_id!r} is already live", req_id=req_id)
        plan = self.router.plan({m: len(v) for m, v in wire.items()})
        req = LiveRequest(req_id, wire, [PartState(p, p.encoder_url) for p in plan])
        self._requests[req_id] = req
        self.receiver.register(req)
        return req

    def _unregister(self, req: LiveRequest) -> None:
        for state in req.parts:
            self.router.settle(state)
        self.receiver.unregister(req)
        del self._requests[req.req_id]
        if not self._requests and self._drained is not None:
            self._drained.set()

    async def _complete(self, req: LiveRequest) -> EncodedRequest:
        """Run the parts, then gather them into one pool slot; raises the first failure."""
        with req.scope:
            async with trio.open_nursery() as nursery:
                for state in req.parts:
                    nursery.start_soon(self._run_part, req, state)
            if req.failure is None:
                return await self.receiver.gather(req, self._still_open())
        assert req.failure is not None  # only fail() cancels req.scope
        raise req.failure

    async def _complete_for_vllm(self, req: LiveRequest, options: Mapping[str, Any]) -> StoredRequest:
        """Run the parts as vLLM chat requests; raises the first failure."""
        stored: dict[int, Mapping[str, Any]] = {}
        with req.scope:
            async with trio.open_nursery() as nursery:
                for state in req.parts:
                    nursery.start_soon(self._store_part, req, state, options, stored)
            if req.failure is None:
                params = merge_transfer_params([stored[i] for i in sorted(stored)])
                return StoredRequest(req.req_id, params, req.reports())
        assert req.failure is not None  # only fail() cancels req.scope
        raise req.failure

    async def _store_part(self, req: LiveRequest, state: PartState, options: Mapping[str, Any],
                          stored: dict[int, Mapping[str, Any]]) -> None:
        part = state.part
        try:
            state.started = trio.current_time()
            body = part_body([req.wire[part.modality][i] for i in part.item_indices], options)
            headers = {"x-request-id": part_request_id(req.req_id, part.part_idx)}
            response = await self.router.post(self._still_open(), req, state, body, path=CHAT_PATH,
                                              headers=headers, retry_status=retryable)
            if response.status_code != 200:
                raise http_error(response, req.req_id, state.encoder_url, part.part_idx)
            stored[part.part_idx] = transfer_params(response, part.part_idx, state.encoder_url)
            state.finished = trio.current_time()
        except EPDError as exc:
            req.fail(exc)
        finally:
            state.answered = True  # answered, or its call ended (the encoder's abort): nothing to /abort
            self.router.settle(state)

    # ---- one part -------------------------------------------------------------
    async def _run_part(self, req: LiveRequest, state: PartState) -> None:
        staged = False
        try:
            state.started = trio.current_time()
            response = await self._post(req, state)
            await self.receiver.take(req, state, response, self._still_open())
            staged = self.receiver.staged  # still outstanding: the encoder holds it for gather
        except EPDError as exc:
            req.fail(exc)
        finally:
            if not staged:
                self.router.settle(state)

    async def _post(self, req: LiveRequest, state: PartState) -> Answer:
        """/encode through the router; its 200 answer, else the encoder's error."""
        part, calls = state.part, self._still_open()
        body = {
            "req_id": req.req_id, "modality": part.modality,
            "mm_items": [req.wire[part.modality][i] for i in part.item_indices],
            "num_parts": len(req.parts), "part_idx": part.part_idx,
        }
        # "deliver" is the encoder's own: where it can reach us (chosen per attempt).
        response = await self.router.post(calls, req, state, body, deliver=self.receiver.deliver_for)
        # A staging receiver's 200 leaves the part on the encoder until its gather fetches it.
        state.answered = response.status_code != 200 or not self.receiver.staged
        if response.status_code != 200:
            raise http_error(response, req.req_id, state.encoder_url, part.part_idx)
        return response

    def _still_open(self) -> EncoderCalls:
        """``_require_open`` for a request already under way: a close aborts it, as it
        aborts the requests it finds registered."""
        if self._closed:
            raise AbortedError("the encoder client was closed")
        return self._require_open()

    def _require_open(self) -> EncoderCalls:
        if self._closed:
            raise trio.ClosedResourceError("the encoder client is closed")
        if self._calls is None:
            raise RuntimeError("use the encoder client in an 'async with' block")
        return self._calls


def open_encoder_client(config: ClientConfig | None = None, *,
                        http_transport: httpx.AsyncBaseTransport | None = None,
                        **overrides: Any) -> EncoderClient:
    """``async with open_encoder_client(config) as client:`` — config fields may be overridden.

    ``http_transport`` replaces httpx's network transport (tests use a MockTransport).
    """
    config = config or ClientConfig()
    if "encoder_urls" in overrides:
        overrides["encoder_urls"] = tuple(overrides["encoder_urls"])
    if overrides:
        config = dataclasses.replace(config, **overrides)
    return EncoderClient(config, http_transport=http_transport)
