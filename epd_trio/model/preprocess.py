"""CPU preprocessing: decoded media → the model's own processors → model inputs.

Runs in a worker thread (blocking), before a request joins a batch, so the CPU
work for the next batch overlaps the current forward. The processors are the
checkpoint's own (``AutoImageProcessor``, ``AutoVideoProcessor``,
``AutoFeatureExtractor``), so inputs equal what transformers' own pipeline
produces. One code path per modality:

- image: decode (torchvision for 8-bit JPEG, same pixels as PIL; PIL for
  the rest: ``image_decode.py``) → image processor, run on ``device`` when
  one is given (the fast processor's ``device=``; on CUDA the JPEG is decoded
  there too, on this thread's own stream, so it overlaps the forward);
- video: decode + sample (PyAV, the processor's ``sample_frames``) or frames as
  given → video processor (no second sampling) → per-item extras from the adapter;
- audio: decode, mono, resample → feature extractor (padded to the model's
  window, as ``Qwen2AudioProcessor`` does).

Every item is processed on its own (Qwen processors treat items independently,
so the output equals a batched call) and an error names the item that caused it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from epd_trio.errors import EPDError, ModelLoadError, PayloadTooLargeError, RequestError
from epd_trio.model.adapters import ModelAdapter, PreprocessResult
from epd_trio.model.audio import decode_audio
from epd_trio.model.image_decode import decode_image_tensor
from epd_trio.model.media import MediaLimits, decode_image, decoder_message, image_pixels, is_frame_list, item_error
from epd_trio.model.video import FrameSampling, decode_video, frames_clip, model_sampler
from epd_trio.scheduling.failures import raise_if_device_failure

__all__ = ["DECODERS", "EncoderPreprocessor", "preprocess_device"]

DECODERS = ("tensor", "pil")


class EncoderPreprocessor:
    """Turns a request's loaded items into one ``PreprocessResult``.

    ``processors`` maps each modality to the checkpoint's processor for it
    (``LoadedEncoder.processors``). ``video_fps``, ``video_min_frames`` and
    ``video_max_frames`` choose the frames taken from a video file (and cap a
    list of frames); the other limits are in ``limits``.

    ``decoder``: ``"tensor"`` (torchvision where it equals PIL, the default) or
    ``"pil"`` (PIL always; the reference the tests compare with). ``device``:
    where the image processor runs (``None``: the processor's own default, the
    CPU; ``"cpu"`` or ``"cuda:0"``: passed as its ``device=``).
    """

    def __init__(self, adapter: ModelAdapter, processors: Mapping[str, Any], limits: MediaLimits,
                 *, video_fps: float = 2.0, video_min_frames: int = 4,
                 video_max_frames: int = 768, decoder: str = "tensor",
                 device: str | None = None) -> None:
        if decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {DECODERS}, got {decoder!r}")
        self.adapter = adapter
        self.decoder = decoder
        self.device = device
        self._streams = _ThreadStreams(device)
        self.processors = dict(processors)
        self.limits = limits
        self.sampling = FrameSampling(video_fps, video_min_frames, video_max_frames)
        video = self.processors.get("video")
        self._sampler = model_sampler(video, self.sampling) if video is not None else None
        self._steps: dict[str, Callable[[int, Any], PreprocessResult]] = {
            "image": self._image, "video": self._video, "audio": self._audio,
        }

    def preprocess(self, items: Sequence[Any], modality: str,
                   indices: Sequence[int] | None = None) -> PreprocessResult:
        """Blocking; call it on a worker thread (the engine's preprocessing lane) or in a child process.

        ``indices`` are the items' places in their request when ``items`` is a
        subset of it (the embedding cache's misses), so that errors name them.
        """
        self.adapter.check_modality(modality)
        if modality == "image":
            self._check_request_pixels(items)
        step = self._steps[modality]
        places = range(len(items)) if indices is None else indices
        # One stream scope for the items and their join: on CUDA the join's cat
        # reads device tensors, so it must run on this thread's stream, before
        # the one synchronize that hands the result on.
        with self._streams.scope():
            parts = [step(i, item) for i, item in zip(places, items, strict=True)]
            return self._join(parts, modality)

    def _check_request_pixels(self, items: Sequence[Any]) -> None:
        """All of a request's images together, from their headers, before any is decoded."""
        total = sum(image_pixels(item) for item in items)
        if total > self.limits.max_request_pixels:
            raise PayloadTooLargeError(f"the request's images have {total} pixels together, over the "
                                       f"cap of {self.limits.max_request_pixels}")

    def _image(self, index: int, item: Any) -> PreprocessResult:
        on_device = {} if self.device is None else {"device": self.device}
        if self.decoder == "pil":
            image = decode_image(item, index, self.limits)
        else:
            image = decode_image_tensor(item, index, self.limits, self._streams.decode_device)
        processed = _call(index, "image processor", self.processors["image"],
                          images=[image], return_tensors="pt", **on_device)
        return self.adapter.item_result(processed, "image")

    def _video(self, index: int, item: Any) -> PreprocessResult:
        processor = self.processors["video"]
        min_frames = int(getattr(processor, "temporal_patch_size", None) or 1)
        if is_frame_list(item):
            clip = frames_clip(item, index, self.limits, self.sampling, min_frames)
        else:
            assert self._sampler is not None  # made with the video processor
            clip = decode_video(item, index, self.limits, self._sampler, min_frames)
        processed = _call(index, "video processor", processor, videos=[clip.frames],
                          video_metadata=[clip.metadata()], do_sample_frames=False,
                          return_tensors="pt")
        return self.adapter.item_result(processed, "video", self.adapter.video_extras(clip))

    def _audio(self, index: int, item: Any) -> PreprocessResult:
        extractor = self.processors["audio"]
        rate = int(extractor.sampling_rate)
        wave = decode_audio(item, index, self.limits, rate)
        window = int(extractor.n_samples)
        if wave.shape[0] > window:
            raise item_error(index, f"audio is {wave.shape[0] / rate:.2f} s long, over the "
                                    f"model's window of {window / rate:g} s")
        processed = _call(index, "feature extractor", extractor, wave, sampling_rate=rate,
                          padding="max_length", return_attention_mask=True, return_tensors="pt")
        result = self.adapter.item_result(processed, "audio")
        if min(result.token_counts) < 1:
            raise item_error(index, f"audio is too short ({wave.shape[0] / rate:.3f} s): "
                                    f"the model makes no token of it")
        return result

    def _join(self, parts: list[PreprocessResult], modality: str) -> PreprocessResult:
        if len(parts) == 1:
            return parts[0]
        return PreprocessResult(
            modality=modality,
            inputs=self.adapter.collate(parts),
            grid_thw=tuple(g for p in parts for g in p.grid_thw),
            token_counts=tuple(c for p in parts for c in p.token_counts),
            extras={key: [v for p in parts for v in p.extras[key]] for key in parts[0].extras},
        )


def _call(index: int, what: str, processor: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """A processor call whose refusal becomes a ``RequestError`` naming the item."""
    try:
        return dict(processor(*args, **kwargs))
    except EPDError:
        raise
    except (ValueError, RuntimeError, TypeError, OSError, IndexError) as exc:
        # on --preprocess-device cuda the processor runs there: its OOM is not the item's fault
        raise_if_device_failure(exc, f"item {index}", str(kwargs.get("device") or "cpu"))
        raise RequestError(f"item {index}: the {what} refused it ({decoder_message(exc)})") from None


def preprocess_device(device: str | None) -> Any:
    """``device`` as a ``torch.device`` (None stays None); refused when torch cannot use it."""
    if device is None:
        return None
    import torch

    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ModelLoadError(f"preprocess device {device!r} is not a torch device ({exc})") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"preprocess device {device!r}: torch sees no CUDA device here")
    return resolved


class _ThreadStreams:
    """One CUDA stream per preprocessing thread, so device preprocessing overlaps the forward.

    The work is synchronized on its stream before the result is handed on: the
    forward (on the worker's own stream) never reads a tensor still being
    written, and only this thread waits. Off CUDA it does nothing.
    """

    def __init__(self, device: str | None) -> None:
        self._device = preprocess_device(device)
        self._cuda = self._device is not None and self._device.type == "cuda"
        self._local = threading.local()

    @property
    def decode_device(self) -> str:
        """Where a JPEG is decoded: the device for CUDA (nvJPEG), else the CPU."""
        return str(self._device) if self._cuda else "cpu"

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        if not self._cuda:
            yield
            return
        import torch

        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self._device)
        with torch.cuda.device(self._device), torch.cuda.stream(stream):
            yield
        stream.synchronize()
