"""The CUDA path: run with ``pytest -m gpu`` on a machine with a CUDA device.

Skipped without one (``tools/gpu_check.sh`` runs these, then the benchmarks).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from prometheus_client.parser import text_string_to_metric_families

from conftest import data_uri, png_bytes
from epd_trio import open_engine
from epd_trio.protocol.codec import decode_safetensors
from epd_trio.scheduling.failures import is_device_error, is_device_out_of_memory

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

IMAGES = [png_bytes(28 * (1 + i % 4), 28 * (2 + i % 3), seed=i) for i in range(8)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


async def encode_all(engine: Any, images: list[bytes]) -> list[torch.Tensor]:
    out: list[torch.Tensor | None] = [None] * len(images)

    async def one(i: int) -> None:
        out[i] = (await engine.encode([images[i]])).embedding

    async with trio.open_nursery() as nursery:
        for i in range(len(images)):
            nursery.start_soon(one, i)
    return out  # type: ignore[return-value]


async def test_cuda_equals_cpu_and_answers_in_pinned_host_memory(
        qwen25_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # cuDNN runs float32 convolutions (the patch embedding) in TF32 by default: ~5e-4
    # relative error before anything else, too close to the bound below.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    async with open_engine(model_path=qwen25_path, device="cpu") as cpu:
        expected = await encode_all(cpu, IMAGES)
    async with open_engine(model_path=qwen25_path, device="cuda:0", max_batch_size=4) as gpu:
        got = await encode_all(gpu, IMAGES)
        stats = gpu.worker.statistics()
    assert stats.device == "cuda:0" and stats.forwards >= 2
    for g, e in zip(got, expected):
        assert g.device.type == "cpu" and g.is_contiguous()
        assert g.untyped_storage().is_pinned()  # device→host into pinned memory, event-synchronized
        assert rel(g, e) < 1e-3


async def test_a_forward_runs_on_the_workers_stream_and_returns_only_once_copied_out(
        qwen25_path: str) -> None:
    async with open_engine(model_path=qwen25_path, device="cuda:0") as engine:
        expected = (await engine.encode([IMAGES[0]])).embedding
        adapter, scheduler, worker = engine.encoder.adapter, engine.scheduler, engine.worker
        inner, forward = adapter.forward, scheduler.forward
        seen: list[tuple[Any, ...]] = []
        snapshots: list[torch.Tensor] = []

        def slow(module: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
            seen.append((torch.cuda.current_device(), torch.cuda.current_stream(),
                         inputs["pixel_values"].device))
            out = inner(module, inputs)
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the output's last kernel
            return out * 2

        def snapshot(payloads: Any) -> list[torch.Tensor]:
            outs = forward(payloads)
            snapshots.extend(o.clone() for o in outs)  # read at once, as delivery may
            return outs

        adapter.forward, scheduler.forward = slow, snapshot
        try:
            got = (await engine.encode([IMAGES[0]])).embedding
        finally:
            del adapter.forward
            scheduler.forward = forward
    ((device, stream, inputs_on),) = seen
    assert device == 0 and inputs_on == torch.device("cuda:0")
    assert stream == worker._stream and stream != torch.cuda.default_stream(0)
    assert got.untyped_storage().is_pinned()
    # Without the event synchronized before returning, the snapshot would be unwritten memory.
    assert rel(snapshots[0], expected * 2) < 1e-5 and rel(got, expected * 2) < 1e-5


async def test_two_workers_on_cuda_both_serve(qwen25_path: str) -> None:
    devices = "cuda:0,cuda:1" if torch.cuda.device_count() > 1 else "cuda:0,cuda:0"
    async with open_engine(model_path=qwen25_path, device=devices, max_batch_size=2) as engine:
        await encode_all(engine, IMAGES * 2)
        states = engine.worker_states()
    assert [s.state for s in states] == ["alive", "alive"]
    assert all(s.forwards > 0 for s in states), states


def test_a_real_cuda_out_of_memory_is_out_of_memory_not_a_dead_device() -> None:
    free, _ = torch.cuda.mem_get_info()
    with pytest.raises(torch.cuda.OutOfMemoryError) as caught:
        torch.empty(free * 4, dtype=torch.uint8, device="cuda")
    assert is_device_out_of_memory(caught.value) and not is_device_error(caught.value)


async def test_http_on_cuda_with_a_profile(encoder: Any, tmp_path: Path) -> None:
    async with encoder(device="cuda", profile_dir=str(tmp_path), cache_mb=16) as (server, http):
        assert (await http.post("/start_profile")).status_code == 200
        r = await http.post("/encode", json={"req_id": "g", "modality": "image",
                                             "mm_items": [data_uri(IMAGES[0])]})
        trace = Path((await http.post("/stop_profile")).json()["trace"])
        local = await server.service.engine.encode([IMAGES[0]], use_cache=False)
        metrics = (await http.get("/metrics")).text
    assert r.status_code == 200
    assert rel(decode_safetensors(r.content)[0], local.embedding) < 1e-5
    names = {str(e.get("cat")) for e in json.loads(trace.read_text())["traceEvents"]}
    assert "kernel" in names  # CUDA kernels, not only CPU operators
    up = {tuple(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(metrics)
          for s in f.samples if s.name == "epd_encoder_worker_up"}
    assert up == {(("device", "cuda"), ("worker", "0")): 1.0}


# Last: compiling takes a while. Inductor warns about TF32 and the like (UserWarning,
# an error under this suite's filterwarnings); those are not ours to fix.
@pytest.mark.filterwarnings("ignore::UserWarning")
async def test_bfloat16_and_compile_match_eager(qwen25_path: str) -> None:
    from torch._dynamo.utils import counters

    async with open_engine(model_path=qwen25_path, device="cuda", dtype="bfloat16") as eager:
        expected = await encode_all(eager, IMAGES[:2])
    graphs = counters["stats"]["unique_graphs"]
    async with open_engine(model_path=qwen25_path, device="cuda", dtype="bfloat16", compile=True) as compiled:
        got = await encode_all(compiled, IMAGES[:2])
        assert compiled.worker.compiled
    assert counters["stats"]["unique_graphs"] > graphs  # the forwards did go through torch.compile
    for g, e in zip(got, expected):
        assert g.dtype == torch.bfloat16 and rel(g, e) < 2e-2


async def test_device_preprocessing_on_cuda_equals_the_cpu_path(qwen25_path: str) -> None:
    """``--preprocess-device cuda``: nvJPEG decode and the processor on the device.

    nvJPEG's IDCT and chroma upsampling are not libjpeg's, so pixels may differ
    by a few levels; the embeddings must still agree within 1e-4 relative error
    for PNG (decoded on the CPU, processor on the device) and within the
    decoder's tolerance for JPEG.
    """
    import io

    from conftest import random_image

    def jpeg(seed: int) -> bytes:
        buf = io.BytesIO()
        random_image(224, 168, seed=seed).save(buf, format="JPEG", quality=95)
        return buf.getvalue()

    # PNGs the processor takes at their size: a resize on CUDA (float, then rounded) is not
    # the CPU's native uint8 bicubic, so IMAGES[0] (28 x 56, under min_pixels) would differ
    # by the resize alone (~1.5e-2 on the tiny model), not by where the processor ran.
    pngs, jpegs = IMAGES[1:4], [jpeg(s) for s in range(4)]
    async with open_engine(model_path=qwen25_path, device="cuda", dtype="float32") as engine:
        want_png, want_jpeg = await encode_all(engine, pngs), await encode_all(engine, jpegs)
    async with open_engine(model_path=qwen25_path, device="cuda", dtype="float32",
                           preprocess_device="cuda") as engine:
        got_png, got_jpeg = await encode_all(engine, pngs), await encode_all(engine, jpegs)
    assert max(rel(g, w) for g, w in zip(got_png, want_png)) < 1e-4
    assert max(rel(g, w) for g, w in zip(got_jpeg, want_jpeg)) < 5e-2


def test_damaged_jpegs_on_nvjpeg_are_refused_or_decoded_and_the_device_keeps_working() -> None:
    """``--preprocess-device cuda`` hands a peer's JPEG to nvJPEG: a damaged one must be a 400
    or a picture, never a crash or a device left failing (in a child process, as on the CPU)."""
    from conftest import assert_corrupt_jpegs_handled, decode_corrupt_jpegs_in_child

    assert_corrupt_jpegs_handled(decode_corrupt_jpegs_in_child("cuda:0"), "cuda:0")
