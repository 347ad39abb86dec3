"""Model adapters: what each model family's encoder is, and how to run it.

An adapter knows which checkpoint weights form the encoder (never the language
model), how to build that module, how to turn processor output into the
arguments of its forward, and how many tokens each item becomes. It holds no
trio and no clock; the loader and the worker thread call it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from epd_trio.errors import ModelLoadError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "ADAPTERS",
    "ModelAdapter",
    "PreprocessResult",
    "Qwen2VLAdapter",
    "Qwen25VLAdapter",
    "adapter_for",
]

GridTHW = tuple[int, int, int]


@dataclass(frozen=True)
class PreprocessResult:
    """Processor output for one request, computed once and reused downstream.

    ``inputs`` holds the model-ready tensors of all the request's items,
    concatenated the way the model's own forward takes them.
    """

    modality: str
    inputs: dict[str, torch.Tensor]
    grid_thw: tuple[GridTHW, ...]
    token_counts: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(self.token_counts)


class ModelAdapter(ABC):
    """One model family's encoder (vision tower + merger, or audio tower + projector)."""

    family: ClassVar[str]
    modalities: ClassVar[frozenset[str]]
    # Checkpoint key prefixes of the encoder, tried in order; the first that
    # matches any key wins. Hub checkpoints and transformers' save_pretrained
    # both write the legacy names.
    weight_prefixes: ClassVar[tuple[str, ...]]

    def __init__(self, config: Any) -> None:
        self.config = config

    @abstractmethod
    def build_encoder(self, dtype: torch.dtype) -> nn.Module:
        """The encoder module with uninitialised weights, to be loaded."""

    @property
    @abstractmethod
    def embedding_dim(self) -> int:
        """Width of one output token (the language model's hidden size)."""

    @abstractmethod
    def item_result(self, processed: dict[str, Any], modality: str) -> PreprocessResult:
        """Wrap the processor's output for one or more items of one request."""

    @abstractmethod
    def collate(self, results: Sequence[PreprocessResult]) -> dict[str, torch.Tensor]:
        """Concatenate several requests' inputs into one forward's arguments."""

    @abstractmethod
    def forward(self, module: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Run the encoder: ``[sum(tokens), embedding_dim]`` in input order."""

    def check_modality(self, modality: str) -> None:
        if modality not in self.modalities:
            from epd_trio.errors import RequestError

            raise RequestError(
                f"model family {self.family!r} does not encode {modality!r}; "
                f"it encodes {sorted(self.modalities)}"
            )


class _QwenVisionAdapter(ModelAdapter):
    """Qwen-VL vision towers: patches of all images concatenated, split by grid_thw."""

    modalities = frozenset({"image"})
    weight_prefixes = ("visual.", "model.visual.")
    _keys: ClassVar[dict[str, tuple[str, str]]] = {
        "image": ("pixel_values", "image_grid_thw"),
    }

    @property
    def merge_unit(self) -> int:
        return int(self.config.vision_config.spatial_merge_size) ** 2

    def token_counts(self, grid_thw: Sequence[GridTHW]) -> tuple[int, ...]:
        return tuple(t * h * w // self.merge_unit for t, h, w in grid_thw)

    def item_result(self, processed: dict[str, Any], modality: str) -> PreprocessResult:
        values_key, grid_key = self._keys[modality]
        grid = tuple(tuple(int(x) for x in row) for row in processed[grid_key].tolist())
        return PreprocessResult(
            modality=modality,
            inputs={"pixel_values": processed[values_key], "grid_thw": processed[grid_key]},
            grid_thw=grid,  # type: ignore[arg-type]
            token_counts=self.token_counts(grid),  # type: ignore[arg-type]
        )

    def collate(self, results: Sequence[PreprocessResult]) -> dict[str, torch.Tensor]:
        import torch

        if len(results) == 1:
            return dict(results[0].inputs)
        return {
            "pixel_values": torch.cat([r.inputs["pixel_values"] for r in results]),
            "grid_thw": torch.cat([r.inputs["grid_thw"] for r in results]),
        }

    def forward(self, module: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        # Exactly what the model's get_image_features does, minus the split.
        pixel_values = inputs["pixel_values"].type(module.dtype)
        return module(pixel_values, grid_thw=inputs["grid_thw"]).pooler_output


class Qwen25VLAdapter(_QwenVisionAdapter):
    family = "qwen2_5_vl"

    def build_encoder(self, dtype: torch.dtype) -> nn.Module:
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m

        cls = m.Qwen2_5_VisionTransformerPretrainedModel
        return cls._from_config(self.config.vision_config, dtype=dtype)

    @property
    def embedding_dim(self) -> int:
        return int(self.config.vision_config.out_hidden_size)


class Qwen2VLAdapter(_QwenVisionAdapter):
    family = "qwen2_vl"

    def build_encoder(self, dtype: torch.dtype) -> nn.Module:
        from transformers.models.qwen2_vl import modeling_qwen2_vl as m

        cls = m.Qwen2VisionTransformerPretrainedModel
        return cls._from_config(self.config.vision_config, dtype=dtype)

    @property
    def embedding_dim(self) -> int:
        # Qwen2-VL's merger projects to vision_config.hidden_size (the LM width).
        return int(self.config.vision_config.hidden_size)


ADAPTERS: dict[str, type[ModelAdapter]] = {
    cls.family: cls for cls in (Qwen2VLAdapter, Qwen25VLAdapter)
}


def adapter_for(config: Any) -> ModelAdapter:
    """The adapter for a checkpoint's config; unknown families name the supported ones."""
    family = getattr(config, "model_type", None)
    try:
        cls = ADAPTERS[family]  # type: ignore[index]
    except KeyError:
        raise ModelLoadError(
            f"unsupported model family {family!r}; supported: {', '.join(sorted(ADAPTERS))}"
        ) from None
    return cls(config)
