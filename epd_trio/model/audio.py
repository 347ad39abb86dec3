"""Audio items: decoded, mixed to mono and resampled to the feature extractor's rate.

Files are read with soundfile (libsndfile: WAV of any PCM/float subtype, FLAC,
OGG, MP3, ...); what it does not know (AAC/M4A, Opus in WebM, ...) is read
with PyAV. Channels are averaged (a plain mean, the usual mono mix), and the
rate is converted with FFmpeg's resampler (libswresample, through PyAV). The
length is checked on the file's header before decoding, and again after.

Every failure is a ``RequestError`` naming the item's index.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from epd_trio.errors import EPDError, PayloadTooLargeError
from epd_trio.model.media import MediaLimits, item_error

__all__ = ["MAX_SAMPLE_RATE", "MIN_SAMPLE_RATE", "decode_audio", "resample"]

# Rates a real recording has (telephony's 8 kHz up to studio 768 kHz); outside them FFmpeg's
# resampler fails (a 2 GHz header: out of memory) or quietly gives no samples.
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 1_000, 768_000


def decode_audio(data: Any, index: int, limits: MediaLimits, rate: int) -> np.ndarray:
    """A mono float32 waveform at ``rate`` samples per second."""
    if not isinstance(data, bytes):
        raise item_error(index, f"an audio item must be an audio file, not {type(data).__name__}")
    decoded = _read_soundfile(data, index, limits)
    if decoded is None:
        decoded = _read_pyav(data, index, limits)
    wave, source_rate = decoded
    if not MIN_SAMPLE_RATE <= source_rate <= MAX_SAMPLE_RATE:
        raise item_error(index, f"audio sample rate {source_rate} Hz is outside "
                                f"{MIN_SAMPLE_RATE}-{MAX_SAMPLE_RATE} Hz")
    if wave.shape[0] == 0:
        raise item_error(index, "audio has no samples")
    if not np.isfinite(wave).all():  # float WAV/FLAC can hold them; the embedding would be NaN
        raise item_error(index, "audio samples must be finite (no NaN or infinity)")
    _check_seconds(wave.shape[0] / source_rate, index, limits)
    mono = wave.mean(axis=1, dtype=np.float32) if wave.shape[1] > 1 else wave[:, 0]
    if source_rate != rate:
        mono = resample(mono, source_rate, rate)
    return np.ascontiguousarray(mono, dtype=np.float32)


def resample(wave: np.ndarray, source_rate: int, rate: int) -> np.ndarray:
    """``wave`` (mono) from ``source_rate`` to ``rate`` with libswresample."""
    import av

    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
    frame = av.AudioFrame.from_ndarray(
        np.ascontiguousarray(wave, dtype=np.float32)[None, :], format="flt", layout="mono")
    frame.sample_rate = source_rate
    out = [*resampler.resample(frame), *resampler.resample(None)]
    if not out:
        return np.zeros(0, dtype=np.float32)
    return np.concatenate([f.to_ndarray()[0] for f in out])


def _read_soundfile(data: bytes, index: int, limits: MediaLimits) -> tuple[np.ndarray, int] | None:
    """``([samples, channels] float32, rate)``, or ``None`` if libsndfile does not know the format."""
    import soundfile

    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            if f.samplerate <= 0:
                raise item_error(index, "audio has no sample rate")
            _check_seconds(f.frames / f.samplerate, index, limits)
            return f.read(dtype="float32", always_2d=True), f.samplerate
    except EPDError:
        raise
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError):
        return None


def _read_pyav(data: bytes, index: int, limits: MediaLimits) -> tuple[np.ndarray, int]:
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise item_error(index, "bytes are not audio in a known format")
            stream = container.streams.audio[0]
            if stream.codec_context is None:  # a codec this FFmpeg build does not know
                raise item_error(index, "the audio's codec cannot be decoded")
            rate = stream.rate
            if not rate:
                raise item_error(index, "audio has no sample rate")
            if container.duration is not None:
                _check_seconds(container.duration / av.time_base, index, limits)
            # Planar float, channels kept: the mono mix is ours, as for soundfile.
            to_float = av.AudioResampler(format="fltp", rate=rate)
            chunks, samples, cap = [], 0, int(limits.max_audio_seconds * rate) + rate
            for frame in container.decode(stream):
                for out in to_float.resample(frame):
                    chunks.append(out.to_ndarray())
                    samples += chunks[-1].shape[1]
                if samples > cap:  # a lying header: stop before holding it all
                    _check_seconds(samples / rate, index, limits)
    except EPDError:
        raise
    except (av.FFmpegError, ValueError, IndexError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise item_error(index, f"bytes are not audio in a known format ({reason})") from None
    if not chunks:
        raise item_error(index, "audio has no samples")
    return np.concatenate(chunks, axis=1).T, rate


def _check_seconds(seconds: float, index: int, limits: MediaLimits) -> None:
    if seconds > limits.max_audio_seconds:
        raise PayloadTooLargeError(
            f"item {index}: audio is {seconds:.1f} s long, over the cap of "
            f"{limits.max_audio_seconds:g} s")
