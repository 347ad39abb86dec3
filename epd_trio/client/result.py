"""Laying a request's parts out in one pool slot, and the ``EncodedRequest`` handle.

The layout is decided first, purely (``plan_layout``), from what the encoders
said about each part; then the bytes get there. Each modality's parts go end to
end in ``part_idx`` order, so a modality is one ``[tokens, dim]`` tensor over
the slot and each item a row range of it. Modalities start on ``ALIGNMENT``
boundaries, as their dtypes may differ. Every receiver (``receiving``) shares
it: ZMQ and inline parts are copied in (``copy_parts``), Mooncake parts are
written by the encoders at their ``placements`` and only viewed (``slot_views``,
no copy).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType
from typing import Any

import torch

from epd_trio.client.pool import ALIGNMENT, Slot
from epd_trio.client.routing import Part
from epd_trio.errors import ProtocolError
from epd_trio.protocol.codec import TORCH_DTYPES
from epd_trio.protocol.messages import DTYPE_ITEMSIZE, EmbeddingHeader
from epd_trio.protocol.payload import Payload
from epd_trio.protocol.requests import EncodeMeta

__all__ = [
    "EncodedRequest",
    "ItemEmbedding",
    "ModalityLayout",
    "PartReport",
    "ReceivedPart",
    "copy_parts",
    "plan_layout",
    "slot_views",
]


@dataclass(frozen=True)
class ReceivedPart:
    """A part as its encoder described it (checked), with its bytes when they came apart.

    ``payload`` aliases the received ZMQ frames (or inline body) until copied;
    it is None for a Mooncake part, whose bytes the encoder writes into the slot.
    """

    part: Part
    dtype: str
    tokens: int
    dim: int
    token_counts: tuple[int, ...]
    grid_thw: tuple[tuple[int, ...], ...]
    payload: Payload | None = None
    # Per-item values for the language side (name → one value per item of this part).
    extras: Mapping[str, Sequence[Any]] = field(default_factory=dict)

    @classmethod
    def from_message(cls, part: Part, header: EmbeddingHeader, payload: Payload) -> ReceivedPart:
        return cls(part, header.dtype, header.shape[0], header.shape[1], tuple(header.token_counts),
                   tuple(tuple(g) for g in header.grid_thw), payload, header.extras)

    @classmethod
    def from_meta(cls, part: Part, meta: EncodeMeta) -> ReceivedPart:
        return cls(part, meta.dtype, meta.tokens, meta.dim, tuple(meta.token_counts),
                   tuple(tuple(g) for g in meta.grid_thw), extras=meta.extras)

    @property
    def nbytes(self) -> int:
        return self.tokens * self.dim * DTYPE_ITEMSIZE[self.dtype]


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

    def placements(self) -> list[tuple[ReceivedPart, int]]:
        """Each part with its byte offset from the slot's start (end to end)."""
        out, offset = [], self.offset
        for r in self.parts:
            out.append((r, offset))
            offset += r.nbytes
        return out


