"""Videos: the engine's embeddings, grids and extras equal transformers' own pipeline.

The reference decodes with transformers' own PyAV loader (``video_utils.load_video``),
samples with the video processor's own ``sample_frames``, processes with the
video processor and encodes with the full model's ``get_video_features``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
import trio
from PIL import Image
from transformers.video_utils import load_video

from conftest import png_bytes, with_deepstack
from epd_trio import open_engine
from epd_trio.errors import PayloadTooLargeError, RequestError
from epd_trio.model.loader import load_encoder
from epd_trio.model.media import MediaLimits
from epd_trio.model.preprocess import EncoderPreprocessor
from epd_trio.model.samples import generated_frames, sample_tone, sample_video

ARCHES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
# (frames, fps, width, height): 2.5 s at 10 fps; 5 s at 8 fps, another shape; 3 frames only.
VIDEOS = [(25, 10.0, 64, 48), (40, 8.0, 90, 60), (3, 6.0, 56, 56)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def features(model, pixel_values, grid) -> torch.Tensor:
    return with_deepstack(model.get_video_features(pixel_values, grid))


def reference(path: str, videos: list, fps: float = 2.0, bounds: dict | None = None) -> list[dict]:
    """Per video: embedding, grid, extras, by transformers' own code only."""
    model = transformers.AutoModelForImageTextToText.from_pretrained(path).eval()
    vp = transformers.AutoVideoProcessor.from_pretrained(path)
    for name, value in (bounds or {}).items():
        vp = copy.copy(vp)
        setattr(vp, name, value)
    tps = vp.temporal_patch_size
    out = []
    with torch.inference_mode():
        for video in videos:
            if isinstance(video, Path):
                frames, meta = load_video(str(video), backend="pyav",
                                          sample_indices_fn=lambda metadata, **_: vp.sample_frames(metadata, fps=fps))
            else:
                frames, meta = video, None
            inputs = vp(videos=[frames], do_sample_frames=False, return_tensors="pt")
            grid = inputs["video_grid_thw"]
            extras = {}
            if meta is not None:
                extras["second_per_grid_ts"] = tps / meta.sampled_fps
                extras["timestamps"] = transformers.Qwen3VLProcessor._calculate_timestamps(
                    None, list(meta.frames_indices), meta.fps, tps)
            out.append({"emb": features(model, inputs["pixel_values_videos"], grid),
                        "grid": tuple(grid[0].tolist()), "extras": extras})
    return out


def same_extras(ours: object, theirs: object) -> bool:
    """Equal structure, and equal numbers up to float rounding."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return ours.keys() == theirs.keys() and all(same_extras(ours[k], theirs[k]) for k in ours)
    if isinstance(ours, list) and isinstance(theirs, list):
        return len(ours) == len(theirs) and all(same_extras(a, b) for a, b in zip(ours, theirs))
    return isinstance(ours, float) and ours == pytest.approx(theirs, rel=1e-9)


def expected_extras(arch: str, refs: list[dict]) -> dict:
    key = {"qwen2_vl": None, "qwen2_5_vl": "second_per_grid_ts", "qwen3_vl": "timestamps"}[arch]
    return {key: [r["extras"][key] for r in refs]} if key else {}


@pytest.fixture(scope="module")
def video_files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("videos")
    files = []
    for i, (n, fps, w, h) in enumerate(VIDEOS):
        files.append(root / f"v{i}.mp4")
        files[-1].write_bytes(sample_video(n, fps, w, h, seed=i))
    return files


@pytest.mark.parametrize("arch", ARCHES)
async def test_video_files_equal_transformers(checkpoints: dict[str, str], video_files: list[Path],
                                              arch: str) -> None:
    path = checkpoints[arch]
    refs = await trio.to_thread.run_sync(reference, path, video_files)
    items = [f.read_bytes() for f in video_files]
    async with open_engine(model_path=path, dtype="float32") as engine:
        assert "video" in engine.model_info.modalities
        out = await engine.encode(items, "VIDEO")
        pre = await trio.to_thread.run_sync(engine.preprocessor.preprocess, items, "video")
    assert out.grid_thw == [r["grid"] for r in refs]
    assert out.token_counts == [r["emb"].shape[0] for r in refs]
    for i, r in enumerate(refs):
        assert out.item(i).shape == r["emb"].shape
        assert rel_err(out.item(i), r["emb"]) < 1e-4, i
    assert same_extras(pre.extras, expected_extras(arch, refs)), pre.extras


@pytest.mark.parametrize("arch", ARCHES)
async def test_frame_lists_are_used_as_given(checkpoints: dict[str, str], arch: str) -> None:
    path = checkpoints[arch]
    pil = [Image.fromarray(f) for f in generated_frames(6, 70, 50, seed=3)]
    array = generated_frames(5, 40, 60, seed=4)
    refs = await trio.to_thread.run_sync(reference, path, [pil, array])
    async with open_engine(model_path=path, dtype="float32") as engine:
        out = await engine.encode([pil, array], "video")
        pre = engine.preprocessor.preprocess([pil, array], "video")
    assert out.grid_thw == [r["grid"] for r in refs]
    for i, r in enumerate(refs):
        assert rel_err(out.item(i), r["emb"]) < 1e-4, i
    # Frames given as a list count as sampled at the configured fps (2): every frame kept.
    t = {"qwen2_vl": None, "qwen2_5_vl": [1.0, 1.0],
         "qwen3_vl": [[0.25, 1.25, 2.25], [0.25, 1.25, 2.0]]}[arch]
    key = {"qwen2_5_vl": "second_per_grid_ts", "qwen3_vl": "timestamps"}.get(arch)
    assert pre.extras == ({key: t} if key else {})


def test_sampling_knobs_are_the_processors(checkpoints: dict[str, str], video_files: list[Path]) -> None:
    """fps and frame bounds given to the preprocessor reach the model's own sampling rule."""
    path = checkpoints["qwen2_5_vl"]
    enc = load_encoder(path)
    pre = EncoderPreprocessor(enc.adapter, enc.processors, MediaLimits(),
                              video_fps=5.0, video_min_frames=2, video_max_frames=6)
    result = pre.preprocess([video_files[1].read_bytes()], "video")
    (ref,) = reference(path, [video_files[1]], fps=5.0, bounds={"min_frames": 2, "max_frames": 6})
    assert result.grid_thw == (ref["grid"],) and ref["grid"][0] == 3  # 6 frames, 2 per step
    assert same_extras(result.extras, {"second_per_grid_ts": [ref["extras"]["second_per_grid_ts"]]})
    with torch.inference_mode():
        emb = enc.adapter.forward(enc.module, enc.adapter.collate([result]))
    assert rel_err(emb, ref["emb"]) < 1e-4
    with pytest.raises(ValueError):
        EncoderPreprocessor(enc.adapter, enc.processors, MediaLimits(), video_fps=0)


