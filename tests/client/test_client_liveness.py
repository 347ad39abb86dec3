"""A gRPC encoder that stops answering is given up on within ``PEER_LOST_AFTER`` of its
freeze; one that is merely slow is not.

The peer here is a real encoder process frozen with SIGSTOP: its kernel still acknowledges
TCP (so TCP keepalive alone would wait out the request's timeout), but nothing answers the
HTTP/2 keepalive pings, as on a host whose link was cut. The same freeze after a ZMQ part's
answer, before its message, is caught by the client's probes (``wait_heard_from``). gRPC runs on
real time on grpcio's threads, so these tests wait real seconds (about 11, 28 and 23 each).
"""

from __future__ import annotations

import logging
import signal

import pytest
import trio

from conftest import listening_url, png_bytes, spawn
from epd_trio import EncodeTimeout, PeerUnavailable, open_encoder_client
from epd_trio.client.liveness import PEER_LOST_AFTER
from epd_trio.config import EncoderConfig, EngineConfig
from epd_trio.encoder.server import serve_encoder
from epd_trio.errors import TransportError
from epd_trio.protocol.grpc_messages import KEEPALIVE_PING_INTERVAL_S
from epd_trio.testing import Fault, FaultPlan, install_faults

IMAGES = [png_bytes(56, 56, seed=1)]
TIMEOUT = 60.0  # the request's own deadline: the tests fail if they wait it out


@pytest.mark.parametrize("backend", ["inline", "zmq"])
async def test_a_frozen_grpc_encoder_fails_the_request_fast(qwen25_path: str, backend: str) -> None:
    with spawn("encoder", "--port", "0", "--grpc-port", "0", "--model-path", qwen25_path) as proc:
        await listening_url(proc)
        line = await trio.to_thread.run_sync(proc.stdout.readline)  # type: ignore[union-attr]
        assert line.startswith("epd-trio encoder serving gRPC on grpc://"), line
        url = line.rsplit(" ", 1)[1].strip()
        async with open_encoder_client(encoder_urls=[url], timeout=TIMEOUT,
                                       transfer_backend=backend) as client:
            async with await client.encode({"image": IMAGES}):
                pass  # the channel is open and has carried a call
            proc.send_signal(signal.SIGSTOP)
            try:
                t0 = trio.current_time()
                with trio.fail_after(TIMEOUT - 20), pytest.raises(PeerUnavailable):
                    await client.encode({"image": IMAGES})
                took = trio.current_time() - t0
            finally:
                proc.send_signal(signal.SIGCONT)
            stats = client.statistics()
        # By the pings, not luck: grpc pings every KEEPALIVE_PING_INTERVAL_S (not timed from the
        # last data), so the unanswered one ends the call between its answer window and
        # PEER_LOST_AFTER after the freeze (a loaded machine may add to both).
        answer_window = PEER_LOST_AFTER - KEEPALIVE_PING_INTERVAL_S
        assert answer_window - 1 < took < PEER_LOST_AFTER + 10, took
        assert (stats.requests_live, stats.parts_live, stats.pool.used_bytes) == (0, 0, 0)


async def test_a_slow_grpc_encode_outlives_many_keepalive_pings(qwen25_path: str) -> None:
    """An encode that sends nothing for 28 s (five pings): grpc's server, by default, counts
    each ping after the second as abuse and closes the connection at the third strike
    (about 27 s in), unless it accepts the client's cadence."""
    config = EncoderConfig(port=0, grpc_port=0, engine=EngineConfig(model_path=qwen25_path))
    async with serve_encoder(config) as server:
        assert server.grpc is not None
        install_faults(FaultPlan(0, [Fault("preprocess", delay=28.0)]), server.service.engine)
        async with open_encoder_client(encoder_urls=[server.grpc.url], timeout=TIMEOUT,
                                       transfer_backend="inline") as client:
            with trio.fail_after(TIMEOUT - 10):
                async with await client.encode({"image": IMAGES}) as result:
                    assert result.embeddings["image"].shape[0] == sum(result.token_counts["image"])


@pytest.mark.parametrize("scheme", ["http", "grpc"])
async def test_a_late_zmq_message_has_its_encoder_asked_whether_it_is_alive(
        qwen25_path: str, scheme: str, caplog: pytest.LogCaptureFixture) -> None:
    """The answer has come, the ZMQ message it announced has not (lost here on its way: a
    fault at the client's socket). While the encoder answers, the part waits for its
    deadline; once the encoder is frozen, it fails ``PEER_LOST_AFTER`` after it was last
    heard from, not at the deadline."""
    caplog.set_level(logging.INFO, logger="epd_trio.client.liveness")
    with spawn("encoder", "--port", "0", "--grpc-port", "0", "--model-path", qwen25_path) as proc:
        url = await listening_url(proc)
        line = await trio.to_thread.run_sync(proc.stdout.readline)  # type: ignore[union-attr]
        if scheme == "grpc":
            url = line.rsplit(" ", 1)[1].strip()
        async with open_encoder_client(encoder_urls=[url], timeout=TIMEOUT,
                                       transfer_backend="zmq") as client:
            install_faults(FaultPlan(0, [Fault("demux", error=TransportError)]), client)
            started = trio.current_time()
            with pytest.raises(EncodeTimeout):  # alive: asked twice, waited for to the deadline
                await client.encode({"image": IMAGES}, timeout=PEER_LOST_AFTER + 1)
            assert trio.current_time() - started > PEER_LOST_AFTER
            asked = [r for r in caplog.records if "asking whether the encoder is alive" in r.getMessage()]
            assert len(asked) >= 2, caplog.text

            frozen: list[float] = []

            async def freeze_once_the_message_is_lost() -> None:
                dropped = client.statistics().messages_dropped
                while client.statistics().messages_dropped == dropped:
                    await trio.sleep(0.005)
                proc.send_signal(signal.SIGSTOP)
                frozen.append(trio.current_time())

            try:
                started = trio.current_time()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(freeze_once_the_message_is_lost)
                    with trio.fail_after(TIMEOUT - 20), \
                            pytest.raises(PeerUnavailable, match="not heard from"):
                        await client.encode({"image": IMAGES})
                took = trio.current_time() - frozen[0]
            finally:
                proc.send_signal(signal.SIGCONT)
            stats = client.statistics()
    # Between the probe's answer window and PEER_LOST_AFTER after the freeze: a message that
    # comes (and is lost) late has its probe under way sooner.
    answer_window = PEER_LOST_AFTER - KEEPALIVE_PING_INTERVAL_S
    assert answer_window - 1 < took < PEER_LOST_AFTER + 10, (took, frozen[0] - started)
    assert (stats.requests_live, stats.parts_live, stats.pool.used_bytes) == (0, 0, 0)
