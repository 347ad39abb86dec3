"""Generated media for demos, health probes and tests: no assets, deterministic.

``sample_video`` writes a short MP4 with PyAV (moving gradient and stripes),
``sample_tone`` a WAV of a sine tone with soundfile, ``sample_png`` a PNG.
All are real files that go through the same decoders as a user's upload;
``probe_request`` picks the cheapest one a model can encode (health probes).
"""

from __future__ import annotations

import io

import numpy as np

__all__ = ["generated_frames", "probe_request", "sample_png", "sample_tone", "sample_video", "tone"]


def generated_frames(frames: int = 8, width: int = 64, height: int = 48, seed: int = 0) -> np.ndarray:
    """``[frames, height, width, 3]`` uint8 RGB: a gradient that moves, stripes, a little noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    out = np.empty((frames, height, width, 3), dtype=np.int16)
    for t in range(frames):
        out[t, ..., 0] = (x * 255 // max(width - 1, 1) + 16 * t) % 256
        out[t, ..., 1] = (y * 255 // max(height - 1, 1)) % 256
        out[t, ..., 2] = ((x // 8 + y // 8 + t) % 2) * 200
    noise = rng.integers(0, 24, out.shape, dtype=np.int16)
    return np.clip(out + noise, 0, 255).astype(np.uint8)


def sample_video(frames: int = 8, fps: float = 4.0, width: int = 64, height: int = 48,
                 seed: int = 0, codec: str = "mpeg4", container: str = "mp4") -> bytes:
    """A video file of ``frames`` generated frames at ``fps``."""
    from fractions import Fraction

    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=Fraction(fps).limit_denominator(1000))
        if not isinstance(stream, av.VideoStream):
            raise ValueError(f"{codec!r} is not a video codec")
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for frame in generated_frames(frames, width, height, seed):
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def tone(seconds: float, rate: int = 16000, hz: float = 440.0, channels: int = 1) -> np.ndarray:
    """``[samples, channels]`` float32 sine; channel ``c`` at ``hz * (c + 1)``, amplitude 0.5."""
    t = np.arange(round(seconds * rate)) / rate
    return np.stack([0.5 * np.sin(2 * np.pi * hz * (c + 1) * t) for c in range(channels)],
                    axis=1).astype(np.float32)


def sample_tone(seconds: float = 1.0, rate: int = 16000, hz: float = 440.0, channels: int = 1,
                fmt: str = "WAV", subtype: str | None = None) -> bytes:
    """An audio file (WAV by default; any soundfile format/subtype) of a sine tone."""
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, tone(seconds, rate, hz, channels), rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def sample_png(width: int = 28, height: int = 28, seed: int = 0) -> bytes:
    """A PNG of one generated frame (28x28: the smallest every Qwen-VL processor takes)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(generated_frames(1, width, height, seed)[0]).save(buf, format="PNG")
    return buf.getvalue()


def probe_request(modalities: frozenset[str] | set[str] | tuple[str, ...]) -> tuple[str, list[bytes]]:
    """``(modality, items)``: the cheapest real request a model with ``modalities`` encodes."""
    if "image" in modalities:
        return "image", [sample_png()]
    if "audio" in modalities:
        return "audio", [sample_tone(0.5)]
    if "video" in modalities:
        return "video", [sample_video(4, fps=2.0, width=28, height=28)]
    raise ValueError(f"no probe for modalities {sorted(modalities)}")
