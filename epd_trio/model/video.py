"""Video items: a file decoded with PyAV and sampled by the model's own rule, or frames as given.

A file (bytes from the media loader) is opened twice: first its packets are
counted without decoding (a container header's frame count can be missing or
wrong), the limits are checked and the frames to keep are chosen by the video
processor's own ``sample_frames`` with our fps and frame bounds; then it is
decoded up to the last chosen frame, keeping only the chosen ones. That is
transformers' own PyAV path (``video_utils.read_video_pyav``) with limits.

Frames given as a list (PIL images or ``[H, W, 3]`` uint8 arrays, or one
``[T, H, W, 3]`` array) are used exactly as given: no sampling. They count as
sampled at the configured fps, which is what the timestamps and
``second_per_grid_ts`` of the language side are derived from.

Every failure is a ``RequestError`` naming the item's index.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from epd_trio.errors import EPDError, PayloadTooLargeError
from epd_trio.model.media import MediaLimits, item_error

__all__ = ["FrameSampling", "VideoClip", "decode_video", "frames_clip", "model_sampler"]

Sampler = Callable[[Any], Sequence[int]]  # VideoMetadata -> source frame indices


@dataclass(frozen=True)
class FrameSampling:
    """How frames are taken from a video file (the video processor's knobs)."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768

    def __post_init__(self) -> None:
        if not (self.fps > 0 and 1 <= self.min_frames <= self.max_frames):
            raise ValueError(f"invalid frame sampling {self}")


@dataclass(frozen=True)
class VideoClip:
    """The frames given to the video processor, and where they came from."""

    frames: np.ndarray  # [T, H, W, 3] uint8 RGB
    fps: float  # the source's frame rate (frame lists: the sampling fps)
    frame_indices: tuple[int, ...]  # each frame's index in the source
    total_frames: int  # frames in the source

    @property
    def sampled_fps(self) -> float:
        """Frames per second of the clip, as ``VideoMetadata.sampled_fps``."""
        return len(self.frame_indices) / self.total_frames * self.fps

    def metadata(self) -> Any:
        from transformers.video_utils import VideoMetadata

        _, height, width, _ = self.frames.shape
        return VideoMetadata(
            total_num_frames=self.total_frames, fps=self.fps, width=width, height=height,
            duration=self.total_frames / self.fps, video_backend="pyav",
            frames_indices=list(self.frame_indices),
        )


def model_sampler(video_processor: Any, sampling: FrameSampling) -> Sampler:
    """The video processor's own ``sample_frames``, with our fps and frame bounds.

    A copy of the processor carries them (Qwen3-VL's rule reads the bounds from
    the processor, not from arguments); the loaded processor is not changed.
    """
    sampler = copy.copy(video_processor)
    sampler.fps = sampling.fps
    sampler.min_frames = sampling.min_frames
    sampler.max_frames = sampling.max_frames
    sampler.num_frames = None

    def sample(metadata: Any) -> list[int]:
        return [int(i) for i in sampler.sample_frames(metadata)]

    return sample


def decode_video(data: Any, index: int, limits: MediaLimits, sample: Sampler,
                 min_frames: int) -> VideoClip:
    """Decode a video file's bytes into the frames ``sample`` picks."""
    import av

    if not isinstance(data, bytes):
        raise item_error(index, f"a video item must be a video file or a list of frames, "
                                f"not {type(data).__name__}")
    try:
        fps, width, height, total = _probe(data, index, limits)
        if total < min_frames:
            raise item_error(index, f"video has {total} frame(s); at least {min_frames} are "
                                    f"needed (send a single frame as an image)")
        from transformers.video_utils import VideoMetadata

        metadata = VideoMetadata(total_num_frames=total, fps=fps, width=width, height=height,
                                 duration=total / fps, video_backend="pyav")
        indices = _checked_indices(sample(metadata), total, width * height, index, limits)
        frames = _decode_frames(data, indices, index, (width, height))
    except EPDError:
        raise
    except (av.FFmpegError, ValueError, IndexError, ZeroDivisionError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise item_error(index, f"video cannot be decoded ({reason})") from None
    return VideoClip(frames, fps, tuple(indices), total)


def _probe(data: bytes, index: int, limits: MediaLimits) -> tuple[float, int, int, int]:
    """Frame rate, size and frame count, checked against the limits; no decoding."""
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        if not container.streams.video:
            raise item_error(index, "the file has no video stream")
        stream = container.streams.video[0]
        if stream.codec_context is None:  # a codec this FFmpeg build does not know
            raise item_error(index, "the video's codec cannot be decoded")
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        if not rate or rate <= 0:
            raise item_error(index, "the video's frame rate is unknown")
        fps = float(rate)
        width, height = stream.codec_context.width, stream.codec_context.height
        _check_frame_size(width, height, index, limits)
        if container.duration is not None:
            _check_seconds(container.duration / av.time_base, index, limits)
        total = 0
        for packet in container.demux(stream):
            if packet.size:
                total += 1
                if total > limits.max_video_frames:
                    raise PayloadTooLargeError(
                        f"item {index}: video has over {limits.max_video_frames} frames")
    _check_seconds(total / fps, index, limits)
    return fps, width, height, total


def _checked_indices(indices: Sequence[int], total: int, frame_pixels: int, index: int,
                     limits: MediaLimits) -> list[int]:
    indices = [int(i) for i in indices]
    if not indices or min(indices) < 0 or max(indices) >= total:
        raise item_error(index, f"frame sampling chose no usable frames of {total}")
    _check_total_pixels(len(indices), frame_pixels, index, limits)
    return indices


def _decode_frames(data: bytes, indices: list[int], index: int, size: tuple[int, int]) -> np.ndarray:
    """The chosen frames, each checked to have the probed ``size`` before it is kept: the caps
    were checked against that size, and a stream may grow its frames after the first."""
    import av

    wanted, last = set(indices), max(indices)
    kept: dict[int, np.ndarray] = {}
    with av.open(io.BytesIO(data), mode="r") as container:
        for i, frame in enumerate(container.decode(video=0)):
            if (frame.width, frame.height) != size:
                raise item_error(index, f"video frames change size mid-stream (frame {i} is "
                                        f"{frame.width}x{frame.height}, the stream {size[0]}x{size[1]})")
            if i in wanted:
                kept[i] = frame.to_ndarray(format="rgb24")
            if i >= last:
                break
    if len(kept) < len(wanted):
        raise item_error(index, f"video is truncated: frame {max(wanted - kept.keys())} of "
                                f"{last + 1} cannot be decoded")
    return np.stack([kept[i] for i in indices])


def frames_clip(frames: Any, index: int, limits: MediaLimits, sampling: FrameSampling,
                min_frames: int) -> VideoClip:
    """Frames given by the caller, used as they are (checked, never sampled)."""
    arrays = [_frame_array(frame, index, k) for k, frame in enumerate(frames)]
    count = len(arrays)
    if count < min_frames:
        raise item_error(index, f"video has {count} frame(s); at least {min_frames} are needed "
                                f"(send a single frame as an image)")
    if count > sampling.max_frames:
        raise PayloadTooLargeError(
            f"item {index}: {count} frames given, over the cap of {sampling.max_frames}")
    shapes = {a.shape for a in arrays}
    if len(shapes) > 1:
        raise item_error(index, f"video frames differ in size ({sorted(shapes)})")
    height, width, _ = arrays[0].shape
    _check_frame_size(width, height, index, limits)
    _check_total_pixels(count, width * height, index, limits)
    return VideoClip(np.stack(arrays), sampling.fps, tuple(range(count)), count)


def _frame_array(frame: Any, index: int, k: int) -> np.ndarray:
    if isinstance(frame, np.ndarray):
        if frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[-1] != 3:
            raise item_error(index, f"frame {k} must be a [height, width, 3] uint8 RGB array, "
                                    f"not {frame.dtype} {list(frame.shape)}")
        return frame
    image = frame if frame.mode == "RGB" else frame.convert("RGB")
    return np.asarray(image)


def _check_frame_size(width: int, height: int, index: int, limits: MediaLimits) -> None:
    if width <= 0 or height <= 0:
        raise item_error(index, f"video frames are empty ({width}x{height})")
    if width * height > limits.max_image_pixels:
        raise PayloadTooLargeError(
            f"item {index}: video frames are {width}x{height}, over the cap of "
            f"{limits.max_image_pixels} pixels")


def _check_total_pixels(frames: int, frame_pixels: int, index: int, limits: MediaLimits) -> None:
    if frames * frame_pixels > limits.max_video_pixels:
        raise PayloadTooLargeError(
            f"item {index}: {frames} frames of {frame_pixels} pixels are over the cap of "
            f"{limits.max_video_pixels} pixels per video")


def _check_seconds(seconds: float, index: int, limits: MediaLimits) -> None:
    if seconds > limits.max_video_seconds:
        raise PayloadTooLargeError(
            f"item {index}: video is {seconds:.1f} s long, over the cap of "
            f"{limits.max_video_seconds:g} s")
