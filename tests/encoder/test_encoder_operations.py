"""What an operator relies on, over real HTTP: data parallel devices, /health and /stats
about them, the cache through the wire's ``hashes``, /metrics, and profiling."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from prometheus_client.parser import text_string_to_metric_families

from conftest import data_uri, image_uri, png_bytes
from epd_trio import WorkerDeadError, open_encoder_client
from epd_trio.protocol.codec import decode_safetensors
from epd_trio.testing import Fault, FaultPlan, install_faults


def body(req_id: str, *images: bytes, **kw: Any) -> dict[str, Any]:
    return {"req_id": req_id, "modality": "image", "mm_items": [data_uri(i) for i in images], **kw}


async def stats(http: Any) -> dict[str, Any]:
    return (await http.get("/stats")).json()


async def scrape(http: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, parsed by prometheus-client's own parser."""
    r = await http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def sample(metrics: dict, name: str, **labels: str) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def device_failure(point: str) -> WorkerDeadError:
    return WorkerDeadError("injected device failure")


async def test_two_devices_share_the_load_and_survive_one_dying(encoder: Any) -> None:
    images = [png_bytes(28 * (1 + i % 3), 56, seed=i) for i in range(12)]
    async with encoder(device="cpu,cpu", max_batch_size=2) as (server, http):
        engine = server.service.engine
        codes: list[int] = []

        async def post(i: int) -> None:
            codes.append((await http.post("/encode", json=body(f"r{i}", images[i]))).status_code)

        async with trio.open_nursery() as nursery:
            for i in range(len(images)):
                nursery.start_soon(post, i)
        workers = (await stats(http))["workers"]
        assert codes == [200] * len(images)
        assert [w["state"] for w in workers] == ["alive", "alive"]
        assert all(w["forwards"] > 0 for w in workers), workers  # both devices served

        install_faults(FaultPlan(0, [Fault("forward", error=device_failure)]), engine.schedulers[1])
        outcomes = [(await http.post("/encode", json=body(f"k{i}", images[i]))).status_code
                    for i in range(4)]  # sequential requests take turns: one lands on worker 1
        assert sorted(outcomes) == [200, 200, 200, 503]
        after = [(await http.post("/encode", json=body(f"a{i}", images[i]))).status_code for i in range(4)]
        assert after == [200] * 4  # the other device carries on
        health = await http.get("/health")
        workers = (await stats(http))["workers"]
        assert health.status_code == 200 and len(health.json()["dead_workers"]) == 1
        assert "worker 1 (cpu)" in health.json()["dead_workers"][0]
        assert [w["state"] for w in workers] == ["alive", "dead"]
        assert "injected device failure" in workers[1]["error"]

        install_faults(FaultPlan(0, [Fault("forward", error=device_failure)]), engine.schedulers[0])
        assert (await http.post("/encode", json=body("last", images[0]))).status_code == 503
        r = await http.post("/encode", json=body("none-left", images[0]))
        health = await http.get("/health")
        final = await stats(http)
    assert r.status_code == 503 and r.json()["error"]["type"] == "WorkerDeadError"
    assert health.status_code == 503 and len(health.json()["dead_workers"]) == 2
    assert final["engine"]["workers_alive"] == 0 and final["live_requests"] == 0


async def test_wire_hashes_hit_the_cache_and_probes_do_not(encoder: Any) -> None:
    image = png_bytes(84, 56, seed=5)
    async with encoder(cache_mb=8, health_fresh=1e-9) as (_, http):
        miss = await http.post("/encode", json=body("m", image, hashes=["img-5"]))
        hit = await http.post("/encode", json=body("h", image, hashes=["img-5"]))
        for _ in range(2):
            assert (await http.get("/health")).json()["probed"] is True
        cache = (await stats(http))["cache"]
    assert miss.status_code == hit.status_code == 200
    assert torch.equal(decode_safetensors(miss.content)[0], decode_safetensors(hit.content)[0])
    assert (cache["hits"], cache["misses"], cache["entries"]) == (1, 1, 1)


