"""A vLLM chat request's items: fetched once, named by vLLM's ``mm_hash``, encoded per modality.

The vLLM face (``vllm_app``) parses; this module does the work in between:

1. every item's bytes are fetched by the engine's media loader (its limits and
   fetch rules), once: the engine then reads those bytes, never the URL again;
2. each item without a ``uuid`` is named the way the vLLM consumer will name
   it (``model.vllm_media`` finds what vLLM's loaders would report, in a
   thread; ``protocol.vllm_hash`` digests it);
3. one request per modality goes to the service, with the delivery the
   configured connector takes (``protocol.vllm_requests.EcProducer``: written
   to shared storage, or pushed to the consumer the request names under the
   ``transfer_id``s it names), concurrently; the first failure cancels the
   others.

The whole of it runs under ``--request-timeout``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import trio

from epd_trio.encoder.service import EncoderService
from epd_trio.errors import DeadlineExceeded, EPDError
from epd_trio.model.media import MediaLimits
from epd_trio.model.vllm_media import VllmMediaRules, hash_input, rules_for
from epd_trio.protocol.requests import EncodeMeta
from epd_trio.protocol.vllm_hash import item_hash
from epd_trio.protocol.vllm_requests import ChatItem, ChatRequest, EcProducer, item_request, transfer_ids

__all__ = ["HASH_THREADS", "EncodedChat", "VllmItems"]

log = logging.getLogger(__name__)

# Items hashed at once, each on a worker thread (each decodes what vLLM would have decoded).
HASH_THREADS: Final = 2


@dataclass(frozen=True)
class EncodedChat:
    """What the face answers with: each item's ``mm_hash`` and ``transfer_id`` (whether the
    request named it), and each modality's metadata."""

    hashes: tuple[str, ...]
    metas: dict[str, EncodeMeta]
    transfer_ids: tuple[tuple[str, bool], ...] = ()


class VllmItems:
    """Names and encodes the items of vLLM chat requests for one service."""

    def __init__(self, service: EncoderService, model_id: str, algorithm: str, producer: EcProducer) -> None:
        self.service = service
        self.model_id = model_id
        self.algorithm = algorithm
        self.producer = producer
        self.threads = trio.CapacityLimiter(HASH_THREADS)
        extractor = service.engine.encoder.processors.get("audio")
        self.rules: VllmMediaRules = rules_for(service.model_info.model_type,
                                               int(getattr(extractor, "sampling_rate", 16000)))

    async def encode(self, chat: ChatRequest) -> EncodedChat:
        timeout = self.service.config.request_timeout
        self.producer.check(chat)
        try:
            with trio.fail_after(timeout):
                loaded = await self.service.engine.media.load([item.source for item in chat.items])
                hashes = await trio.to_thread.run_sync(self._hashes, chat.items, loaded,
                                                       limiter=self.threads)
                ids = transfer_ids(chat, hashes)
                metas = await self._encode_groups(chat, loaded, hashes, [tid for tid, _ in ids])
        except trio.TooSlowError:
            raise DeadlineExceeded(f"request exceeded its deadline (--request-timeout {timeout} s)",
                                   req_id=chat.request_id) from None
        log.info("request %s: %d items %s for vLLM as %s", chat.request_id, len(hashes),
                 f"pushed to {chat.ec.consumer_zmq}" if self.producer.pushes else "written",
                 ", ".join(hashes))
        return EncodedChat(tuple(hashes), metas, self.producer.answered_ids(ids))

    def _hashes(self, items: Sequence[ChatItem], loaded: Sequence[Any]) -> list[str]:
        """Each item's ``mm_hash`` (blocking: decodes what vLLM would have decoded)."""
        limits: MediaLimits = getattr(self.service.engine.media, "limits", MediaLimits())
        return [item.uuid if item.uuid is not None else
                item_hash(self.model_id, item.modality,
                          hash_input(item.modality, data, item.index, limits, self.rules),
                          algorithm=self.algorithm)
                for item, data in zip(items, loaded, strict=True)]

    async def _encode_groups(self, chat: ChatRequest, loaded: Sequence[Any], hashes: Sequence[str],
                             ids: Sequence[str]) -> dict[str, EncodeMeta]:
        groups = chat.by_modality()
        metas: dict[str, EncodeMeta] = {}
        errors: list[EPDError] = []

        async def one(part_idx: int, modality: str, items: list[ChatItem]) -> None:
            request = item_request(chat.request_id, modality, [loaded[i.index] for i in items],
                                   [hashes[i.index] for i in items], part_idx, len(groups),
                                   self.producer.delivery(chat, items, ids))
            try:
                metas[modality] = (await self.service.encode(request)).meta
            except EPDError as exc:
                errors.append(exc)
                nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            for part_idx, (modality, items) in enumerate(groups.items()):
                nursery.start_soon(one, part_idx, modality, items)
        if errors:
            raise errors[0]
        return metas