ONE_FRAME = Image.fromarray(generated_frames(1)[0])


def mjpeg_mkv(sizes: list[int], codec_id: bytes = b"V_MJPEG") -> bytes:
    """An MJPEG Matroska file whose frames have the given square sizes (the header says the
    first's), under ``codec_id``."""
    import io
    from fractions import Fraction

    import av

    out = io.BytesIO()
    with av.open(out, "w", format="matroska") as container:
        stream = container.add_stream("mjpeg", rate=2)
        stream.width = stream.height = sizes[0]
        stream.pix_fmt, stream.time_base = "yuvj420p", Fraction(1, 2)
        for i, size in enumerate(sizes):
            jpeg = io.BytesIO()
            Image.new("RGB", (size, size), (i * 20, 0, 0)).save(jpeg, "JPEG", quality=50)
            packet = av.Packet(jpeg.getvalue())
            packet.stream, packet.pts, packet.dts, packet.time_base = stream, i, i, stream.time_base
            container.mux(packet)
    return out.getvalue().replace(b"V_MJPEG", codec_id)


ODD = [
    ("one-frame file", [sample_video(1)], RequestError, "item 0: video has 1 frame"),
    ("one-frame list", [[ONE_FRAME]], RequestError, "item 0: video has 1 frame"),
    ("corrupt bytes", [sample_video(4), b"\x00\x01garbage" * 50], RequestError, "item 1: video cannot be decoded"),
    ("truncated file", [sample_video(20)[:900]], RequestError, "item 0: video"),
    ("audio, not video", [sample_tone(0.5)], RequestError, "item 0: the file has no video stream"),
    ("frames of two sizes", [[ONE_FRAME, ONE_FRAME.resize((32, 32))]], RequestError,
     "item 0: video frames differ in size"),
    ("float frames", [np.zeros((4, 8, 8, 3), np.float32)], RequestError, "item 0: frame 0 must be .* uint8"),
    ("a PIL image", [ONE_FRAME], RequestError, "item 0: a video item must be a video file or a list of frames"),
    # the caps are checked on the header's size: a frame that grows past it is refused before it is kept
    ("frames that grow", [mjpeg_mkv([16, 16, 512, 512])], RequestError,
     "item 0: video frames change size mid-stream .frame 2 is 512x512, the stream 16x16."),
    ("an unknown codec", [mjpeg_mkv([16] * 4, b"V_ZZZZZ")], RequestError, "item 0: the video's codec"),
]


