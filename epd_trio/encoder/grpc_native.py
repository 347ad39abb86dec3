"""``epd_trio.v1.Encoder``: protocol v1 over gRPC, as thin as the HTTP face.

Each RPC turns its message into the HTTP body it means and calls the same
parser and the same service method, so limits, errors and answers are the
HTTP face's; only the shape of the answer differs (``encoder.proto``).
"""

from __future__ import annotations

from epd_trio._http import BearerAuth
from epd_trio._version import __version__
from epd_trio.encoder.grpc_bridge import Call, TrioBridge, Undecodable, decoded, unary
from epd_trio.encoder.service import EncoderService
from epd_trio.errors import PayloadTooLargeError
from epd_trio.protocol.grpc_messages import encode_body, meta_message
from epd_trio.protocol.proto import encoder_pb2 as pb, encoder_pb2_grpc as pb_grpc
from epd_trio.protocol.requests import parse_abort_request, parse_encode_request, parse_send_request

__all__ = ["SERVICE_NAME", "native_servicer"]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Encoder"].full_name
# HTTP's 413 message (``_http.install_error_handlers``); a parity test keeps the two equal.
BODY_TOO_LARGE = "request body is over the size limit"


class _Native:
    def __init__(self, service: EncoderService) -> None:
        self.service = service

    async def encode(self, message: pb.EncodeRequest | Undecodable, call: Call) -> pb.EncodeResponse:
        config = self.service.config
        with self.service.parsing():
            # grpcio's own limit is max(256 MiB, --max-body-bytes); ours is HTTP's, with HTTP's words.
            body: pb.EncodeRequest = decoded(message)
            if body.ByteSize() > config.max_body_bytes:
                raise PayloadTooLargeError(BODY_TOO_LARGE)
            request = parse_encode_request(encode_body(body), max_items=config.max_items)
        answer = await self.service.encode(request, deadline=call.request_deadline)
        return pb.EncodeResponse(meta=meta_message(answer.meta), safetensors=answer.body or b"",
                                 nbytes=answer.nbytes or 0)

    async def send(self, message: pb.SendRequest, call: Call) -> pb.SendResponse:
        order = parse_send_request({"req_id": message.req_id, "part_idx": message.part_idx,
                                    "session": message.session,
                                    "buffer_address": message.buffer_address,
                                    "buffer_length": message.buffer_length})
        nbytes = await self.service.send(order.req_id, order.part_idx, session=order.session,
                                         address=order.buffer_address, length=order.buffer_length)
        return pb.SendResponse(req_id=order.req_id, part_idx=order.part_idx, nbytes=nbytes)

    async def abort(self, message: pb.AbortRequest, call: Call) -> pb.AbortResponse:
        part = message.part_idx if message.HasField("part_idx") else None
        req = parse_abort_request({"req_id": message.req_id, "part_idx": part})
        result = await self.service.abort(req.req_id, req.part_idx)
        return pb.AbortResponse(req_id=req.req_id, aborted=result.aborted, released=result.released)

    async def model_info(self, message: pb.ModelInfoRequest, call: Call) -> pb.ModelInfo:
        info = self.service.model_info
        return pb.ModelInfo(
            model_type=info.model_type, modalities=list(info.modalities), dim=info.dim,
            dtype=info.dtype, device=info.device, max_batch_size=info.max_batch_size,
            random_weights=info.random_weights,
            embedding_layout=[pb.LayoutBlock(name=n, width=w) for n, w in info.embedding_layout],
            embedding_description=info.embedding_description, version=__version__)


def native_servicer(service: EncoderService, bridge: TrioBridge) -> pb_grpc.EncoderServicer:
    """The servicer grpcio calls; the auth rules are HTTP's (``Abort`` is an admin call,
    ``Encode``/``Send`` need the token with ``--require-auth-for-encode``)."""
    config, native = service.config, _Native(service)
    auth = BearerAuth(config.auth_token)
    data_auth = auth if config.require_auth_for_encode else None
    servicer = pb_grpc.EncoderServicer()
    servicer.Encode = unary(bridge, native.encode, method="Encode", auth=data_auth,  # type: ignore[method-assign]
                            sees_undecodable=True)
    servicer.Send = unary(bridge, native.send, method="Send", auth=data_auth)  # type: ignore[method-assign]
    servicer.Abort = unary(bridge, native.abort, method="Abort", auth=auth)  # type: ignore[method-assign]
    servicer.GetModelInfo = unary(bridge, native.model_info, method="GetModelInfo")  # type: ignore[method-assign]
    return servicer
