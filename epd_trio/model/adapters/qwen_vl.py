"""Qwen-VL vision towers: Qwen2-VL, Qwen2.5-VL and Qwen3-VL (images and videos).

All three take the patches of every image or video of a batch concatenated,
with one ``grid_thw`` row per item, and merge ``spatial_merge_size²`` patches
into one token; images and videos go through the same tower, exactly as the
models' own ``get_image_features`` / ``get_video_features`` do.

Qwen3-VL also returns *deepstack* features: one extra ``[tokens,
out_hidden_size]`` tensor per entry of ``deepstack_visual_indexes``, which its
language model adds to the hidden states of its first decoder layers. We
deliver them in the same rows, concatenated along the embedding dimension:
``row = [embedding | deepstack_0 | deepstack_1 | ...]``, so one tensor and one
transfer carry everything, and items/parts split by rows exactly as for the
other families. The language side splits a row back with
``embedding.split(out_hidden_size, dim=-1)``: the first block replaces the
placeholder tokens' input embeddings, block ``k + 1`` is deepstack level ``k``
(transformers' ``deepstack_visual_embeds[k]``). ``embedding_layout`` names the
blocks and ``/model_info`` reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from epd_trio.model.adapters.base import GridTHW, ModelAdapter, PreprocessResult

if TYPE_CHECKING:
    import torch
    from torch import nn

    from epd_trio.model.video import VideoClip

__all__ = ["Qwen25VLAdapter", "Qwen2VLAdapter", "Qwen3VLAdapter"]


class _QwenVisionAdapter(ModelAdapter):
    """Patches of all items concatenated, one grid_thw row per item."""

    modalities = frozenset({"image", "video"})
    weight_layouts = ({"visual.": ""}, {"model.visual.": ""})
    processor_classes: ClassVar[dict[str, str]] = {
        "image": "AutoImageProcessor", "video": "AutoVideoProcessor",
    }
    _keys: ClassVar[dict[str, tuple[str, str]]] = {
        "image": ("pixel_values", "image_grid_thw"),
        "video": ("pixel_values_videos", "video_grid_thw"),
    }

    @property
    def merge_unit(self) -> int:
        return int(self.config.vision_config.spatial_merge_size) ** 2

    @property
    def temporal_patch_size(self) -> int:
        return int(self.config.vision_config.temporal_patch_size)

    def token_counts(self, grid_thw: Sequence[GridTHW]) -> tuple[int, ...]:
        return tuple(t * h * w // self.merge_unit for t, h, w in grid_thw)

    def item_result(self, processed: dict[str, Any], modality: str,
                    extras: dict[str, list[Any]] | None = None) -> PreprocessResult:
        values_key, grid_key = self._keys[modality]
        grid: tuple[GridTHW, ...] = tuple(
            (int(t), int(h), int(w)) for t, h, w in processed[grid_key].tolist()
        )
        return PreprocessResult(
            modality=modality,
            inputs={"pixel_values": processed[values_key], "grid_thw": processed[grid_key]},
            grid_thw=grid,
            token_counts=self.token_counts(grid),
            extras=dict(extras or {}),
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
        # Exactly what the model's get_image_features / get_video_features do, minus the split.
        dtype: torch.dtype = module.dtype  # type: ignore[assignment]  # transformers' dtype property
        pixel_values = inputs["pixel_values"].type(dtype)
        return module(pixel_values, grid_thw=inputs["grid_thw"]).pooler_output


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


class Qwen25VLAdapter(_QwenVisionAdapter):
    family = "qwen2_5_vl"

    def build_encoder(self, dtype: torch.dtype) -> nn.Module:
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m

        cls = m.Qwen2_5_VisionTransformerPretrainedModel
        return cls._from_config(self.config.vision_config, dtype=dtype)

    @property
    def embedding_dim(self) -> int:
        return int(self.config.vision_config.out_hidden_size)

    def video_extras(self, clip: VideoClip) -> dict[str, list[Any]]:
        # As Qwen2_5_VLProcessor: seconds per temporal grid step, for the mRoPE time axis.
        return {"second_per_grid_ts": [self.temporal_patch_size / clip.sampled_fps]}


class Qwen3VLAdapter(_QwenVisionAdapter):
    """Qwen3-VL: the merger's output and the deepstack features, side by side."""

    family = "qwen3_vl"
    # Qwen3-VL was published with the new names; the legacy ones are tried second.
    weight_layouts = ({"model.visual.": ""}, {"visual.": ""})

    def build_encoder(self, dtype: torch.dtype) -> nn.Module:
        from transformers.models.qwen3_vl import modeling_qwen3_vl as m

        return m.Qwen3VLVisionModel._from_config(self.config.vision_config, dtype=dtype)

    @property
    def deepstack_levels(self) -> int:
        return len(self.config.vision_config.deepstack_visual_indexes)

    @property
    def block_dim(self) -> int:
        return int(self.config.vision_config.out_hidden_size)

    @property
    def embedding_dim(self) -> int:
        return self.block_dim * (1 + self.deepstack_levels)

    @property
    def embedding_layout(self) -> tuple[tuple[str, int], ...]:
        deepstack = tuple((f"deepstack_{k}", self.block_dim) for k in range(self.deepstack_levels))
        return (("embedding", self.block_dim), *deepstack)

    def video_extras(self, clip: VideoClip) -> dict[str, list[Any]]:
        # As Qwen3VLProcessor._calculate_timestamps: the mean time of each temporal patch.
        return {"timestamps": [frame_timestamps(clip.frame_indices, clip.fps, self.temporal_patch_size)]}

    def forward(self, module: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        import torch

        dtype: torch.dtype = module.dtype  # type: ignore[assignment]  # transformers' dtype property
        pixel_values = inputs["pixel_values"].type(dtype)
        out = module(pixel_values, grid_thw=inputs["grid_thw"], return_dict=True)
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)


def frame_timestamps(indices: Sequence[int], fps: float, temporal_patch_size: int) -> list[float]:
    """Seconds at the middle of each temporal patch (the last frame repeats to fill one)."""
    indices = list(indices)
    if pad := -len(indices) % temporal_patch_size:
        indices.extend([indices[-1]] * pad)
    seconds = [i / fps for i in indices]
    return [(seconds[i] + seconds[i + temporal_patch_size - 1]) / 2
            for i in range(0, len(seconds), temporal_patch_size)]