@pytest.mark.parametrize(("name", "items", "error", "message"), ODD, ids=[o[0] for o in ODD])
def test_odd_videos_are_request_errors(checkpoints: dict[str, str], name: str, items: list,
                                       error: type, message: str) -> None:
    enc = load_encoder(checkpoints["qwen3_vl"])
    pre = EncoderPreprocessor(enc.adapter, enc.processors, MediaLimits())
    with pytest.raises(error, match=message):
        pre.preprocess(items, "video")


LIMITS = [
    (MediaLimits(max_video_seconds=2.0), "item 0: video is 2.5 s long, over the cap of 2 s"),
    (MediaLimits(max_video_frames=20), "item 0: video has over 20 frames"),
    (MediaLimits(max_video_pixels=4 * 64 * 48 - 1), "item 0: 4 frames of 3072 pixels are over the cap"),
    (MediaLimits(max_image_pixels=1000), "item 0: video frames are 64x48, over the cap of 1000"),
]


@pytest.mark.parametrize(("limits", "message"), LIMITS)
def test_video_limits(checkpoints: dict[str, str], video_files: list[Path], limits: MediaLimits,
                      message: str) -> None:
    enc = load_encoder(checkpoints["qwen2_vl"])
    pre = EncoderPreprocessor(enc.adapter, enc.processors, limits)
    with pytest.raises(PayloadTooLargeError, match=message):
        pre.preprocess([video_files[0].read_bytes()], "video")
    with pytest.raises(PayloadTooLargeError, match="item 0: 7 frames given, over the cap of 6"):
        EncoderPreprocessor(enc.adapter, enc.processors, MediaLimits(), video_min_frames=2,
                            video_max_frames=6).preprocess([generated_frames(7)], "video")


def test_webm_without_a_frame_count_in_its_header(checkpoints: dict[str, str]) -> None:
    """VP9 in WebM has no frame count in the header: frames are counted, the result is sampled alike."""
    enc = load_encoder(checkpoints["qwen2_5_vl"])
    pre = EncoderPreprocessor(enc.adapter, enc.processors, MediaLimits())
    webm = pre.preprocess([sample_video(25, 10.0, codec="libvpx-vp9", container="webm")], "video")
    mp4 = pre.preprocess([sample_video(25, 10.0)], "video")
    assert webm.grid_thw == mp4.grid_thw and webm.extras == mp4.extras


async def test_videos_run_alone_and_images_still_batch(checkpoints: dict[str, str],
                                                       video_files: list[Path]) -> None:
    items = [f.read_bytes() for f in video_files]
    # Batching pinned on: the adaptive cap would start each image alone.
    async with open_engine(model_path=checkpoints["qwen2_vl"], coalesce_delay=0.05,
                           adaptive_batch=False) as engine:
        alone = [await engine.encode([item], "video") for item in items]
        before = engine.statistics().batches_run
        together: list = [None] * len(items)

        async def call(i: int) -> None:
            together[i] = await engine.encode([items[i]], "video")

        async with trio.open_nursery() as nursery:
            for i in range(len(items)):
                nursery.start_soon(call, i)
        assert engine.statistics().batches_run - before == len(items)
        # Images sent among the same videos still batch with each other.
        images = [png_bytes(56 + 28 * (i % 2), 56, seed=i) for i in range(4)]
        images_alone = [await engine.encode([image]) for image in images]
        before = engine.statistics().batches_run
        mixed: list = [None] * (len(items) + len(images))
        # Preprocessing ends when the CPU lets it (a loaded machine spreads it past
        # coalesce_delay): each request waits, once preprocessed, until all seven are, so
        # they reach the scheduler's queue together, videos and images interleaved.
        preprocess, waiting, all_preprocessed = engine.preprocess_step, [0], trio.Event()

        async def preprocess_then_wait_for_all(loaded: Any, modality: str, indices: Any) -> Any:
            pre = await preprocess(loaded, modality, indices)
            waiting[0] += 1
            if waiting[0] == len(mixed):
                all_preprocessed.set()
            with trio.fail_after(60):  # fewer calls than requests (a cache, say) must not hang
                await all_preprocessed.wait()
            return pre

        async def mixed_call(i: int) -> None:
            if i < len(items):
                mixed[i] = await engine.encode([items[i]], "video")
            else:
                mixed[i] = await engine.encode([images[i - len(items)]])

        engine.preprocess_step = preprocess_then_wait_for_all
        async with trio.open_nursery() as nursery:
            for i in range(len(mixed)):
                nursery.start_soon(mixed_call, i)
        engine.preprocess_step = preprocess
        # Each video is a batch of its own; the four images, queued among them, share one.
        assert engine.statistics().batches_run - before == len(items) + 1, "images did not batch"
    for mine, ref in zip(together + mixed, alone + alone + images_alone):
        assert mine.grid_thw == ref.grid_thw
        assert rel_err(mine.embedding, ref.embedding) < 1e-5
