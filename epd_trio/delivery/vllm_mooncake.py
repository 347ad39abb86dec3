"""vLLM's Mooncake EC delivery: each item pushed into the memory of the consumer the request names.

vLLM 0.32's ``ECMooncakeConnector`` protocol, a producer's side
(``protocol.vllm_ec`` has its messages). The vLLM face names the consumer's
control address (the request's ``ec_transfer_params.consumer_zmq``) and one
``transfer_id`` per item; once the embedding is ready this delivery

1. learns the consumer's shards (``peers``; kept, and forgotten when it fails);
2. reserves every item on every shard at once (``reserve_batch``), which gives
   each item a destination in the consumer's registered memory;
3. writes each item's rows there with the transfer engine, straight from the
   forward's output (registered once, no staging copy), one child task per
   write;
4. says so (``complete_batch``); the consumer then publishes the item to its
   scheduler, which finds it by ``mm_hash``.

The face answers once all of it is done, within ``send_timeout``. What the
consumer answers decides what is written: an item it already holds (``cached``)
or one another transfer is writing (``write`` false) is not written again, and
a transfer it gave up (``cancelled``) is skipped, as vLLM's producer does. A
refusal (its pool is full) fails the request.

Nothing is left on the consumer: a failed, timed-out or aborted push lets go
of every reservation it holds (``cancel``, ``abandon``), twice at most per
reservation, after its writes have ended: ``fail`` does it right after the
face's error answer, ``aclose`` is the bounded backstop. A reservation a
write may still land in (one that outlived its caller, see
``transport.mooncake``) is left to the consumer and logged: freeing it could
corrupt the item the consumer puts there next. vLLM's protocol has no failure
notice: the consumer's scheduler waits for a push until its
``push_wait_timeout_s``, so the proxy, which hears the error at once, must
not forward the request.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
import trio

from epd_trio.delivery.base import TRANSPORT_ERRORS, Answer, DeliveryContext, fan_out, map_exceptions
from epd_trio.errors import (
    EncodeError,
    EPDError,
    PeerUnavailable,
    ProtocolError,
    RequestError,
    TransferTimeout,
    TransportError,
)
from epd_trio.protocol.requests import EncodeMeta, EncodeRequest
from epd_trio.protocol.vllm_ec import (
    PEERS,
    PushItem,
    Reservation,
    cancel_request,
    complete_batch_request,
    parse_cancelled,
    parse_completions,
    parse_reservations,
    reserve_batch_request,
    result_of,
    shard_endpoints,
)
from epd_trio.transport.mooncake import MooncakeTransport
from epd_trio.transport.zmq_request import RequestSockets, RequestStatistics

__all__ = ["EcControl", "EcControlStatistics", "VllmMooncakeDelivery"]

log = logging.getLogger(__name__)

CANCEL_ATTEMPTS: Final = 2  # per reservation, as vLLM's producer
MAX_CONSUMERS: Final = 1024  # consumers whose shards are remembered (least recently used go)

Key = tuple[str, str]  # (shard endpoint, transfer_id)


@dataclass(frozen=True)
class EcControlStatistics:
    consumers: int  # whose shards are known
    pushes: int
    failed_pushes: int
    inflight: int  # pushes not yet closed
    outstanding: int  # reservations they hold, neither completed nor let go of yet
    abandoned: int  # let go of after a failure
    left_behind: int  # could not be let go: the consumer keeps them
    sockets: RequestStatistics


class EcControl:
    """The control-plane client all vLLM Mooncake deliveries of one encoder share."""

    def __init__(self, sockets: RequestSockets, timeout: float) -> None:
        self.sockets = sockets
        self.timeout = timeout  # vLLM's control_timeout_s: one request and its reply
        self._shards: OrderedDict[str, tuple[str, ...]] = OrderedDict()
        self.live: set[VllmMooncakeDelivery] = set()
        self.counts = dict(pushes=0, failed_pushes=0, abandoned=0, left_behind=0)

    async def call(self, endpoint: str, payload: dict[str, Any], op: str) -> Any:
        try:
            reply = await self.sockets.request(endpoint, payload, timeout=self.timeout)
        except TransferTimeout:
            raise TransferTimeout(f"{op}: no reply from the EC consumer at {endpoint} within "
                                  f"{self.timeout:g} s (control_timeout_s)") from None
        return result_of(reply, f"{op} at {endpoint}")

    async def shards(self, consumer: str) -> tuple[str, ...]:
        known = self._shards.get(consumer)
        if known is None:
            known = shard_endpoints(consumer, await self.call(consumer, dict(PEERS), "peers"))
            self._shards[consumer] = known
            while len(self._shards) > MAX_CONSUMERS:
                self._shards.popitem(last=False)
        self._shards.move_to_end(consumer)
        return known

    def forget(self, consumer: str) -> None:
        """Ask again next time: it may have restarted with other shards."""
        self._shards.pop(consumer, None)

    async def reserve(self, shard: str, items: Sequence[PushItem]) -> list[Reservation | str]:
        return parse_reservations(await self.call(shard, reserve_batch_request(items), "reserve_batch"),
                                  len(items))

    async def complete(self, shard: str, done: Sequence[tuple[str, str]]) -> list[bool]:
        return parse_completions(await self.call(shard, complete_batch_request(done), "complete_batch"),
                                 len(done))

    async def cancel(self, shard: str, transfer_id: str, reservation_id: str) -> bool:
        return parse_cancelled(await self.call(shard, cancel_request(transfer_id, reservation_id), "cancel"))

    def statistics(self) -> EcControlStatistics:
        held = sum(len(d.held) for d in self.live)
        return EcControlStatistics(len(self._shards), inflight=len(self.live), outstanding=held,
                                   sockets=self.sockets.statistics(), **self.counts)


@dataclass(frozen=True)
class _Write:
    shard: str
    item: PushItem
    offset: int  # bytes into the source
    reservation: Reservation


class VllmMooncakeDelivery:
    """Push one request's items to a vLLM ECMooncakeConnector consumer."""

    def __init__(self, request: EncodeRequest, control: EcControl, mooncake: MooncakeTransport,
                 send_timeout: float) -> None:
        self._request = request
        self._consumer = request.deliver.endpoints[0]
        self._control = control
        self._mooncake = mooncake
        self._timeout = send_timeout
        self.held: dict[Key, str] = {}  # reservation ids; "" while a reserve awaits its reply
        self._unsafe: set[Key] = set()  # a write that outlived its caller may still land there

    @classmethod
    def for_request(cls, request: EncodeRequest, context: DeliveryContext) -> VllmMooncakeDelivery:
        if context.vllm_control is None or context.mooncake is None:
            raise RequestError("this encoder does not push to vLLM's ECMooncakeConnector "
                               "(--ec-transfer-config)", req_id=request.req_id)
        d = request.deliver
        if len(d.endpoints) != 1 or request.hashes is None or \
                not len(d.transfer_ids) == len(request.hashes) == len(request.mm_items):
            raise RequestError("a vLLM Mooncake delivery needs the consumer and one mm_hash and "
                               "transfer_id per item", req_id=request.req_id)
        return cls(request, context.vllm_control, context.mooncake, context.send_timeout)

    def admitted(self) -> None:
        """Nothing to announce: the consumer learns of the items when they are reserved."""

    def sized(self, meta: EncodeMeta) -> Answer | None:
        return None  # the destinations are reserved once the bytes exist

    async def deliver(self, embedding: torch.Tensor, meta: EncodeMeta) -> Answer:
        source = embedding.contiguous()
        items = self._items(source, meta)
        self._control.live.add(self)
        self._control.counts["pushes"] += 1
        try:
            with map_exceptions(TRANSPORT_ERRORS, f"pushing to the EC consumer at {self._consumer}"):
                with trio.move_on_after(self._timeout) as pushing:
                    await self._push(source, items)
            if pushing.cancelled_caught:
                raise TransferTimeout(f"pushing {len(items)} item(s) to the EC consumer at "
                                      f"{self._consumer} took over {self._timeout:g} s")
        except EPDError as exc:
            self._control.counts["failed_pushes"] += 1
            if isinstance(exc, TransportError):
                self._control.forget(self._consumer)
            raise
        self.held.clear()  # completed, or the consumer's own (cached, another's write)
        log.info("request %s part %d: %d item(s) pushed to the EC consumer at %s", self._request.req_id,
                 self._request.part_idx, len(items), self._consumer)
        return Answer(meta)

    def _items(self, source: torch.Tensor, meta: EncodeMeta) -> list[tuple[PushItem, int]]:
        """Each item with its byte offset in ``source``: rows in request order."""
        assert self._request.hashes is not None  # for_request checked
        if len(meta.token_counts) != len(self._request.hashes) or source.dim() != 2:
            raise EncodeError(f"{len(meta.token_counts)} embeddings for {len(self._request.hashes)} items")
        width, size = int(source.shape[1]), source.element_size()
        dtype = str(source.dtype).removeprefix("torch.")
        items, row = [], 0
        for mm_hash, tid, count in zip(self._request.hashes, self._request.deliver.transfer_ids,
                                       meta.token_counts, strict=True):
            items.append((PushItem(tid, mm_hash, (count, width), dtype, count * width * size),
                          row * width * size))
            row += count
        return items

    async def _push(self, source: torch.Tensor, items: list[tuple[PushItem, int]]) -> None:
        shards = await self._control.shards(self._consumer)
        reserved: dict[str, list[Reservation]] = {}

        async def reserve(shard: str) -> None:
            reserved[shard] = await self._reserve(shard, [item for item, _ in items])

        await _each(reserve, shards)
        writes = [_Write(shard, item, offset, r) for shard in shards
                  for (item, offset), r in zip(items, reserved[shard], strict=True) if r.writable]
        if writes:
            await self._write(source, writes)
            await self._complete(writes)

    async def _reserve(self, shard: str, items: list[PushItem]) -> list[Reservation]:
        for item in items:
            self.held[(shard, item.transfer_id)] = ""  # reserved or not: the reply will say
        answers = await self._control.reserve(shard, items)
        refused = []
        for item, answer in zip(items, answers, strict=True):
            key = (shard, item.transfer_id)
            if isinstance(answer, str):
                del self.held[key]
                refused.append(f"{item.mm_hash} ({answer})")
            elif answer.cancelled:
                del self.held[key]
                log.info("the EC consumer at %s cancelled transfer %s: not pushed", shard, item.transfer_id)
            else:
                self.held[key] = answer.reservation_id
        if refused:
            raise PeerUnavailable(f"the EC consumer at {shard} refused to reserve {', '.join(refused)}",
                                  req_id=self._request.req_id)
        return [a for a in answers if not isinstance(a, str)]

    async def _write(self, source: torch.Tensor, writes: list[_Write]) -> None:
        for w in writes:
            if w.reservation.nbytes != w.item.nbytes:
                raise ProtocolError(f"the EC consumer at {w.shard} reserved {w.reservation.nbytes} bytes "
                                    f"for {w.item.mm_hash}, which has {w.item.nbytes}")
        base = source.data_ptr()

        async def write(w: _Write) -> None:
            await self._mooncake.write(w.reservation.session, base + w.offset, w.reservation.address,
                                       w.item.nbytes, timeout=self._timeout, keepalive=source)

        async with self._mooncake.registered(base, source.numel() * source.element_size()) as region:
            try:
                await _each(write, writes)
            finally:
                if self._mooncake.in_use(region):
                    self._unsafe.update((w.shard, w.item.transfer_id) for w in writes)

    async def _complete(self, writes: list[_Write]) -> None:
        done: dict[str, list[tuple[str, str]]] = {}
        for w in writes:
            done.setdefault(w.shard, []).append((w.item.transfer_id, w.reservation.reservation_id))

        async def complete(shard: str) -> None:
            accepted = await self._control.complete(shard, done[shard])
            for tid, _ in done[shard]:  # taken or unknown there: no longer ours either way
                self.held.pop((shard, tid), None)
            lost = [tid for (tid, _), ok in zip(done[shard], accepted, strict=True) if not ok]
            if lost:
                raise TransportError(f"the EC consumer at {shard} no longer held transfer(s) "
                                     f"{', '.join(lost)} once written (cancelled or expired)",
                                     req_id=self._request.req_id)

        await _each(complete, list(done))

    async def fail(self, error: EPDError) -> None:
        await self._let_go()  # vLLM's protocol has no failure notice: give the memory back

    async def aclose(self) -> None:
        if self.held:
            with trio.move_on_after(self._control.timeout):
                await self._let_go()
        if self.held:
            self._control.counts["left_behind"] += len(self.held)
            log.warning("request %s: %d reservation(s) left on the EC consumer at %s (%s): it keeps "
                        "their memory", self._request.req_id, len(self.held), self._consumer,
                        "a write may still land there" if self._unsafe & self.held.keys()
                        else "it did not answer")
            self.held.clear()
        self._control.live.discard(self)

    async def _let_go(self) -> None:
        """Cancel (abandon) every reservation held, ``CANCEL_ATTEMPTS`` times at most each."""
        for _ in range(CANCEL_ATTEMPTS):
            pending = [(key, rid) for key, rid in self.held.items() if key not in self._unsafe]
            if not pending:
                return

            async def cancel(entry: tuple[Key, str]) -> None:
                (shard, tid), rid = entry
                try:
                    with map_exceptions(TRANSPORT_ERRORS, f"cancel at {shard}"):
                        await self._control.cancel(shard, tid, rid)
                except EPDError as exc:
                    log.info("could not cancel transfer %s at %s: %s", tid, shard, exc)
                    return
                self.held.pop((shard, tid), None)
                self._control.counts["abandoned"] += 1

            async with trio.open_nursery() as nursery:
                for entry in pending:
                    nursery.start_soon(cancel, entry)

    def __repr__(self) -> str:
        return (f"<VllmMooncakeDelivery {self._request.req_id!r} to {self._consumer}, "
                f"{len(self.held)} reservation(s) held>")


async def _each(task: Callable[[Any], Awaitable[None]], args: Sequence[Any]) -> None:
    """``task(arg)`` for every arg, concurrently; the first failure cancels the rest and is raised."""
    async def run(arg: Any) -> None:
        with map_exceptions(TRANSPORT_ERRORS, "pushing to the EC consumer"):
            await task(arg)

    async with fan_out() as nursery:
        for arg in args:
            nursery.start_soon(run, arg)
