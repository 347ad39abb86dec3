"""The engine's embeddings equal transformers' own get_image_features."""

from __future__ import annotations

import pytest
import torch
import transformers
import trio

from conftest import png_bytes, random_image
from epd_trio import open_engine

# square, tall, wide, tiny, large (>= 1000 px)
SIZES = [(224, 224), (120, 360), (500, 140), (28, 28), (1000, 1200)]


def reference(path: str, images: list) -> list[tuple[torch.Tensor, tuple[int, int, int], int]]:
    model = transformers.AutoModelForImageTextToText.from_pretrained(path).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(path)
    out = []
    with torch.inference_mode():
        for image in images:
            inputs = processor(images=[image], return_tensors="pt")
            (emb,) = model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
            grid = tuple(inputs["image_grid_thw"][0].tolist())
            out.append((emb, grid, emb.shape[0]))
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl"])
async def test_engine_equals_transformers(checkpoints: dict[str, str], arch: str) -> None:
    path = checkpoints[arch]
    pil = [random_image(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    expected = await trio.to_thread.run_sync(reference, path, pil)
    async with open_engine(model_path=path, dtype="float32") as engine:
        assert engine.model_info.model_type == arch
        assert engine.model_info.dim == expected[0][0].shape[1]
        # one at a time, as PNG bytes (the wire form)
        for i, (w, h) in enumerate(SIZES):
            out = await engine.encode([png_bytes(w, h, seed=i)], "image")
            emb, grid, tokens = expected[i]
            assert out.grid_thw == [grid] and out.token_counts == [tokens], (w, h)
            assert out.embedding.shape == emb.shape
            assert rel_err(out.embedding, emb) < 1e-4, (w, h)
        # all in one request: items stay in order, each slice equals its reference
        out = await engine.encode(pil, "IMAGE")
        assert out.token_counts == [t for _, _, t in expected]
        for i, (emb, _, _) in enumerate(expected):
            assert rel_err(out.item(i), emb) < 1e-4


async def test_concurrent_callers_batch_and_get_their_own(qwen25_path: str) -> None:
    images = [png_bytes(56 + 28 * (i % 5), 84 + 14 * (i % 3), seed=i) for i in range(16)]
    # A short coalesce delay makes the batching deterministic on a loaded CI machine; batching is
    # pinned on (the adaptive cap would start each request alone).
    async with open_engine(model_path=qwen25_path, max_batch_size=8, coalesce_delay=0.05,
                           adaptive_batch=False) as engine:
        alone = [await engine.encode([img]) for img in images]
        before = engine.statistics().batches_run
        together: list = [None] * 16

        async def call(i: int) -> None:
            together[i] = await engine.encode([images[i]])

        async with trio.open_nursery() as nursery:
            for i in range(16):
                nursery.start_soon(call, i)
        stats = engine.statistics()
    assert stats.batches_run - before < 16, "concurrent callers were not batched"
    assert stats.requests_done == 32 and stats.admitted == 0 and stats.queued == 0
    for mine, ref in zip(together, alone):
        assert mine.token_counts == ref.token_counts
        assert rel_err(mine.embedding, ref.embedding) < 1e-5
