"""What the language model should receive, computed by transformers' own code only.

The same references as ``tests/model`` (``get_image_features``,
``get_video_features`` with deepstack, Qwen2-Audio's own forward), here for
the media the SGLang end-to-end tests send, as data URIs.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import soundfile
import torch
import transformers
from transformers.video_utils import load_video

from conftest import audio_reference, with_deepstack

FPS = 2.0  # the encoder's --video-fps default, which the references sample at too
AUDIO_RATE = 16000


@dataclass
class Expected:
    """Per item: the embedding rows, the grid SGLang should see, and video extras."""

    embeddings: list[torch.Tensor]
    grids: list[Any]
    second_per_grid_ts: list[float] = field(default_factory=list)
    timestamps: list[list[float]] = field(default_factory=list)

    def cat(self) -> torch.Tensor:
        return torch.cat(self.embeddings)


def uri(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def wav_bytes(wave: np.ndarray) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, wave, AUDIO_RATE, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def _vision_model(path: str) -> Any:
    return transformers.AutoModelForImageTextToText.from_pretrained(path).eval()


def images(path: str, pil: list[Any]) -> Expected:
    model, processor = _vision_model(path), transformers.AutoImageProcessor.from_pretrained(path)
    result = Expected([], [])
    with torch.inference_mode():
        for image in pil:
            inputs = processor(images=[image], return_tensors="pt")
            result.embeddings.append(with_deepstack(
                model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])))
            result.grids.append(inputs["image_grid_thw"][0].tolist())
    return result


def videos(path: str, files: list[Path]) -> Expected:
    model = _vision_model(path)
    vp = transformers.AutoVideoProcessor.from_pretrained(path)
    tps = vp.temporal_patch_size
    result = Expected([], [])
    with torch.inference_mode():
        for file in files:
            frames, meta = load_video(str(file), backend="pyav", sample_indices_fn=lambda metadata, **_:
                                      vp.sample_frames(metadata, fps=FPS))
            inputs = vp(videos=[frames], do_sample_frames=False, return_tensors="pt")
            grid = inputs["video_grid_thw"]
            result.embeddings.append(with_deepstack(
                model.get_video_features(inputs["pixel_values_videos"], grid)))
            result.grids.append(grid[0].tolist())
            result.second_per_grid_ts.append(tps / meta.sampled_fps)
            result.timestamps.append(transformers.Qwen3VLProcessor._calculate_timestamps(
                None, list(meta.frames_indices), meta.fps, tps))
    return result


def audio(path: str, waves: list[np.ndarray]) -> Expected:
    """Audio rows of the LM's input embeddings; the grid is the mel-frame length per item."""
    rows, counts, lengths = audio_reference(path, waves, AUDIO_RATE)
    return Expected(list(rows.split(counts)), lengths)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