async def test_a_cache_hit_is_no_proof_that_batches_complete(encoder: Any) -> None:
    """/health skips its probe only while real forwards complete: a device that hangs while the
    cache answers must still be probed."""
    image = png_bytes(84, 56, seed=6)
    async with encoder(cache_mb=8, health_fresh=1.0) as (_, http):
        assert (await http.post("/encode", json=body("m", image, hashes=["img-6"]))).status_code == 200
        assert (await http.get("/health")).json()["probed"] is False  # a forward just completed
        await trio.sleep(1.2)
        assert (await http.post("/encode", json=body("h", image, hashes=["img-6"]))).status_code == 200
        health = (await http.get("/health")).json()
        assert (await stats(http))["cache"]["hits"] == 1
    assert health["probed"] is True, health


async def test_metrics_parse_and_move_as_requests_flow(encoder: Any) -> None:
    async with encoder(cache_mb=8) as (_, http):
        before = await scrape(http)
        for i in range(3):
            assert (await http.post("/encode", json=body(f"ok{i}", png_bytes(56, 56, seed=i % 2)))).status_code == 200
        bad = await http.post("/encode", json=body("bad", b"not an image"))
        junk = await http.post("/encode", content=b"{", headers={"content-type": "application/json"})
        after = await scrape(http)
    assert (bad.status_code, junk.status_code) == (400, 400)
    ok = ("epd_encoder_requests_total", dict(modality="image", outcome="ok"))
    assert sample(after, ok[0], **ok[1]) - sample(before, ok[0], **ok[1]) == 3
    assert sample(after, "epd_encoder_requests_total", modality="image", outcome="RequestError") == 1
    assert sample(after, "epd_encoder_requests_total", modality="unknown", outcome="RequestError") == 1
    for stage, count in (("preprocess", 2), ("forward", 2), ("queue", 2), ("send", 3), ("end_to_end", 4)):
        # 3 good requests, one of them a cache hit (no preprocessing, no queue, no forward);
        # the bad one fails in preprocessing
        got = sample(after, "epd_encoder_stage_seconds_count", stage=stage)
        assert got == count, (stage, got)
    assert sample(after, "epd_encoder_batch_size_count", worker="0") == 2
    # the bad item was looked up too (a miss); it failed in preprocessing, so nothing was stored
    assert (sample(after, "epd_encoder_cache_hits_total"), sample(after, "epd_encoder_cache_misses_total"),
            sample(after, "epd_encoder_cache_entries")) == (1, 3, 2)
    assert sample(after, "epd_encoder_cache_hit_ratio") == pytest.approx(1 / 4)
    assert sample(after, "epd_encoder_worker_up", worker="0", device="cpu") == 1
    assert sample(after, "epd_encoder_forwards_total", worker="0", device="cpu") == 2
    assert 0 < sample(after, "epd_encoder_device_busy_fraction", worker="0", device="cpu") <= 1
    assert sample(after, "epd_encoder_live_requests") == sample(after, "epd_encoder_queue_depth") == 0


async def test_the_adaptive_cap_shows_in_stats_and_metrics(encoder: Any) -> None:
    for adaptive in (True, False):
        async with encoder(adaptive_batch=adaptive) as (server, http):
            for i in range(4):  # alone, one after another: the cap is measured after three
                assert (await http.post("/encode", json=body(f"r{i}", png_bytes(56, 56, seed=i)))).status_code == 200
            learning = (await stats(http))["workers"][0]["batch_learning"]
            caps = server.service.engine.statistics().batch_token_caps
            metrics = await scrape(http)
        gauge = ("epd_encoder_batch_token_cap", (("device", "cpu"), ("modality", "image"), ("worker", "0")))
        if not adaptive:
            assert (learning, caps, gauge in metrics) == ({}, ({},), False)
            continue
        image = learning["image"]
        assert image["forwards"] >= 4 and image["cap_tokens"] == 4  # 56 x 56: 4 tokens, bucket 4
        assert image["probing"] == 8 and image["probes"] == 1  # two of them may share a forward now
        assert caps == ({"image": 4},) and metrics[gauge] == 4


async def test_two_services_keep_separate_registries(encoder: Any) -> None:
    async with encoder() as (_, one), encoder() as (_, two):
        await one.post("/encode", json=body("x", png_bytes(56, 56)))
        a, b = await scrape(one), await scrape(two)
    assert sample(a, "epd_encoder_requests_total", modality="image", outcome="ok") == 1
    assert sample(b, "epd_encoder_requests_total", modality="image", outcome="ok") == 0


