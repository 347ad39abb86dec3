"""Qwen2-Audio: the Whisper-style audio tower and the projector, nothing else.

Each item is a log-mel spectrogram padded to the model's window (30 s for the
published checkpoints) with a mask of its real frames, exactly as
``Qwen2AudioProcessor`` makes it. The forward is the audio branch of
``Qwen2AudioModel.forward``: tower under a bidirectional mask of each item's
real length, projector, then only each item's first ``output_length`` rows.
Items are independent, so audio requests batch freely.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import TYPE_CHECKING, Any, ClassVar

from epd_trio.model.adapters.base import ModelAdapter, PreprocessResult

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["Qwen2AudioAdapter", "audio_token_count"]


def audio_token_count(mel_frames: int) -> int:
    """Tokens for ``mel_frames`` real frames: the conv stride, then the 2x pooler.

    The formula of ``Qwen2AudioProcessor`` and of the tower's
    ``_get_feat_extract_output_lengths``.
    """
    after_conv = (mel_frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


@cache
def _audio_encoder_class() -> type:
    from torch import nn

    class Qwen2AudioEncoderModule(nn.Module):
        """The two parts of Qwen2-Audio that encode, under the checkpoint's names."""

        def __init__(self, audio_tower: nn.Module, multi_modal_projector: nn.Module) -> None:
            super().__init__()
            self.audio_tower = audio_tower
            self.multi_modal_projector = multi_modal_projector

        @property
        def dtype(self) -> Any:
            return self.audio_tower.dtype

    return Qwen2AudioEncoderModule


class Qwen2AudioAdapter(ModelAdapter):
    family = "qwen2_audio"
    modalities = frozenset({"audio"})
    weight_layouts = (
        {"audio_tower.": "audio_tower.", "multi_modal_projector.": "multi_modal_projector."},
        {"model.audio_tower.": "audio_tower.",
         "model.multi_modal_projector.": "multi_modal_projector."},
    )
    processor_classes: ClassVar[dict[str, str]] = {"audio": "AutoFeatureExtractor"}

    def build_encoder(self, dtype: torch.dtype) -> nn.Module:
        from transformers.models.qwen2_audio import modeling_qwen2_audio as m

        tower = m.Qwen2AudioEncoder._from_config(self.config.audio_config, dtype=dtype)
        projector = m.Qwen2AudioMultiModalProjector(self.config).to(dtype)
        return _audio_encoder_class()(tower, projector)

    @property
    def embedding_dim(self) -> int:
        return int(self.config.text_config.hidden_size)

    def item_result(self, processed: dict[str, Any], modality: str,
                    extras: dict[str, list[Any]] | None = None) -> PreprocessResult:
        mask = processed["attention_mask"]
        mel_frames = [int(n) for n in mask.sum(-1).tolist()]
        counts = tuple(audio_token_count(n) for n in mel_frames)
        # Each item's real mel-frame length (its input length, not its tokens):
        # what SGLang's receiver takes as the audio grid (audio_feature_lens).
        return PreprocessResult(
            modality=modality,
            inputs={"input_features": processed["input_features"], "feature_attention_mask": mask},
            grid_thw=(),
            token_counts=counts,
            extras={**(extras or {}), "mel_frames": mel_frames},
        )

    def collate(self, results: Sequence[PreprocessResult]) -> dict[str, torch.Tensor]:
        import torch

        if len(results) == 1:
            return dict(results[0].inputs)
        return {key: torch.cat([r.inputs[key] for r in results])
                for key in ("input_features", "feature_attention_mask")}

    def forward(self, module: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        # The audio branch of Qwen2AudioModel.forward, step by step.
        import torch
        from transformers.masking_utils import create_bidirectional_mask

        features, frame_mask = inputs["input_features"], inputs["feature_attention_mask"]
        tower: Any = module.audio_tower  # transformers' Qwen2AudioEncoder: its own methods and config
        feat_lengths, output_lengths = tower._get_feat_extract_output_lengths(frame_mask.sum(-1))
        batch, _, max_mel_frames = features.shape
        max_len = (max_mel_frames - 2) // 2 + 1
        positions = torch.arange(max_len, dtype=feat_lengths.dtype, device=feat_lengths.device)
        mask_2d = (positions[None, :] < feat_lengths[:, None]).to(torch.long)
        dtype: torch.dtype = module.dtype  # type: ignore[assignment]  # the module's dtype property
        dummy = torch.zeros((batch, max_len, 1), dtype=dtype, device=features.device)
        attention_mask = create_bidirectional_mask(
            config=tower.config, inputs_embeds=dummy, attention_mask=mask_2d
        )
        hidden = tower(features, attention_mask=attention_mask).last_hidden_state
        projector: nn.Module = module.multi_modal_projector  # type: ignore[assignment]  # set in __init__
        audio = projector(hidden)
        keep = torch.arange(audio.shape[1], device=audio.device)[None, :] < output_lengths[:, None]
        return audio[keep]
