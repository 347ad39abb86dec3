"""What every model family's adapter provides, and what preprocessing hands on.

An adapter knows which checkpoint weights form the encoder (never the language
model), how to build that module, which Hugging Face processor turns each
modality into model inputs, how many tokens each item becomes, and what one
output row holds. It holds no trio and no clock; the loader, the preprocessing
thread and the worker thread call it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from epd_trio.errors import RequestError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from epd_trio.model.video import VideoClip

__all__ = ["GridTHW", "ModelAdapter", "PreprocessResult"]

GridTHW = tuple[int, int, int]


@dataclass(frozen=True)
class PreprocessResult:
    """Processor output for one request, computed once and reused downstream.

    ``inputs`` holds the model-ready tensors of all the request's items,
    concatenated the way the model's own forward takes them. ``grid_thw`` has
    one entry per item for images and videos, none for audio. ``extras`` holds
    per-item values the language side needs to place the embeddings (each list
    has one entry per item), e.g. ``second_per_grid_ts`` for Qwen2.5-VL videos
    or ``timestamps`` for Qwen3-VL videos; empty when the family needs none.
    """

    modality: str
    inputs: dict[str, torch.Tensor]
    grid_thw: tuple[GridTHW, ...]
    token_counts: tuple[int, ...]
    extras: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(self.token_counts)


class ModelAdapter(ABC):
    """One model family's encoder (vision tower + merger, or audio tower + projector)."""

    family: ClassVar[str]
    modalities: ClassVar[frozenset[str]]
    # Where the encoder's weights live in a checkpoint: each layout maps
    # checkpoint key prefixes to the module's key prefixes. Layouts are tried in
    # order and the first one that matches any key wins (Hub checkpoints and
    # transformers' save_pretrained write either the legacy or the new names).
    weight_layouts: ClassVar[tuple[dict[str, str], ...]]
    # The transformers Auto class that loads each modality's processor.
    processor_classes: ClassVar[dict[str, str]]

    def __init__(self, config: Any) -> None:
        self.config = config

    @property
    def weight_prefixes(self) -> tuple[str, ...]:
        """Every checkpoint prefix an encoder weight may have (for messages)."""
        return tuple(prefix for layout in self.weight_layouts for prefix in layout)

    def encoder_weight_names(self, names: Iterable[str]) -> dict[str, str]:
        """Checkpoint names of the encoder's tensors mapped to module names; {} if none."""
        names = list(names)
        for layout in self.weight_layouts:
            found = {
                name: target + name[len(prefix):]
                for name in names
                for prefix, target in layout.items()
                if name.startswith(prefix)
            }
            if found:
                return found
        return {}

    @abstractmethod
    def build_encoder(self, dtype: torch.dtype) -> nn.Module:
        """The encoder module with uninitialised weights, to be loaded."""

    @property
    @abstractmethod
    def embedding_dim(self) -> int:
        """Width of one output row (the sum of ``embedding_layout``'s widths)."""

    @property
    def embedding_layout(self) -> tuple[tuple[str, int], ...]:
        """Named column blocks of one output row, in order: ``(name, width)``.

        Most families produce one block, the language model's input embedding.
        A family with more (Qwen3-VL's deepstack features) concatenates them
        along the row; the language side splits them back with these widths.
        """
        return (("embedding", self.embedding_dim),)

    @property
    def embedding_description(self) -> str:
        """One line for ``/model_info`` and logs: what a row of the output holds."""
        blocks = " | ".join(f"{name}[{width}]" for name, width in self.embedding_layout)
        return f"one row per token, dim {self.embedding_dim}: {blocks}"

    @abstractmethod
    def item_result(self, processed: dict[str, Any], modality: str,
                    extras: dict[str, list[Any]] | None = None) -> PreprocessResult:
        """Wrap the processor's output for one or more items of one request."""

    def video_extras(self, clip: VideoClip) -> dict[str, list[Any]]:
        """Per-item values the language side needs for a video; none by default."""
        return {}

    @abstractmethod
    def collate(self, results: Sequence[PreprocessResult]) -> dict[str, torch.Tensor]:
        """Concatenate several requests' inputs into one forward's arguments."""

    @abstractmethod
    def forward(self, module: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Run the encoder: ``[sum(tokens), embedding_dim]`` in input order."""

    def check_modality(self, modality: str) -> None:
        if modality not in self.modalities:
            raise RequestError(
                f"model family {self.family!r} does not encode {modality!r}; "
                f"it encodes {sorted(self.modalities)}"
            )
