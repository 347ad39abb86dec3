"""Audio (Qwen2-Audio): the engine's embeddings equal what the full model feeds its LM.

The reference runs ``Qwen2AudioForConditionalGeneration`` itself, with one
audio placeholder token per expected embedding, and captures the
``inputs_embeds`` its language model receives: the audio rows there are the
audio tower + projector output exactly as the model uses it.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile
import torch
import transformers
import trio

from conftest import audio_reference
from epd_trio import open_engine
from epd_trio.errors import PayloadTooLargeError, RequestError
from epd_trio.model.adapters.qwen_audio import audio_token_count
from epd_trio.model.audio import decode_audio, resample
from epd_trio.model.loader import load_encoder
from epd_trio.model.media import MediaLimits
from epd_trio.model.preprocess import EncoderPreprocessor
from epd_trio.model.samples import sample_tone, tone

RATE = 16000  # TEST_SPECS["qwen2_audio"]: 16 kHz, a 5 s window


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def wav(wave: np.ndarray, rate: int = RATE, subtype: str = "FLOAT", fmt: str = "WAV") -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, wave, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def noise(seconds: float, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(seconds * RATE)) * 0.1).astype(np.float32)


def reference(path: str, waves: list[np.ndarray]) -> tuple[torch.Tensor, list[int]]:
    """Audio rows of the LM's input embeddings, and the processor's token counts."""
    rows, counts, _ = audio_reference(path, waves, RATE)
    return rows, counts


async def test_audio_equals_the_models_own_path(checkpoints: dict[str, str]) -> None:
    path = checkpoints["qwen2_audio"]
    # 0.05 s makes a single token; 4.99 s nearly fills the 5 s window.
    waves = [noise(0.05, 1), noise(1.3, 2), tone(4.99)[:, 0], noise(2.0, 3)]
    expected, counts = await trio.to_thread.run_sync(reference, path, waves)
    items = [wav(w) for w in waves]
    # Batching pinned on: the adaptive cap would start each request alone.
    async with open_engine(model_path=path, dtype="float32", coalesce_delay=0.05,
                           adaptive_batch=False) as engine:
        info = engine.model_info
        assert (info.model_type, info.modalities, info.dim) == ("qwen2_audio", ("audio",), 40)
        out = await engine.encode(items, "audio")  # one request, four items
        assert out.token_counts == counts and counts[0] == 1 and out.grid_thw == []
        assert out.embedding.shape == expected.shape
        assert rel_err(out.embedding, expected) < 1e-4
        # Four concurrent requests: they batch, and each gets its own rows.
        before = engine.statistics().batches_run
        alone: list = [None] * len(items)

        async def call(i: int) -> None:
            alone[i] = await engine.encode([items[i]], "audio")

        async with trio.open_nursery() as nursery:
            for i in range(len(items)):
                nursery.start_soon(call, i)
        assert engine.statistics().batches_run - before < len(items), "audio requests did not batch"
    for i, result in enumerate(alone):
        assert rel_err(result.embedding, out.item(i)) < 1e-5, i


def test_token_counts_follow_the_models_formula(checkpoints: dict[str, str]) -> None:
    tower = transformers.Qwen2AudioForConditionalGeneration.from_pretrained(
        checkpoints["qwen2_audio"]).model.audio_tower
    frames = torch.arange(1, 3001)
    _, theirs = tower._get_feat_extract_output_lengths(frames)
    assert [audio_token_count(int(n)) for n in frames] == theirs.tolist()


def test_loads_only_the_audio_tower_and_projector(checkpoints: dict[str, str]) -> None:
    path = checkpoints["qwen2_audio"]
    enc = load_encoder(path)
    full = transformers.Qwen2AudioForConditionalGeneration.from_pretrained(path).model
    theirs = {**{f"audio_tower.{k}": v for k, v in full.audio_tower.state_dict().items()},
              **{f"multi_modal_projector.{k}": v for k, v in full.multi_modal_projector.state_dict().items()}}
    ours = enc.module.state_dict()
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
    lm_params = sum(p.numel() for p in full.language_model.parameters())
    assert sum(p.numel() for p in enc.module.parameters()) == sum(v.numel() for v in theirs.values())
    assert lm_params > 0 and set(enc.processors) == {"audio"} and enc.processor is None


def test_resampler_keeps_the_signal() -> None:
    for source in (8000, 22050, 44100, 48000):
        out = resample(tone(1.0, source)[:, 0], source, RATE)
        assert abs(out.shape[0] - RATE) <= 1
        inner = slice(200, RATE - 200)  # away from the filter's edges
        assert np.abs(out[inner] - tone(1.0, RATE)[inner, 0]).max() < 2e-3, source


def test_stereo_8bit_flac_mp3_and_other_rates_decode_to_the_same_tone() -> None:
    expected = tone(1.0, RATE, channels=2).mean(axis=1)
    inner = slice(400, RATE - 400)
    cases = {
        "stereo float 44.1k": (sample_tone(1.0, 44100, channels=2, subtype="FLOAT"), 2e-3),
        "stereo 16-bit 16k": (sample_tone(1.0, RATE, channels=2, subtype="PCM_16"), 1e-4),
        "stereo 8-bit 22.05k": (sample_tone(1.0, 22050, channels=2, subtype="PCM_U8"), 1.5e-2),
        "stereo flac 48k": (sample_tone(1.0, 48000, channels=2, fmt="FLAC"), 2e-3),
    }
    for name, (data, tolerance) in cases.items():
        got = decode_audio(data, 0, MediaLimits(), RATE)
        assert got.dtype == np.float32 and got.ndim == 1 and abs(got.shape[0] - RATE) <= 1, name
        assert np.abs(got[inner] - expected[inner]).max() < tolerance, name
    # MP3 is lossy and delays the signal: check its length and its pitch.
    got = decode_audio(sample_tone(1.0, 44100, channels=2, fmt="MP3"), 0, MediaLimits(), RATE)
    assert abs(got.shape[0] - RATE) < 0.1 * RATE
    spectrum = np.abs(np.fft.rfft(got[:RATE // 2]))
    assert {round(f) for f in np.argsort(spectrum)[-2:] * 2} == {440, 880}


async def test_stereo_and_8bit_files_encode(checkpoints: dict[str, str]) -> None:
    path = checkpoints["qwen2_audio"]
    items = [sample_tone(1.0, 44100, channels=2, subtype="PCM_16"),
             sample_tone(0.7, 8000, subtype="PCM_U8")]
    waves = [decode_audio(item, i, MediaLimits(), RATE) for i, item in enumerate(items)]
    expected, counts = await trio.to_thread.run_sync(reference, path, waves)
    async with open_engine(model_path=path, dtype="float32") as engine:
        out = await engine.encode(items, "audio")
    assert out.token_counts == counts
    assert rel_err(out.embedding, expected) < 1e-4


def wav_at(rate: int, samples: int = 1000) -> bytes:
    """A 16-bit mono WAV whose header claims ``rate``: written by hand (writers refuse odd rates)."""
    import struct

    data = np.zeros(samples, np.int16).tobytes()
    fmt = struct.pack("<HHIIHH", 1, 1, rate, (rate * 2) & 0xFFFFFFFF, 2, 16)
    return (b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt " + struct.pack("<I", 16) + fmt
            + b"data" + struct.pack("<I", len(data)) + data)


def pcm_mkv(codec_id: bytes) -> bytes:
    """Half a second of PCM in Matroska, the start of its codec id replaced by ``codec_id``."""
    import av

    out = io.BytesIO()
    with av.open(out, "w", format="matroska") as container:
        stream = container.add_stream("pcm_s16le", rate=16000, layout="mono")
        for i in range(5):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1600), np.int16), format="s16", layout="mono")
            frame.sample_rate, frame.pts = 16000, i * 1600
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue().replace(b"A_PCM", codec_id[:5].ljust(5, b"Z"))


ODD = [
    ("too short for a token", [wav(noise(1.0, 0)), wav(noise(0.01, 0))], RequestError,
     r"item 1: audio is too short \(0.010 s\)"),
    ("over the model's window", [wav(noise(5.5, 0))], RequestError,
     r"item 0: audio is 5.50 s long, over the model's window of 5 s"),
    ("no samples", [wav(np.zeros(0, np.float32))], RequestError, "item 0: audio has no samples"),
    ("corrupt bytes", [wav(noise(0.5, 0)), b"RIFF\x00\x00garbage" * 20], RequestError,
     "item 1: bytes are not audio in a known format"),
    ("truncated header", [wav(noise(0.5, 0))[:30]], RequestError, "item 0: bytes are not audio"),
    ("a PIL image", [None], RequestError, "item 0: an audio item must be an audio file"),
    ("NaN samples", [wav(noise(0.5, 0)), wav(np.full(8000, np.nan, np.float32))], RequestError,
     r"item 1: audio samples must be finite"),
    ("an infinite sample", [wav(np.r_[noise(0.5, 0), np.float32(np.inf)].astype(np.float32))],
     RequestError, r"item 0: audio samples must be finite"),
    ("a 2 GHz sample rate", [wav_at(2**31 - 1)], RequestError,
     "item 0: audio sample rate 2147483647 Hz is outside 1000-768000 Hz"),
    ("a 2 MHz sample rate", [wav_at(2_000_000)], RequestError, "item 0: audio sample rate 2000000 Hz"),
    ("an unknown codec", [pcm_mkv(b"A_ZZZ")], RequestError, "item 0: the audio's codec cannot be decoded"),
]


@pytest.mark.parametrize(("name", "items", "error", "message"), ODD, ids=[o[0] for o in ODD])
def test_odd_audio_is_a_request_error(checkpoints: dict[str, str], name: str, items: list,
                                      error: type, message: str) -> None:
    enc = load_encoder(checkpoints["qwen2_audio"])
    pre = EncoderPreprocessor(enc.adapter, enc.processors, MediaLimits())
    if items == [None]:
        from conftest import random_image

        items = [random_image(8, 8)]
    with pytest.raises(error, match=message):
        pre.preprocess(items, "audio")


def test_audio_length_cap_is_checked(checkpoints: dict[str, str]) -> None:
    enc = load_encoder(checkpoints["qwen2_audio"])
    pre = EncoderPreprocessor(enc.adapter, enc.processors, MediaLimits(max_audio_seconds=2.0))
    with pytest.raises(PayloadTooLargeError, match=r"item 1: audio is 3.0 s long, over the cap of 2 s"):
        pre.preprocess([wav(noise(1.0, 0)), sample_tone(3.0, 44100, fmt="FLAC")], "audio")
    # A format libsndfile does not read goes through PyAV, with the same cap.
    m4a = _aac(3.0)
    with pytest.raises(PayloadTooLargeError, match=r"item 0: audio is 3\.\d s long, over the cap"):
        pre.preprocess([m4a], "audio")
    assert pre.preprocess([_aac(1.0)], "audio").token_counts[0] > 0


def _aac(seconds: float) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("aac", rate=RATE, layout="mono")
        frame = av.AudioFrame.from_ndarray(tone(seconds)[:, 0][None, :], format="flt", layout="mono")
        frame.sample_rate = RATE
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()
