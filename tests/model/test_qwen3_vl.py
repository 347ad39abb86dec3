"""Qwen3-VL: images with their deepstack features, equal to get_image_features.

Deepstack features ride in the same rows, concatenated along the embedding
dimension: ``[embedding | deepstack_0 | deepstack_1]``; the language side
splits a row back by ``ModelAdapter.embedding_layout``.
"""

from __future__ import annotations

import random

import torch
import transformers
import trio

from conftest import TEST_SPECS, deepstack_levels, png_bytes, random_image
from epd_trio import open_engine
from epd_trio.model.adapters.qwen_vl import frame_timestamps
from epd_trio.model.loader import load_encoder

SIZES = [(224, 224), (120, 360), (500, 140), (28, 28), (300, 500)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def reference(path: str, images: list) -> list[tuple[torch.Tensor, list[torch.Tensor], tuple]]:
    model = transformers.AutoModelForImageTextToText.from_pretrained(path).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(path)
    out = []
    with torch.inference_mode():
        for image in images:
            inputs = processor(images=[image], return_tensors="pt")
            features = model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
            (emb,) = features.pooler_output
            deepstack = deepstack_levels(features)
            out.append((emb, deepstack, tuple(inputs["image_grid_thw"][0].tolist())))
    return out


async def test_images_and_deepstack_equal_transformers(checkpoints: dict[str, str]) -> None:
    path = checkpoints["qwen3_vl"]
    spec = TEST_SPECS["qwen3_vl"]
    pil = [random_image(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    expected = await trio.to_thread.run_sync(reference, path, pil)
    async with open_engine(model_path=path, dtype="float32") as engine:
        info = engine.model_info
        adapter = engine.encoder.adapter
        out = await engine.encode([png_bytes(w, h, seed=i) for i, (w, h) in enumerate(SIZES)], "image")
    levels = len(spec.deepstack_indexes)
    assert info.modalities == ("image", "video")
    assert info.dim == adapter.embedding_dim == spec.out_hidden * (1 + levels)
    assert adapter.embedding_layout == (
        ("embedding", spec.out_hidden), *((f"deepstack_{k}", spec.out_hidden) for k in range(levels)))
    assert "deepstack_1[40]" in adapter.embedding_description
    assert out.grid_thw == [g for _, _, g in expected]
    for i, (emb, deepstack, _) in enumerate(expected):
        blocks = out.item(i).split([w for _, w in adapter.embedding_layout], dim=-1)
        assert len(blocks) == 1 + len(deepstack) == 1 + levels
        for ours, theirs in zip(blocks, [emb, *deepstack]):
            assert ours.shape == theirs.shape
            assert rel_err(ours, theirs) < 1e-4, i


def test_loads_exactly_the_vision_tower_with_its_deepstack_mergers(checkpoints: dict[str, str]) -> None:
    path = checkpoints["qwen3_vl"]
    enc = load_encoder(path)
    vision = transformers.AutoModelForImageTextToText.from_pretrained(path).model.visual
    ours, theirs = enc.module.state_dict(), vision.state_dict()
    assert ours.keys() == theirs.keys()
    assert any(k.startswith("deepstack_merger_list.1.") for k in ours)
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key
    assert set(enc.processors) == {"image", "video"}
    assert type(enc.processors["video"]).__name__ == "Qwen3VLVideoProcessor"


def test_timestamps_equal_the_processors() -> None:
    rng = random.Random(5)
    for _ in range(50):
        total = rng.randint(2, 300)
        indices = sorted(rng.sample(range(total), rng.randint(2, min(total, 40))))
        fps = rng.choice([1.0, 2.0, 23.976, 30.0])
        theirs = transformers.Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, 2)
        assert frame_timestamps(indices, fps, 2) == theirs
