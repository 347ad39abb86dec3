"""CPU preprocessing: decoded media → the model's own processors → model inputs.

Runs in a worker thread (blocking), before a request joins a batch, so the CPU
work for the next batch overlaps the current forward. The processors are the
checkpoint's own (``AutoImageProcessor``, ``AutoVideoProcessor``,
``AutoFeatureExtractor``), so inputs equal what transformers' own pipeline
produces. One code path per modality:

- image: decode (PIL) → image processor;
- video: decode + sample (PyAV, the processor's ``sample_frames``) or frames as
  given → video processor (no second sampling) → per-item extras from the adapter;
- audio: decode, mono, resample → feature extractor (padded to the model's
  window, as ``Qwen2AudioProcessor`` does).

Every item is processed on its own (Qwen processors treat items independently,
so the output equals a batched call) and an error names the item that caused it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from epd_trio.errors import EPDError, PayloadTooLargeError, RequestError
from epd_trio.model.adapters import ModelAdapter, PreprocessResult
from epd_trio.model.audio import decode_audio
from epd_trio.model.media import MediaLimits, decode_image, image_pixels, is_frame_list, item_error
from epd_trio.model.video import FrameSampling, decode_video, frames_clip, model_sampler

__all__ = ["EncoderPreprocessor"]


class EncoderPreprocessor:
    """Turns a request's loaded items into one ``PreprocessResult``.

    ``processors`` maps each modality to the checkpoint's processor for it
    (``LoadedEncoder.processors``). ``video_fps``, ``video_min_frames`` and
    ``video_max_frames`` choose the frames taken from a video file (and cap a
    list of frames); the other limits are in ``limits``.
    """

    def __init__(self, adapter: ModelAdapter, processors: Mapping[str, Any], limits: MediaLimits,
                 *, video_fps: float = 2.0, video_min_frames: int = 4,
                 video_max_frames: int = 768) -> None:
        self.adapter = adapter
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
        """Blocking; call through ``trio.to_thread.run_sync``.

        ``indices`` are the items' places in their request when ``items`` is a
        subset of it (the embedding cache's misses), so that errors name them.
        """
        self.adapter.check_modality(modality)
        if modality == "image":
            self._check_request_pixels(items)
        step = self._steps[modality]
        places = range(len(items)) if indices is None else indices
        return self._join([step(i, item) for i, item in zip(places, items, strict=True)], modality)

    def _check_request_pixels(self, items: Sequence[Any]) -> None:
        """All of a request's images together, from their headers, before any is decoded."""
        total = sum(image_pixels(item) for item in items)
        if total > self.limits.max_request_pixels:
            raise PayloadTooLargeError(f"the request's images have {total} pixels together, over the "
                                       f"cap of {self.limits.max_request_pixels}")

    def _image(self, index: int, item: Any) -> PreprocessResult:
        image = decode_image(item, index, self.limits)
        processed = _call(index, "image processor", self.processors["image"],
                          images=[image], return_tensors="pt")
        return self.adapter.item_result(processed, "image")

    def _video(self, index: int, item: Any) -> PreprocessResult:
        processor = self.processors["video"]
        min_frames = int(getattr(processor, "temporal_patch_size", None) or 1)
        if is_frame_list(item):
            clip = frames_clip(item, index, self.limits, self.sampling, min_frames)
        else:
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
        raise RequestError(f"item {index}: the {what} refused it ({exc})") from None
