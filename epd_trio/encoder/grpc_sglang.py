"""``sglang.grpc.encoder.SglangEncoder`` (smg-grpc-proto 0.4.28), as SGLang 0.5.23 serves it.

Same behaviour as SGLang's ``grpc_server.py`` on the same runtime as the
SGLang HTTP face: ``Encode`` takes the unsuffixed request id and is checked
with SGLang's rules and messages first; an empty ``embedding_port`` is
zmq_to_scheduler's rendezvous (each rank calls ``SchedulerReceiveUrl``),
``[port, …]`` pushes to those ports on ``prefill_host`` (zmq_to_tokenizer: the
first, as SGLang); it answers once every destination has the part, or for
mooncake with the sizes, and ``Send`` then writes the part and releases it.
SGLang's proto has no modality field and SGLang encodes images only; here the
items say what they are (``data:video/…``, ``.wav``, …; image otherwise) and a
request that mixes modalities is refused (INVALID_ARGUMENT). Errors are the
one error tree's statuses (``grpc_bridge``), where SGLang has only
INVALID_ARGUMENT and INTERNAL; a failed part also pushes SGLang's error frame
to its destinations.
"""

from __future__ import annotations

from typing import Any

from smg_grpc_proto import sglang_encoder_pb2 as pb, sglang_encoder_pb2_grpc as pb_grpc

from epd_trio._http import BearerAuth
from epd_trio.encoder.grpc_bridge import Call, TrioBridge, decoded, unary
from epd_trio.encoder.service import EncoderService
from epd_trio.protocol.grpc_messages import sglang_encode_body
from epd_trio.protocol.sglang_requests import check_send, parse_receive_url, parse_sglang_encode, parse_sglang_send

__all__ = ["SERVICE_NAME", "sglang_servicer"]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SglangEncoder"].full_name


class _SGLang:
    def __init__(self, service: EncoderService) -> None:
        self.service = service

    async def encode(self, message: Any, call: Call) -> Any:
        config = self.service.config
        backend = config.encoder_transfer_backend
        with self.service.parsing():
            request = parse_sglang_encode(sglang_encode_body(decoded(message), backend), backend=backend,
                                          max_items=config.max_items)
        answer = await self.service.encode(request, deadline=call.request_deadline)
        if answer.nbytes is None:
            return pb.EncodeResponse()  # every destination has the part
        return pb.EncodeResponse(embedding_size=answer.nbytes, embedding_len=answer.meta.tokens,
                                 embedding_dim=answer.meta.dim)

    async def send(self, message: Any, call: Call) -> Any:
        """SGLang's Mooncake write. Its message names neither the part nor the size; SGLang's
        server keeps one staged embedding per ``req_id`` and writes all of it, then releases
        it: here the one live part of that ``req_id`` (the rendezvous allows one; while a
        second is being refused, ALREADY_EXISTS), the size ``Encode`` answered, and
        ``receive_count`` 1. Unlike SGLang's server, which answers OK without writing, a
        ``Send`` for no live part is NOT_FOUND."""
        check_send(self.service.config.encoder_transfer_backend, message.req_id or None)
        part_idx, nbytes = await self.service.sole_part(message.req_id)
        order = parse_sglang_send({
            "req_id": message.req_id, "part_idx": part_idx, "session_id": message.session_id,
            "buffer_address": message.buffer_address, "embedding_size": nbytes,
            "prefill_host": message.prefill_host, "embedding_port": message.embedding_port,
            "receive_count": 1})
        await self.service.send(order.req_id, order.part_idx, session=order.session,
                                address=order.buffer_address, length=order.length,
                                completion=order.completion, receive_count=order.receive_count)
        return pb.SendResponse()

    async def scheduler_receive_url(self, message: Any, call: Call) -> Any:
        reg = parse_receive_url({"req_id": message.req_id, "receive_count": message.receive_count,
                                 "receive_url": message.receive_url})
        await self.service.announce_receiver(reg.req_id, reg.receive_count, reg.receive_url)
        return pb.SchedulerReceiveUrlResponse()


def sglang_servicer(service: EncoderService, bridge: TrioBridge) -> Any:
    """The servicer grpcio calls (the token, with ``--require-auth-for-encode``, on every call)."""
    config, sglang = service.config, _SGLang(service)
    auth = BearerAuth(config.auth_token) if config.require_auth_for_encode else None
    servicer = pb_grpc.SglangEncoderServicer()
    servicer.Encode = unary(bridge, sglang.encode, method="Encode", auth=auth, sees_undecodable=True)
    servicer.Send = unary(bridge, sglang.send, method="Send", auth=auth)
    servicer.SchedulerReceiveUrl = unary(bridge, sglang.scheduler_receive_url,
                                         method="SchedulerReceiveUrl", auth=auth)
    return servicer