async def test_the_client_has_a_registry_of_its_own(encoder: Any) -> None:
    async with encoder() as (server, _):
        async with open_encoder_client(encoder_urls=[server.url], transfer_backend="inline") as client:
            async with await client.encode({"image": [png_bytes(56, 56)]}):
                during = {(s.name, tuple(s.labels.items())): s.value for f in text_string_to_metric_families(
                    _exposition(client.metrics_registry)) for s in f.samples}
            after = {(s.name, tuple(s.labels.items())): s.value for f in text_string_to_metric_families(
                _exposition(client.metrics_registry)) for s in f.samples}
    assert during[("epd_client_pool_used_bytes", ())] > 0 and after[("epd_client_pool_used_bytes", ())] == 0
    assert after[("epd_client_requests_total", (("outcome", "ok"),))] == 1
    assert after[("epd_client_request_seconds_count", ())] == 1
    assert after[("epd_client_outstanding_parts", (("encoder", server.url),))] == 0


def _exposition(registry: Any) -> str:
    from prometheus_client import generate_latest

    return generate_latest(registry).decode()


async def test_profiling_writes_a_chrome_trace(encoder: Any, tmp_path: Path) -> None:
    async with encoder(profile_dir=str(tmp_path)) as (_, http):
        assert (await http.post("/stop_profile")).status_code == 409  # none running
        started = await http.post("/start_profile", json={"output_dir": "run1"})
        assert started.status_code == 200, started.text
        again = await http.post("/start_profile")
        for i in range(2):
            assert (await http.post("/encode", json={"req_id": f"p{i}", "modality": "image",
                                                     "mm_items": [image_uri(seed=i)]})).status_code == 200
        stopped = await http.post("/stop_profile")
        assert (await http.post("/stop_profile")).status_code == 409
        # num_steps: the profile stops by itself after that many forwards
        assert (await http.post("/start_profile", json={"num_steps": 1})).status_code == 200
        await http.post("/encode", json={"req_id": "s", "modality": "image", "mm_items": [image_uri(seed=9)]})
        with trio.fail_after(30):
            while (await stats(http))["profiler"]["running"]:
                await trio.sleep(0.05)
        profiler = (await stats(http))["profiler"]
    assert again.status_code == 409 and again.json()["error"]["type"] == "ConflictError"
    trace = Path(stopped.json()["trace"])
    assert trace.parent == (tmp_path / "run1").resolve() and trace.exists()
    events = json.loads(trace.read_text())["traceEvents"]
    ops = {str(e.get("name")) for e in events}
    assert ops & {"aten::linear", "aten::addmm", "aten::mm"}, sorted(ops)[:50]  # the forward's own ops
    assert profiler["traces_written"] == 2 and Path(profiler["last_trace"]).exists()


@pytest.mark.parametrize("output_dir", ["../outside", "/tmp", "a/../../b"])
async def test_profile_output_must_stay_inside_the_profile_dir(encoder: Any, tmp_path: Path,
                                                               output_dir: str) -> None:
    async with encoder(profile_dir=str(tmp_path / "profiles")) as (_, http):
        r = await http.post("/start_profile", json={"output_dir": output_dir})
        bad_steps = await http.post("/start_profile", json={"num_steps": 0})
        running = (await stats(http))["profiler"]["running"]
    assert r.status_code == 400 and "inside" in r.json()["error"]["message"]
    assert bad_steps.status_code == 400 and not running
    assert not (tmp_path / "outside").exists()


async def test_profiling_needs_the_token_when_one_is_set(encoder: Any, tmp_path: Path) -> None:
    async with encoder(profile_dir=str(tmp_path), auth_token="s3cret") as (_, http):
        refused = await http.post("/start_profile")
        wrong = await http.post("/stop_profile", headers={"Authorization": "Bearer nope"})
        auth = {"Authorization": "Bearer s3cret"}
        ok = await http.post("/start_profile", headers=auth)
        done = await http.post("/stop_profile", headers=auth)
    assert (refused.status_code, wrong.status_code, ok.status_code, done.status_code) == (401, 401, 200, 200)
    assert "s3cret" not in refused.text
