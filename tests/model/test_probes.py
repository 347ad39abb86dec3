"""Every family encodes its generated probe request, end to end through the real code."""

from __future__ import annotations

import pytest
import torch

from conftest import TEST_SPECS
from epd_trio.model.loader import load_encoder
from epd_trio.model.media import MediaLimits
from epd_trio.model.preprocess import EncoderPreprocessor
from epd_trio.model.samples import probe_request
from epd_trio.model.tiny import TINY_ARCHES


def test_every_tiny_arch_is_tested() -> None:
    assert set(TEST_SPECS) == set(TINY_ARCHES)


@pytest.mark.parametrize("arch", sorted(TEST_SPECS))
def test_probe_request_encodes(checkpoints: dict[str, str], arch: str) -> None:
    enc = load_encoder(checkpoints[arch])
    modality, items = probe_request(enc.adapter.modalities)
    assert modality == ("audio" if arch == "qwen2_audio" else "image")
    pre = EncoderPreprocessor(enc.adapter, enc.processors, MediaLimits()).preprocess(items, modality)
    with torch.inference_mode():
        out = enc.adapter.forward(enc.module, enc.adapter.collate([pre]))
    assert out.shape == (pre.tokens, enc.adapter.embedding_dim) and pre.tokens > 0
    assert torch.isfinite(out).all()
    if "video" in enc.adapter.modalities:  # the video probe works too
        _, videos = probe_request({"video"})
        assert EncoderPreprocessor(enc.adapter, enc.processors, MediaLimits()).preprocess(
            videos, "video").grid_thw[0][0] == 2
    with pytest.raises(ValueError):
        probe_request(set())
