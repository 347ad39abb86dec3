"""What vLLM 0.32's media loaders would report about an item: the inputs of its ``mm_hash``.

vLLM hashes an image by its bytes (and whether its mode was converted), a
video by its bytes plus the metadata its OpenCV loader reports, an audio clip
by its decoded waveform (``epd_trio.protocol.vllm_hash``). This module finds
those facts from an item's bytes, with the same libraries the engine decodes
with (PIL, PyAV, soundfile), following vLLM's rules:

- image: opened, EXIF orientation applied, loaded; any mode but RGB is
  converted by vLLM (``converted``).
- video: OpenCV's frame count (the container's ``nb_frames``, else duration ×
  rate rounded) and rate (FFmpeg's guessed frame rate), then the frames the
  model family's vLLM loader samples (``qwen2_vl``: Qwen2-VL's fps rule,
  float32 steps; ``qwen3_vl``: Qwen3-VL's linspace; other families: vLLM's
  uniform sampler, 32 frames). When those frames take fewer bytes than the
  file, vLLM hashes the decoded pixels instead, which cannot be reproduced
  exactly outside its decoder: such an item needs a ``uuid``.
- audio: the mono float32 waveform. vLLM resamples a clip that is not at the
  model's rate with torchaudio, which cannot be reproduced here either: such a
  clip needs a ``uuid``.

Every refusal is a ``RequestError`` that says to send a ``uuid``.
"""

from __future__ import annotations

import contextlib
import io
import math
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from epd_trio.errors import RequestError
from epd_trio.model.audio import decode_audio
from epd_trio.model.media import MediaLimits, decode_image, item_error, open_image
from epd_trio.protocol.vllm_hash import (
    AudioSamples,
    EncodedImage,
    EncodedVideo,
    HashInput,
)

__all__ = ["VllmMediaRules", "hash_input", "rules_for"]

# vLLM's uniform video sampler takes this many frames by default (VideoMediaIO).
_UNIFORM_FRAMES: Final = 32
_QWEN_FPS: Final = 2  # vLLM's Qwen video loaders sample at 2 fps ...
_QWEN_MAX_FRAMES: Final = 768  # ... between 4 frames and 768
_QWEN_MIN_FRAMES: Final = 4
_TEMPORAL_PATCH: Final = 2
_NEEDS_UUID: Final = "give its content part a 'uuid' (vLLM then uses it as the item's hash)"


@dataclass(frozen=True)
class VllmMediaRules:
    """Which of vLLM's loaders a model family's items go through."""

    video_loader: str = "opencv"  # opencv (uniform), qwen2_vl or qwen3_vl
    audio_rate: int = 16000


def rules_for(family: str, audio_rate: int = 16000) -> VllmMediaRules:
    """vLLM picks its video loader by the checkpoint's video processor class."""
    loader = {"qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_vl", "qwen3_vl": "qwen3_vl"}.get(family, "opencv")
    return VllmMediaRules(loader, audio_rate)


def hash_input(modality: str, data: bytes, index: int, limits: MediaLimits,
               rules: VllmMediaRules) -> HashInput:
    """What vLLM's ``mm_hash`` of this item is computed from (blocking: decodes)."""
    if modality == "image":
        return _image(data, index, limits)
    if modality == "video":
        return _video(data, index, rules.video_loader)
    return _audio(data, index, limits, rules.audio_rate)


def _image(data: bytes, index: int, limits: MediaLimits) -> EncodedImage:
    from PIL import ImageOps

    decode_image(data, index, limits)  # the engine's own checks: format, pixels, a clean decode
    image = open_image(data)
    with contextlib.suppress(Exception):  # as vLLM: a broken EXIF block leaves the image as it is
        image = ImageOps.exif_transpose(image)
    image.load()
    return EncodedImage(data, converted=image.mode != "RGB")


