"""Smoke: the gRPC face answers Encode (inline), Check and reflection with grpcio clients."""

from __future__ import annotations

import grpc
import trio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import image_uri
from epd_trio.protocol.codec import decode_safetensors
from epd_trio.protocol.proto import encoder_pb2 as pb
from epd_trio.protocol.proto import encoder_pb2_grpc as pb_grpc


async def test_encode_inline_and_health(encoder) -> None:
    async with encoder(grpc_port=0) as (server, http):
        target = server.grpc.url.removeprefix("grpc://")

        def calls() -> tuple[pb.EncodeResponse, int, int]:
            with grpc.insecure_channel(target) as channel:
                answer = pb_grpc.EncoderStub(channel).Encode(pb.EncodeRequest(
                    req_id="g1", modality="image", mm_items=[pb.Item(url=image_uri())]), timeout=30)
                health = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=30)
                try:
                    pb_grpc.EncoderStub(channel).Encode(pb.EncodeRequest(req_id="", modality="image"), timeout=30)
                except grpc.RpcError as exc:
                    code = exc.code()
                return answer, health.status, code

        answer, status, code = await trio.to_thread.run_sync(calls)
        tensor, meta = decode_safetensors(answer.safetensors)
        assert list(tensor.shape) == [answer.meta.tokens, answer.meta.dim]
        assert answer.meta.req_id == "g1" and answer.meta.tokens > 0
        assert status == health_pb2.HealthCheckResponse.SERVING
        assert code == grpc.StatusCode.INVALID_ARGUMENT
