"""CPU preprocessing: decoded media → the model's own processor → model inputs.

Runs in a worker thread (blocking), before a request joins a batch, so the CPU
work for the next batch overlaps the current forward. The processor is the one
``AutoImageProcessor.from_pretrained(model_dir)`` picks, so inputs equal what
transformers' own pipeline produces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from epd_trio.errors import EPDError, RequestError
from epd_trio.model.adapters import ModelAdapter, PreprocessResult
from epd_trio.model.media import MediaLimits, decode_image

__all__ = ["EncoderPreprocessor"]


class EncoderPreprocessor:
    """Turns a request's loaded items into one ``PreprocessResult``."""

    def __init__(self, adapter: ModelAdapter, processor: Any, limits: MediaLimits) -> None:
        self.adapter = adapter
        self.processor = processor
        self.limits = limits

    def preprocess(self, items: Sequence[Any], modality: str) -> PreprocessResult:
        """Blocking; call through ``trio.to_thread.run_sync``."""
        self.adapter.check_modality(modality)
        # One processor call per item: identical output to a batched call
        # (Qwen processors resize each image on its own), and an error names
        # the item that caused it.
        parts = [self._one(i, item, modality) for i, item in enumerate(items)]
        return self._join(parts, modality)

    def _one(self, index: int, item: Any, modality: str) -> PreprocessResult:
        image = decode_image(item, index, self.limits)
        try:
            processed = self.processor(images=[image], return_tensors="pt")
        except EPDError:
            raise
        except (ValueError, RuntimeError, TypeError, OSError) as exc:
            raise RequestError(f"item {index}: the image processor refused it ({exc})") from None
        return self.adapter.item_result(dict(processed), modality)

    def _join(self, parts: list[PreprocessResult], modality: str) -> PreprocessResult:
        if len(parts) == 1:
            return parts[0]
        return PreprocessResult(
            modality=modality,
            inputs=self.adapter.collate(parts),
            grid_thw=tuple(g for p in parts for g in p.grid_thw),
            token_counts=tuple(c for p in parts for c in p.token_counts),
        )
