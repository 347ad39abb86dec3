"""Stitching received parts into one pool slot, and the ``EncodedRequest`` handle.

The layout is decided first, purely (``plan_layout``), then the bytes are
copied: each modality's parts go end to end in ``part_idx`` order, so a
modality is one ``[tokens, dim]`` tensor over the slot and each item a row
range of it. Modalities start on ``ALIGNMENT`` boundaries, as their dtypes may
differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType, TracebackType

import torch

from epd_trio.client.pool import ALIGNMENT, Slot
from epd_trio.client.routing import Part
from epd_trio.errors import ProtocolError
from epd_trio.protocol.codec import TORCH_DTYPES
from epd_trio.protocol.messages import DTYPE_ITEMSIZE, EmbeddingHeader

__all__ = [
    "EncodedRequest",
    "ItemEmbedding",
    "ModalityLayout",
    "PartReport",
    "ReceivedPart",
    "copy_parts",
    "plan_layout",
]


@dataclass(frozen=True)
class ReceivedPart:
    """A part's ZMQ message; ``tensor`` aliases the message frame until copied."""

    part: Part
    header: EmbeddingHeader
    tensor: torch.Tensor


@dataclass(frozen=True)
class ModalityLayout:
    modality: str
    dtype: str
    dim: int
    tokens: int
    offset: int  # bytes from the slot's start
    parts: tuple[ReceivedPart, ...]  # in part_idx order

    @property
    def nbytes(self) -> int:
        return self.tokens * self.dim * DTYPE_ITEMSIZE[self.dtype]


def plan_layout(received: Sequence[ReceivedPart]) -> tuple[list[ModalityLayout], int]:
    """Where each modality goes in the slot, and the slot's size in bytes.

    All parts of a modality come from one model, so they must agree on dtype
    and dim; ``ProtocolError`` otherwise (the embeddings could not be stacked).
    """
    by_modality: dict[str, list[ReceivedPart]] = {}
    for r in sorted(received, key=lambda r: r.part.part_idx):
        by_modality.setdefault(r.part.modality, []).append(r)
    layouts, offset = [], 0
    for modality, parts in by_modality.items():
        first = parts[0].header
        for r in parts[1:]:
            if (r.header.dtype, r.header.shape[1], bool(r.header.grid_thw)) != \
                    (first.dtype, first.shape[1], bool(first.grid_thw)):
                raise ProtocolError(
                    f"{modality} parts disagree: part {parts[0].part.part_idx} is {first.dtype}"
                    f" dim {first.shape[1]}, part {r.part.part_idx} is {r.header.dtype}"
                    f" dim {r.header.shape[1]}, or only one has grid_thw")
        offset = -(-offset // ALIGNMENT) * ALIGNMENT
        layout = ModalityLayout(modality, first.dtype, first.shape[1],
                                sum(r.header.shape[0] for r in parts), offset, tuple(parts))
        layouts.append(layout)
        offset += layout.nbytes
    return layouts, offset


def copy_parts(slot: Slot, layouts: Sequence[ModalityLayout]) -> dict[str, torch.Tensor]:
    """Copy every part into ``slot``; the per-modality tensors over it (blocking)."""
    out = {}
    for layout in layouts:
        dest = slot.view(TORCH_DTYPES[layout.dtype], (layout.tokens, layout.dim), layout.offset)
        row = 0
        for r in layout.parts:
            rows = r.header.shape[0]
            dest[row:row + rows].copy_(r.tensor)
            row += rows
        out[layout.modality] = dest
    return out


@dataclass(frozen=True)
class ItemEmbedding:
    """One original item: its rows of the modality tensor (a view into the pool)."""

    modality: str
    index: int
    embedding: torch.Tensor
    token_count: int
    grid_thw: tuple[int, int, int] | None


@dataclass(frozen=True)
class PartReport:
    """Where one part was encoded and how long it took (post to embedding arrived)."""

    part_idx: int
    modality: str
    encoder_url: str
    item_indices: tuple[int, ...]
    seconds: float


class EncodedRequest:
    """A request's embeddings, held in one pool slot until ``release()``.

    Use as ``async with await client.encode(...) as result:``; the tensors are
    views into the pool and must not be used after the block (copy what you
    keep). A forgotten release is reclaimed by the pool's GC backstop.
    """

    def __init__(self, req_id: str, slot: Slot, layouts: Sequence[ModalityLayout],
                 embeddings: Mapping[str, torch.Tensor], parts: Sequence[PartReport] = ()) -> None:
        self.req_id = req_id
        self.parts: tuple[PartReport, ...] = tuple(parts)
        self.embeddings: Mapping[str, torch.Tensor] = MappingProxyType(dict(embeddings))
        token_counts: dict[str, list[int]] = {}
        grid_thw: dict[str, list[list[int]]] = {}
        items: list[ItemEmbedding] = []
        for layout in layouts:
            counts = token_counts.setdefault(layout.modality, [])
            grids = grid_thw.setdefault(layout.modality, [])
            for r in layout.parts:
                counts.extend(r.header.token_counts)
                grids.extend(list(g) for g in r.header.grid_thw)
            items.extend(_items(layout.modality, embeddings[layout.modality], counts, grids))
        self.token_counts: Mapping[str, list[int]] = MappingProxyType(token_counts)
        self.grid_thw: Mapping[str, list[list[int]]] = MappingProxyType(grid_thw)
        self.items: tuple[ItemEmbedding, ...] = tuple(items)
        self._slot = slot

    @property
    def slot(self) -> Slot:
        return self._slot

    @property
    def released(self) -> bool:
        return self._slot.released

    def release(self) -> None:
        """Give the pool slot back; idempotent."""
        self._slot.release()

    async def __aenter__(self) -> EncodedRequest:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()

    def __repr__(self) -> str:
        shapes = ", ".join(f"{m} {tuple(t.shape)}" for m, t in self.embeddings.items())
        state = "released" if self.released else f"{self._slot.nbytes} bytes held"
        return f"<EncodedRequest {self.req_id}: {shapes}; {state}>"


def _items(modality: str, tensor: torch.Tensor, counts: Sequence[int],
           grids: Sequence[Sequence[int]]) -> list[ItemEmbedding]:
    out, row = [], 0
    for i, count in enumerate(counts):
        grid = tuple(grids[i]) if grids else None
        out.append(ItemEmbedding(modality, i, tensor[row:row + count], count, grid))  # type: ignore[arg-type]
        row += count
    return out