def _video(data: bytes, index: int, loader: str) -> EncodedVideo:
    total, fps, frame_bytes = _opencv_source(data, index)
    if loader == "qwen3_vl" and fps <= 0:
        fps = 24.0  # vLLM's Qwen3-VL loader assumes a 24 fps source when the rate is unknown
    duration = total / fps if fps > 0 else 0
    indices = _sampled(loader, total, fps, duration, index)
    if len(indices) * frame_bytes < len(data):
        raise RequestError(f"item {index}: vLLM names this video by its decoded frames, which this "
                           f"encoder cannot reproduce exactly; {_NEEDS_UUID}")
    metadata = {"total_num_frames": total, "fps": fps, "duration": duration, "video_backend": "opencv",
                "frames_indices": indices, "do_sample_frames": len(indices) == total}
    return EncodedVideo(data, metadata)


def _opencv_source(data: bytes, index: int) -> tuple[int, float, int]:
    """Frame count and rate as OpenCV's FFmpeg backend reads them, and one RGB frame's bytes."""
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise item_error(index, "the file has no video stream")
            stream = container.streams.video[0]
            rate = stream.guessed_rate
            fps = float(rate) if rate else 0.0
            if fps <= 0 and stream.time_base:
                fps = 1.0 / float(stream.time_base)
            total = int(stream.frames)
            if total <= 0:
                seconds = container.duration / av.time_base if container.duration else 0.0
                total = math.floor(seconds * fps + 0.5)
            width, height = stream.codec_context.width, stream.codec_context.height
    except (av.FFmpegError, ValueError, IndexError) as exc:
        raise item_error(index, f"bytes are not a video in a known format ({exc})") from None
    if total <= 0:
        raise item_error(index, "the video has no frames")
    return total, fps, width * height * 3


def _sampled(loader: str, total: int, fps: float, duration: float, index: int) -> list[int]:
    """The frame indices vLLM's ``loader`` samples (its ``compute_frames_index_to_sample``)."""
    if loader == "qwen2_vl":
        if fps <= 0:
            raise item_error(index, "the video's frame rate is unknown")
        import torch

        most = math.floor(min(_QWEN_MAX_FRAMES, total) / _TEMPORAL_PATCH) * _TEMPORAL_PATCH
        n = total / fps * min(_QWEN_FPS, 30)
        n = min(max(n, _QWEN_MIN_FRAMES), most, total)
        n = math.floor(n / _TEMPORAL_PATCH) * _TEMPORAL_PATCH
        if n <= 0:
            raise item_error(index, f"the video has too few frames ({total}) to sample")
        steps = torch.arange(0, total, total / n).int()
        return [int(i) for i in torch.clamp(steps, max=total - 1).tolist()]
    if loader == "qwen3_vl":
        count = int(total / fps * min(_QWEN_FPS, 30))
        count = min(max(count, _QWEN_MIN_FRAMES), _QWEN_MAX_FRAMES, total)
        return [int(i) for i in np.linspace(0, total - 1, count).round().astype(int).tolist()]
    count = max(1, min(_UNIFORM_FRAMES, total))
    if count == total:
        return list(range(total))
    return [int(i) for i in np.linspace(0, total - 1, count, dtype=int).tolist()]


def _audio(data: bytes, index: int, limits: MediaLimits, rate: int) -> AudioSamples:
    import soundfile

    source_rate: Any = None
    with contextlib.suppress(Exception):  # not a libsndfile format: decode_audio tries PyAV
        source_rate = soundfile.info(io.BytesIO(data)).samplerate
    if source_rate is None:
        source_rate = _pyav_rate(data, index)
    if source_rate != rate:
        raise RequestError(f"item {index}: the clip is at {source_rate} Hz and vLLM resamples it to "
                           f"{rate} Hz with torchaudio, which this encoder cannot reproduce "
                           f"exactly; {_NEEDS_UUID}")
    return AudioSamples(decode_audio(data, index, limits, rate))


def _pyav_rate(data: bytes, index: int) -> int:
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise item_error(index, "bytes are not audio in a known format")
            return int(container.streams.audio[0].rate)
    except (av.FFmpegError, ValueError, IndexError) as exc:
        raise item_error(index, f"bytes are not audio in a known format ({exc})") from None
