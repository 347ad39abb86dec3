"""``EncoderClient``: split a request over encoders, gather the parts, stitch them.

A thin owner of the client's resources (one HTTP client, one gRPC channel per
``grpc://`` encoder, the ``EmbeddingPool``, a PULL socket or a Mooncake engine,
one nursery) composing three parts, each
with its own ``statistics()``: the ``Router`` (``router``: placement, failover,
outstanding counts, ``/abort``), the ``Demultiplexer`` (``demux``: ZMQ messages
to the parts waiting for them) and the ``Discovery`` task (``discovery``: the
registry's list, with ``bootstrap_url``, and a DNS name's, with ``discovery_dns``).
What each encoder is told to deliver to comes from ``addresses`` (``ReturnAddresses``:
an address of this host it can reach).

A request is one ``req_id`` and several parts (see ``routing``). Its parts run
as sibling tasks under one cancel scope; the first failure (an encoder's HTTP
error, a ZMQ ``error`` message, an unreachable encoder) is recorded and
cancels the rest. Whatever ends a request early — failure, deadline, the
caller's cancellation, the client closing — the parts an encoder may still be
working on are aborted there (best effort, shielded, short deadline), and the
request leaves nothing behind: ``statistics()`` proves it.

``encode_for_vllm`` runs a request the same way (plan, routing, deadline,
clean-up) over encoder instances of vLLM's EPD instead: each part is an OpenAI
chat request that the encoder answers once it has stored the items for the
language server (``vllm_parts``); nothing comes back to the client's pool.

With ``transfer_backend="mooncake"`` there is no PULL socket: parts are written
straight into the request's slot (``inplace``). A request owns its slot until
its result does; on failure the slot is released only after the parts'
``/abort`` calls, since an encoder may still be writing into it until it hears
of the failure.

Fault plans (``epd_trio.testing``) wrap three seams and nothing here checks for
one: ``router.post`` (``client_dispatch``), ``_assemble`` (``client_gather``)
and ``demux.hand_off`` (``demux``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any, Final, TypeVar

import httpx
import trio

from epd_trio._routes import Routes
from epd_trio.client.addresses import ReturnAddresses, advertised_endpoint, choose_mooncake_host
from epd_trio.client.answers import (
    Answer,
    check_message,
    check_sized_meta,
    http_error,
    inline_message,
    parse_meta,
    parse_sized_meta,
)
from epd_trio.client.calls import EncoderCalls, encoder_transport
from epd_trio.client.demux import Demultiplexer
from epd_trio.client.discovery import Discovery, merge_urls
from epd_trio.client.grpc_channel import GrpcChannels
from epd_trio.client.inplace import open_registered_engine, write_parts
from epd_trio.client.items import is_heavy, to_wire_items
from epd_trio.client.metrics import ClientMetrics
from epd_trio.client.pool import EmbeddingPool, Slot
from epd_trio.client.result import (
    EncodedRequest,
    PartReport,
    ReceivedPart,
    copy_parts,
    plan_layout,
    slot_views,
)
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
from epd_trio.transport.mooncake import MooncakeTransport
from epd_trio.transport.zmq import PullReceiver

__all__ = [
    "ClientStatistics",
    "EncoderClient",
    "advertised_endpoint",
    "open_encoder_client",
]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# An HTTP answer may exceed the pool by its header and metadata, no more.
_ANSWER_SLACK: Final = 1 << 20
# Copying this much (~2 ms at memcpy speed) is worth a thread hop off the trio loop.
_COPY_IN_THREAD_BYTES: Final = 16 << 20


class EncoderClient:
    """The receiver side of EPD; build with ``open_encoder_client``, use in ``async with``.

    It composes a ``Router`` (placement, failover, outstanding counts, aborts),
    a ``Demultiplexer`` (the PULL socket and the table of live parts) and, with
    ``bootstrap_url`` or ``discovery_dns``, a ``Discovery`` task; what remains here is a request's
    own course: register, run the parts, gather, clean up.
    """

    def __init__(self, config: ClientConfig, *,
                 http_transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        self.router = Router(merge_urls(config.encoder_urls))
        self.demux = Demultiplexer()
        self.discovery = Discovery(
            config.encoder_urls, config.bootstrap_url, interval=config.refresh_interval,
            timeout=config.registry_timeout, on_list=self.router.set_encoders,
            dns=config.discovery_dns,
        ) if config.bootstrap_url or config.discovery_dns else None
        self.pool = EmbeddingPool(config.pool_bytes)
        self.routes = Routes(timeout=config.connect_timeout)  # to encoders: whom to tell what
        self.addresses: ReturnAddresses | None = None  # what each encoder is told; set once open
        self.mooncake: MooncakeTransport | None = None  # set once open (mooncake only)
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
        self._slots_held = 0  # Mooncake slots held after an unconfirmed /abort (see abort_hold)
        self._nursery: trio.Nursery | None = None
        self.metrics = ClientMetrics(self.statistics)

    @property
    def encoders(self) -> tuple[str, ...]:
        """The encoders new requests are planned over (static, then the registry's)."""
        return self.router.encoders

    @property
    def endpoint(self) -> str:
        """The one ZMQ endpoint every encoder is told, when ``zmq_bind`` names one that is no
        wildcard (or ``zmq_advertise`` is set); "" otherwise (see ``addresses``)."""
        return self.addresses.endpoint if self.addresses is not None else ""

    @property
    def metrics_registry(self) -> Any:
        """This client's ``prometheus_client.CollectorRegistry`` (see ``client.metrics``)."""
        return self.metrics.registry

    # ---- lifecycle ----------------------------------------------------------
    async def __aenter__(self) -> EncoderClient:
        if self._closed or self._http is not None:
            raise RuntimeError("an EncoderClient can be opened once")
        pull: PullReceiver | None = None
        try:
            if self.config.transfer_backend == "mooncake":
                host = await choose_mooncake_host(self.config, self.routes)
                self.mooncake = await open_registered_engine(self._stack, self.config, self.pool, host)
                self.addresses = ReturnAddresses(self.config, self.routes, mooncake_host=host)
            elif self.config.transfer_backend == "zmq":
                pull = await self._stack.enter_async_context(PullReceiver(None))
                self.addresses = ReturnAddresses(self.config, self.routes, pull=pull)
            else:
                self.addresses = ReturnAddresses(self.config, self.routes)
            timeout = httpx.Timeout(None, connect=self.config.connect_timeout)  # deadlines are ours
            self._http = http = await self._stack.enter_async_context(
                httpx.AsyncClient(timeout=timeout, transport=self._transport or encoder_transport()))
            # A part's answer holds at most its embedding (inline), which must fit the pool.
            self._calls = EncoderCalls(http, await self._stack.enter_async_context(self.grpc),
                                       max_answer_bytes=self.config.pool_bytes + _ANSWER_SLACK)
            self._nursery = nursery = await self._stack.enter_async_context(trio.open_nursery())
            if pull is not None:
                nursery.start_soon(self.demux.run, pull)
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
                    self._release_after_abort(req, req.slot, confirmed)
            raise
        finally:
            self._unregister(req)

    def _release_after_abort(self, req: LiveRequest, slot: Slot, confirmed: bool) -> None:
        """Free a failed request's slot, unless a Mooncake encoder that did not confirm its
        abort may still write into it: then hold it for ``abort_hold`` seconds first (the
        pool never hands out memory a late write could land in)."""
        if confirmed or self.mooncake is None or self._nursery is None:
            slot.release()
            return
        self._slots_held += 1
        log.warning("request %s: an encoder did not confirm its /abort; its pool slot is held "
                    "%g s in case a Mooncake write still lands there", req.req_id, self.config.abort_hold)
        self._nursery.start_soon(self._hold_then_release, slot)

    async def _hold_then_release(self, slot: Slot) -> None:
        try:
            await trio.sleep(self.config.abort_hold)
        finally:  # the client closing ends the hold: its registered memory goes with it
            slot.release()

    def statistics(self) -> ClientStatistics:
        routed, demux = self.router.statistics(), self.demux.statistics()
        return ClientStatistics(
            encoders=routed.encoders, outstanding=routed.outstanding,
            requests_live=len(self._requests), parts_live=demux.parts_live,
            requests_done=self._done, requests_failed=self._failed, retries=routed.retries,
            messages_received=demux.messages_received, messages_dropped=demux.messages_dropped,
            malformed_messages=demux.malformed_messages, aborts_sent=routed.aborts_sent,
            aborts_failed=routed.aborts_failed,
            refresh_failures=self._refresh_failures(),
            slots_held_after_abort=self._slots_held,
            pool=self.pool.statistics(),
            mooncake=self.mooncake.statistics() if self.mooncake is not None else None,
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
        """Plan the parts and make them findable by the demultiplexer (synchronously)."""
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
        self.demux.register(req)
        return req

    def _unregister(self, req: LiveRequest) -> None:
        for state in req.parts:
            self.router.settle(state)
        self.demux.unregister(req)
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
                if self.mooncake is None:
                    return await self._assemble(req)
                return await self._receive_in_place(req, self.mooncake.session)
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
                return StoredRequest(req.req_id, params, self._reports(req))
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

    async def _assemble(self, req: LiveRequest) -> EncodedRequest:
        """ZMQ and inline: copy the received parts into one slot (a seam fault plans wrap)."""
        received = []
        for state in req.parts:
            assert state.message is not None and state.message[1] is not None
            received.append(ReceivedPart.from_message(state.part, *state.message))  # type: ignore[arg-type]
        layouts, nbytes = plan_layout(received)
        req.slot = slot = await self.pool.acquire(nbytes)
        if nbytes >= _COPY_IN_THREAD_BYTES:  # not cancellable: the copy always finishes
            embeddings = await trio.to_thread.run_sync(copy_parts, slot, layouts)
        else:
            embeddings = copy_parts(slot, layouts)
        req.slot = None  # the result owns it now
        return EncodedRequest(req.req_id, slot, layouts, embeddings, self._reports(req))

    async def _receive_in_place(self, req: LiveRequest, session: str) -> EncodedRequest:
        """Mooncake: reserve the slot, have every encoder write its part there, view it."""
        described = [state.described for state in req.parts]
        layouts, nbytes = plan_layout(described)  # type: ignore[arg-type]
        req.slot = slot = await self.pool.acquire(nbytes)
        await write_parts(self._still_open(), req, slot, layouts, session, self.router.settle)
        if req.failure is not None:
            raise req.failure
        req.slot = None  # the result owns it now
        return EncodedRequest(req.req_id, slot, layouts, slot_views(slot, layouts),
                              self._reports(req))

    @staticmethod
    def _reports(req: LiveRequest) -> tuple[PartReport, ...]:
        return tuple(PartReport(st.part.part_idx, st.part.modality, st.encoder_url,
                                st.part.item_indices, st.finished - st.started)
                     for st in req.parts)

    # ---- one part -------------------------------------------------------------
    async def _run_part(self, req: LiveRequest, state: PartState) -> None:
        staged = False
        try:
            state.started = trio.current_time()
            response = await self._post(req, state)
            part, num_parts = state.part, len(req.parts)
            if self.config.transfer_backend == "inline":
                state.message = inline_message(response, req.req_id, part, num_parts, state.encoder_url)
                state.finished = trio.current_time()
                return
            if self.mooncake is not None:
                meta, nbytes = parse_sized_meta(response, req.req_id, part.part_idx, num_parts)
                check_sized_meta(meta, nbytes, part.modality, len(part.item_indices),
                                 state.encoder_url)
                state.described = ReceivedPart.from_meta(part, meta)
                staged = True  # still outstanding: the encoder holds it for our /send
                return
            meta = parse_meta(response, req.req_id, part.part_idx, num_parts)
            await state.arrived.wait()  # bounded by the request's deadline
            state.finished = trio.current_time()
            assert state.message is not None
            header = state.message[0]
            if header.kind == "embedding":  # an error one has already failed the request
                check_message(header, meta, state.part.modality, len(state.part.item_indices),
                              state.encoder_url)
        except EPDError as exc:
            req.fail(exc)
        finally:
            if not staged:
                self.router.settle(state)

    async def _post(self, req: LiveRequest, state: PartState) -> Answer:
        """/encode through the router; its 200 answer, else the encoder's error."""
        part, calls = state.part, self._still_open()
        assert self.addresses is not None
        body = {
            "req_id": req.req_id, "modality": part.modality,
            "mm_items": [req.wire[part.modality][i] for i in part.item_indices],
            "num_parts": len(req.parts), "part_idx": part.part_idx,
        }
        # "deliver" is the encoder's own: where it can reach us (chosen per attempt).
        response = await self.router.post(calls, req, state, body, deliver=self.addresses.deliver_for)
        # A Mooncake 200 leaves the part staged on the encoder until its /send.
        state.answered = response.status_code != 200 or self.mooncake is None
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
