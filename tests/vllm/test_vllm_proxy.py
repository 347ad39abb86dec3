"""``epd-trio proxy`` in front of a real vLLM 0.32 server, with epd_trio encoders behind it.

One vLLM server (an EC consumer of a shared directory) serves the module;
each test runs the proxy and two epd_trio encoders (``--api vllm``, EC
producers of the same directory); one puts vLLM's own encoder instance (a
second vLLM server, ``ec_role: ec_producer``, started last) beside one of ours. The reference for every answer is vLLM
alone: the same request with a ``uuid`` on each media part that no file
answers to, so vLLM runs its own encoder (under a name no cache of its can
answer for the other run). Greedy tokens through the proxy must be equal, and
vLLM's log must say it loaded our files.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from conftest import data_uri, first_event_then_leave, listening_url, spawn
from epd_trio.model.samples import sample_video
from epd_trio.model.tiny import make_tiny_model, servable_spec
from proxy_harness import (
    encoded,
    encoder,
    image,
    producer_config,
    proxy_over,
    request,
    through,
    tokens,
    vllm_alone,
)
from vllm_harness import (  # noqa: F401  (the fixtures)
    VllmEnv,
    VllmServer,
    storage,
    vllm,
    vllm_consumer,
    vllm_env,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("servable") / "qwen2_5_vl", servable_spec(seed=5)))


@pytest.mark.parametrize("modality", ["image", "video"])
async def test_the_proxy_gives_vllms_own_tokens(modality: str, model: str, storage: Path,
                                                vllm: VllmServer) -> None:
    if modality == "image":
        parts = [image(11), image(12)]  # one part on each encoder
    else:
        parts = [{"type": "video_url", "video_url": {"url": data_uri(sample_video(8, 4.0, 64, 48, seed=6))}}]
    reference = await vllm_alone(vllm, parts, f"reference-{modality}")
    before = set(storage.iterdir())
    async with encoder(model, storage) as a, encoder(model, storage) as b, \
            proxy_over([a.url, b.url], vllm) as (_, http):
        answer = await through(http, vllm, parts)
        used = [encoded(a), encoded(b)]
    assert answer.status_code == 200, answer.text
    assert tokens(answer.json()) == reference
    written = sorted(p.name for p in set(storage.iterdir()) - before)
    assert len(written) == len(parts) and used == ([1, 1] if modality == "image" else [1, 0])
    log = vllm.log_text()
    assert all(f"Success load encoder cache for hash {h}" in log for h in written)


async def test_a_stream_through_the_proxy_is_vllms_answer_event_by_event(
        model: str, storage: Path, vllm: VllmServer) -> None:
    parts = [image(21)]
    async with encoder(model, storage) as a, encoder(model, storage) as b, \
            proxy_over([a.url, b.url], vllm) as (_, http):
        whole = (await through(http, vllm, parts)).json()
        events = []
        async with http.stream("POST", "/v1/chat/completions",
                               json={"model": vllm.model, **request(image(21), stream=True)}) as answer:
            assert answer.status_code == 200
            async for line in answer.aiter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
    assert events[-1] == "[DONE]" and len(events) > 2  # event by event, not one blob
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                   if json.loads(e)["choices"])
    assert text == whole["choices"][0]["message"]["content"]


async def vllm_metric(http: httpx.AsyncClient, name: str) -> float:
    """One of vLLM's own Prometheus metrics, summed over its labels."""
    text = (await http.get("/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")))