def plan_layout(received: Sequence[ReceivedPart]) -> tuple[list[ModalityLayout], int]:
    """Where each modality goes in the slot, and the slot's size in bytes.

    All parts of a modality come from one model, so they must agree on dtype,
    dim, whether items have grids and which extras they carry; ``ProtocolError``
    otherwise (the embeddings or their per-item metadata could not be stacked).
    """
    by_modality: dict[str, list[ReceivedPart]] = {}
    for r in sorted(received, key=lambda r: r.part.part_idx):
        by_modality.setdefault(r.part.modality, []).append(r)
    layouts, offset = [], 0
    for modality, parts in by_modality.items():
        first = parts[0]
        for r in parts[1:]:
            if (r.dtype, r.dim, bool(r.grid_thw), sorted(r.extras)) != \
                    (first.dtype, first.dim, bool(first.grid_thw), sorted(first.extras)):
                raise ProtocolError(
                    f"{modality} parts disagree: part {first.part.part_idx} is {first.dtype}"
                    f" dim {first.dim} extras {sorted(first.extras)}, part {r.part.part_idx} is"
                    f" {r.dtype} dim {r.dim} extras {sorted(r.extras)}, or only one has grid_thw")
        offset = -(-offset // ALIGNMENT) * ALIGNMENT
        layout = ModalityLayout(modality, first.dtype, first.dim, sum(r.tokens for r in parts),
                                offset, tuple(parts))
        layouts.append(layout)
        offset += layout.nbytes
    return layouts, offset


def slot_views(slot: Slot, layouts: Sequence[ModalityLayout]) -> dict[str, torch.Tensor]:
    """The per-modality ``[tokens, dim]`` tensors over ``slot`` (views, no copy)."""
    return {layout.modality: slot.view(TORCH_DTYPES[layout.dtype], (layout.tokens, layout.dim),
                                       layout.offset)
            for layout in layouts}


def copy_parts(slot: Slot, layouts: Sequence[ModalityLayout]) -> dict[str, torch.Tensor]:
    """Copy every part's payload into ``slot``; the per-modality tensors over it (blocking)."""
    out = slot_views(slot, layouts)
    for layout in layouts:
        dest, row = out[layout.modality], 0
        for r in layout.parts:
            assert r.payload is not None, "copy_parts needs the parts' payloads"
            r.payload.copy_into(dest, row)
            row += r.tokens
    return out


@dataclass(frozen=True)
class ItemEmbedding:
    """One original item: its rows of the modality tensor (a view into the pool).

    ``extras`` holds this item's value of each per-item extra its encoder sent
    (``second_per_grid_ts`` for a Qwen2.5-VL video, ``timestamps`` for a
    Qwen3-VL one); empty when the model needs none.
    """

    modality: str
    index: int
    embedding: torch.Tensor
    token_count: int
    grid_thw: tuple[int, int, int] | None
    extras: Mapping[str, Any] = field(default_factory=dict)


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
    views into the pool. Leaving the block releases the slot and the result lets
    go of its tensors (``embeddings`` and ``items`` become empty); a tensor you
    took out of it keeps its bytes out of the pool until it dies, so it never
    shows a later request's embedding (keeping one holds pool memory: copy what
    you keep for long). A forgotten release is reclaimed by the pool's GC
    backstop, in the same way.

    Per modality: ``embeddings``, ``token_counts``, ``grid_thw`` and
    ``extras`` (name → one value per item, stitched across parts in item
    order; no entry for a modality without extras). ``items`` has the same
    per item.
    """

    def __init__(self, req_id: str, slot: Slot, layouts: Sequence[ModalityLayout],
                 embeddings: Mapping[str, torch.Tensor], parts: Sequence[PartReport] = ()) -> None:
        self.req_id = req_id
        self.parts: tuple[PartReport, ...] = tuple(parts)
        self.embeddings: Mapping[str, torch.Tensor] = MappingProxyType(dict(embeddings))
        token_counts: dict[str, list[int]] = {}
        grid_thw: dict[str, list[list[int]]] = {}
        extras: dict[str, dict[str, list[Any]]] = {}
        items: list[ItemEmbedding] = []
        for layout in layouts:
            counts = token_counts.setdefault(layout.modality, [])
            grids = grid_thw.setdefault(layout.modality, [])
            stitched: dict[str, list[Any]] = {}
            for r in layout.parts:
                counts.extend(r.token_counts)
                grids.extend(list(g) for g in r.grid_thw)
                for key, values in r.extras.items():
                    stitched.setdefault(key, []).extend(values)
            if stitched:
                extras[layout.modality] = stitched
            items.extend(_items(layout.modality, embeddings[layout.modality], counts, grids,
                                stitched))
        self.token_counts: Mapping[str, list[int]] = MappingProxyType(token_counts)
        self.grid_thw: Mapping[str, list[list[int]]] = MappingProxyType(grid_thw)
        self.extras: Mapping[str, Mapping[str, list[Any]]] = MappingProxyType(
            {m: MappingProxyType(e) for m, e in extras.items()})
        self.items: tuple[ItemEmbedding, ...] = tuple(items)
        self._slot = slot

    @property
    def slot(self) -> Slot:
        return self._slot

    @property
    def released(self) -> bool:
        return self._slot.released

    def release(self) -> None:
        """Let go of the tensors and give the pool slot back; idempotent."""
        self.embeddings = MappingProxyType({})  # first: unless the caller kept one, the
        self.items = ()  # slot's range is then free at once
        self._slot.release()

    async def __aenter__(self) -> EncodedRequest:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()

    def __repr__(self) -> str:
        if self.released:
            return f"<EncodedRequest {self.req_id}: released>"
        shapes = ", ".join(f"{m} {tuple(t.shape)}" for m, t in self.embeddings.items())
        return f"<EncodedRequest {self.req_id}: {shapes}; {self._slot.nbytes} bytes held>"


def _items(modality: str, tensor: torch.Tensor, counts: Sequence[int],
           grids: Sequence[Sequence[int]], extras: Mapping[str, Sequence[Any]]
           ) -> list[ItemEmbedding]:
    out, row = [], 0
    for i, count in enumerate(counts):
        grid = tuple(grids[i]) if grids else None
        mine = MappingProxyType({key: values[i] for key, values in extras.items()})
        out.append(ItemEmbedding(modality, i, tensor[row:row + count], count, grid,  # type: ignore[arg-type]
                                 mine))
        row += count
    return out
