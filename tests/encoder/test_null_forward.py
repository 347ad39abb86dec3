"""``--null-forward``: the benchmarking stand-in device answers zeros of the model's own shape.

Each family's real forward is the reference: the stand-in must give the same
row count (from the processor's token counts), width and dtype, and the
encoder must answer with it as with any embedding.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conftest import data_uri, png_bytes
from epd_trio.cli import build_parser
from epd_trio.config import EncoderConfig, config_from_args
from epd_trio.engine import open_engine
from epd_trio.model.samples import probe_request
from epd_trio.protocol.codec import decode_safetensors
from epd_trio.scheduling.worker import NullForwardWorker


def test_the_flag_maps_to_the_engine_config() -> None:
    args = build_parser().parse_args(["encoder", "--null-forward"])
    assert config_from_args(EncoderConfig, args, environ={}).engine.null_forward is True
    assert config_from_args(EncoderConfig, build_parser().parse_args(["encoder"]),
                            environ={"EPD_NULL_FORWARD": "1"}).engine.null_forward is True
    assert EncoderConfig().engine.null_forward is False


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "qwen2_audio"])
async def test_zeros_of_the_real_forwards_shape_and_dtype(checkpoints: dict[str, str], arch: str) -> None:
    modality, items = probe_request({"qwen2_audio": ("audio",)}.get(arch, ("image",)))
    async with open_engine(model_path=checkpoints[arch], null_forward=True) as null:
        assert all(isinstance(w, NullForwardWorker) for w in null.workers)
        stand_in = await null.encode(items + items, modality)
    async with open_engine(model_path=checkpoints[arch]) as real:
        reference = await real.encode(items + items, modality)
    assert stand_in.embedding.shape == reference.embedding.shape
    assert stand_in.embedding.dtype == reference.embedding.dtype
    assert not stand_in.embedding.any()
    assert (stand_in.token_counts, stand_in.grid_thw) == (reference.token_counts, reference.grid_thw)


async def test_the_encoder_answers_zeros_inline(encoder: Any) -> None:
    image = png_bytes(64, 64, seed=1)
    async with encoder(null_forward=True) as (server, http):
        r = await http.post("/encode", json={"req_id": "z", "modality": "image",
                                             "mm_items": [data_uri(image)]})
        assert r.status_code == 200, r.text
        embedding, meta = decode_safetensors(r.content)
        stats = (await http.get("/stats")).json()
        info = server.service.model_info
    assert embedding.shape == (sum(meta["token_counts"]), info.dim)
    assert str(embedding.dtype).removeprefix("torch.") == info.dtype
    assert torch.equal(embedding, torch.zeros_like(embedding))
    # The thread-run stages' CPU ledger counted this request (and the health probe, if any).
    assert {"preprocess", "forward"} <= stats["cpu_seconds"].keys()
    assert stats["cpu_seconds"]["forward"]["calls"] >= 1