async def test_a_caller_leaving_a_stream_aborts_vllms_request(model: str, storage: Path,
                                                              vllm: VllmServer) -> None:
    """vLLM counts no client abort (and logs one only with --enable-log-requests): the request
    stops running long before its 1500 tokens."""
    body = {"model": vllm.model, **request(image(61), stream=True, max_tokens=1500)}
    async with encoder(model, storage) as a, proxy_over([a.url], vllm) as (server, _), \
            httpx.AsyncClient(base_url=vllm.url, timeout=30) as metrics:
        before = await vllm_metric(metrics, "vllm:generation_tokens_total")
        with trio.fail_after(120):
            await first_event_then_leave(server.url, "/v1/chat/completions", body)
            while server.proxy.statistics().requests_live or \
                    await vllm_metric(metrics, "vllm:num_requests_running"):
                await trio.sleep(0.1)
        generated = await vllm_metric(metrics, "vllm:generation_tokens_total") - before
    assert 0 < generated < 1500


async def test_a_bad_item_is_the_encoders_4xx_at_once(model: str, storage: Path, vllm: VllmServer) -> None:
    bad = {"type": "image_url", "image_url": {"url": data_uri(b"not an image at all")}}
    async with encoder(model, storage) as a, encoder(model, storage) as b, \
            proxy_over([a.url, b.url], vllm) as (_, http):
        with trio.fail_after(20):
            answer = await through(http, vllm, [image(31), bad])
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["code"] == 400 and error["message"].startswith("encoder: item 0")


async def test_an_encoder_killed_mid_request_fails_over(model: str, storage: Path, vllm: VllmServer,
                                                        tmp_path: Path) -> None:
    parts = [image(41), image(42)]
    reference = await vllm_alone(vllm, parts, "reference-failover")
    # The victim holds each batch 30 s for company: it is surely busy when it dies.
    with spawn("encoder", "--port", "0", "--api", "vllm", "--model-path", model, "--dtype", "float32",
               "--ec-transfer-config", producer_config(storage), "--coalesce-delay", "30",
               log=tmp_path / "victim.log") as victim:
        victim_url = await listening_url(victim)
        async with encoder(model, storage) as survivor, \
                proxy_over([victim_url, survivor.url], vllm) as (server, http), \
                httpx.AsyncClient(base_url=victim_url, timeout=10) as probe, \
                trio.open_nursery() as nursery:

            async def kill_when_busy() -> None:
                with trio.fail_after(60):
                    while (await probe.get("/stats")).json()["live_requests"] == 0:
                        await trio.sleep(0.01)
                victim.send_signal(signal.SIGKILL)

            nursery.start_soon(kill_when_busy)
            with trio.fail_after(120):
                answer = await through(http, vllm, parts)
            stats = server.proxy.client.statistics()
    assert answer.status_code == 200, answer.text
    assert tokens(answer.json()) == reference
    assert stats.retries >= 1 and stats.requests_live == 0 and victim.returncode == -signal.SIGKILL


@pytest.fixture(scope="module")
def vllm_encoder(vllm_env: VllmEnv, model: str, storage: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """vLLM's own encoder instance (``ec_role: ec_producer``) of the same storage."""
    log = tmp_path_factory.mktemp("logs") / "vllm-producer.log"
    ec = {"ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
          "ec_connector_extra_config": {"shared_storage_path": str(storage)}}
    with vllm_consumer(vllm_env, model, storage, log, ec=ec) as server:
        yield server


async def test_vllms_own_encoder_instance_serves_beside_ours(
        model: str, storage: Path, vllm: VllmServer, vllm_encoder: VllmServer) -> None:
    parts = [image(51), image(52)]  # one part each: vLLM's encoder first, then ours
    reference = await vllm_alone(vllm, parts, "reference-mixed")
    before = set(storage.iterdir())
    async with encoder(model, storage) as ours, \
            proxy_over([vllm_encoder.url, ours.url], vllm) as (_, http):
        answer = await through(http, vllm, parts)
        used = encoded(ours)
    assert answer.status_code == 200, answer.text
    assert tokens(answer.json()) == reference and used == 1
    written = sorted(p.name for p in set(storage.iterdir()) - before)
    assert len(written) == 2
    assert all(f"Success load encoder cache for hash {h}" in vllm.log_text() for h in written)
