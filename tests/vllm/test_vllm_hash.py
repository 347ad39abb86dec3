"""Our mm_hash equals vLLM 0.32's own (its MultiModalHasher, run from the vLLM venv).

Each item goes through vLLM's chat loading path (MediaConnector on a data: URL,
its data parser) and ``ProcessorInputs.get_mm_hashes`` in a subprocess, and
through ``vllm_media.hash_input`` + ``vllm_hash.item_hash`` here.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from conftest import jpeg_bytes, png_bytes
from epd_trio.errors import RequestError
from epd_trio.model.media import MediaLimits
from epd_trio.model.samples import sample_tone, sample_video
from epd_trio.model.vllm_media import VllmMediaRules, hash_input
from epd_trio.protocol.vllm_hash import EncodedImage, item_hash
from vllm_harness import VllmEnv, vllm_env  # noqa: F401  (the fixture)

MODEL = "/models/Qwen2.5-VL-3B-Instruct"
VIDEO_PROCESSORS = {"qwen2_vl": "Qwen2VLVideoProcessor", "qwen3_vl": "Qwen3VLVideoProcessor",
                    "opencv": None}


def _image(mode: str) -> bytes:
    buf = io.BytesIO()
    rgb = Image.open(io.BytesIO(png_bytes(40, 30, seed=5)))
    (rgb.convert(mode) if mode != "RGB" else rgb).save(buf, format="PNG")
    return buf.getvalue()


def _cases(tmp_path: Path) -> list[tuple[dict[str, Any], str]]:
    """(vLLM-side case, our hash) pairs."""
    limits = MediaLimits()
    out: list[tuple[dict[str, Any], str]] = []

    def add(modality: str, name: str, data: bytes, rules: VllmMediaRules = VllmMediaRules(),
            uuid: str | None = None, model: str = MODEL, algorithm: str = "blake3",
            **side: Any) -> None:
        path = tmp_path / name
        path.write_bytes(data)
        ours = item_hash(model, modality, hash_input(modality, data, 0, limits, rules),
                         uuid=uuid, algorithm=algorithm)
        out.append(({"modality": modality, "path": str(path), "model_id": model, "uuid": uuid,
                     "algorithm": algorithm, **side}, ours))

    for mode in ("RGB", "RGBA", "L", "P"):
        add("image", f"image-{mode}.png", _image(mode))
    add("image", "image.jpg", jpeg_bytes(48, 32, seed=2))
    add("image", "other-model.png", _image("RGB"), model="Qwen/Qwen2.5-VL-7B-Instruct")
    add("image", "sha256.png", _image("RGB"), algorithm="sha256")
    add("image", "uuid.png", _image("RGB"), uuid="my-image-1")
    for loader, processor in VIDEO_PROCESSORS.items():
        for name, video in (("short", sample_video()), ("long", sample_video(30, 10.0, 96, 64, seed=3))):
            add("video", f"{name}-{loader}.mp4", video, VllmMediaRules(video_loader=loader),
                video_processor=processor, video_needs_metadata=loader == "qwen3_vl")
    add("audio", "mono.wav", sample_tone(1.0))
    add("audio", "stereo.wav", sample_tone(0.5, channels=2, hz=300.0))
    return out


def test_our_mm_hash_is_vllms(vllm_env: VllmEnv, tmp_path: Path) -> None:
    cases = _cases(tmp_path)
    theirs = vllm_env.side_hashes([case for case, _ in cases])
    mismatched = [(case["path"], ours, got) for (case, ours), got in zip(cases, theirs) if ours != got]
    assert not mismatched
    assert len(set(theirs)) == len(theirs)  # every case names a different item


def test_converted_images_hash_differently_from_their_bytes() -> None:
    data = _image("RGBA")
    plain = item_hash(MODEL, "image", EncodedImage(data))
    converted = item_hash(MODEL, "image", hash_input("image", data, 0, MediaLimits(), VllmMediaRules()))
    assert plain != converted


def test_audio_vllm_would_resample_needs_a_uuid() -> None:
    with pytest.raises(RequestError, match="uuid"):
        hash_input("audio", sample_tone(0.5, rate=22050), 0, MediaLimits(), VllmMediaRules(audio_rate=16000))


def test_a_video_hashed_by_its_frames_needs_a_uuid() -> None:
    """vLLM hashes the decoded frames when they take fewer bytes than the file (here: noise,
    padded), which cannot be reproduced exactly outside its decoder."""
    rng = np.random.default_rng(0)
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=2)
        stream.width, stream.height, stream.pix_fmt = 16, 16, "yuv420p"
        stream.bit_rate = 10_000_000
        for _ in range(4):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    data = buf.getvalue()
    rules = VllmMediaRules(video_loader="qwen3_vl")
    with pytest.raises(RequestError, match="uuid"):
        hash_input("video", data + b"\0" * 4096, 0, MediaLimits(), rules)
