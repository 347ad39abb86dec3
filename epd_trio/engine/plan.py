"""How the engine answers one request: which items need a forward, and how the answer is built.

The engine has one encode path (``Engine.encode``): admit → plan → preprocess
and forward the items the plan says → let the plan finish the answer. A plan
is made before any preprocessing:

- ``EncodeAll`` (no cache, or ``use_cache=False``): every item is encoded, and
  the answer is the forward's own output, untouched.
- ``CachePlan``: every item was looked up in the ``EmbeddingCache``
  (``cache.py``); only the misses are preprocessed and forwarded (as one
  request), stored once their rows are known, and the answer is put back
  together in item order from the hits and the misses.

Pure: no trio, no clock, no torch import at module level (``_join_rows`` imports it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from epd_trio.engine.cache import CacheEntry, EmbeddingCache, item_key
from epd_trio.errors import RequestError
from epd_trio.model.adapters import PreprocessResult

if TYPE_CHECKING:
    import torch

__all__ = ["CachePlan", "EncodeAll", "EncodeOutput", "EncodePlan", "given_names"]


@dataclass(frozen=True)
class EncodeOutput:
    """Embeddings of one request's items, concatenated in item order."""

    modality: str
    embedding: torch.Tensor  # [sum(token_counts), dim]
    token_counts: list[int]
    grid_thw: list[tuple[int, int, int]]
    # Per-item values the language side needs (each list has one entry per
    # item), e.g. ``second_per_grid_ts`` for Qwen2.5-VL videos; often empty.
    extras: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    # False when the cache held every item: no forward ran (the health check must not take a
    # cache hit for proof that the device completes batches).
    forwarded: bool = True

    def item(self, index: int) -> Any:
        """The rows of item ``index`` (a view, no copy)."""
        start = sum(self.token_counts[:index])
        return self.embedding[start:start + self.token_counts[index]]


class EncodePlan(Protocol):
    """What the engine's one encode path asks of a plan."""

    @property
    def loaded(self) -> list[Any] | None:
        """The items as loaded while planning (content keys need the bytes), else None."""

    @property
    def needs_forward(self) -> bool:
        """Whether any item must be preprocessed and forwarded."""

    def select(self, loaded: list[Any]) -> tuple[list[Any], Sequence[int] | None]:
        """The loaded items to preprocess, and their places in the request (None: all, in order)."""

    def describe(self, pre: PreprocessResult | None) -> PreprocessResult:
        """The whole request's sizes, for ``on_preprocessed``."""

    def finish(self, pre: PreprocessResult | None, embedding: torch.Tensor | None) -> EncodeOutput:
        """The answer, in item order, from the forward's output (None if nothing ran)."""


@dataclass(frozen=True)
class EncodeAll:
    """Every item is encoded; the answer is the forward's output as it is."""

    loaded: list[Any] | None = None
    needs_forward: bool = True

    def select(self, loaded: list[Any]) -> tuple[list[Any], Sequence[int] | None]:
        return loaded, None

    def describe(self, pre: PreprocessResult | None) -> PreprocessResult:
        assert pre is not None, "EncodeAll always runs the forward"
        return pre

    def finish(self, pre: PreprocessResult | None, embedding: torch.Tensor | None) -> EncodeOutput:
        assert pre is not None and embedding is not None, "EncodeAll always runs the forward"
        return EncodeOutput(pre.modality, embedding, list(pre.token_counts), list(pre.grid_thw),
                            {key: list(values) for key, values in pre.extras.items()})


@dataclass(frozen=True)
class CachePlan:
    """Each item's cache entry (None: a miss); only the misses are encoded."""

    modality: str
    cache: EmbeddingCache
    keys: list[bytes]
    entries: list[CacheEntry | None]
    loaded: list[Any] | None

    @classmethod
    def look_up(cls, cache: EmbeddingCache, fingerprint: str, modality: str,
                given: Sequence[str | None], digests: Sequence[bytes | None],
                loaded: list[Any] | None) -> CachePlan:
        """Key every item (by its given name, else its content digest) and look it up."""
        keys = [item_key(fingerprint, modality, given=g) if g is not None
                else item_key(fingerprint, modality, digest=d) for g, d in zip(given, digests)]
        return cls(modality, cache, keys, [cache.get(key) for key in keys], loaded)

    @property
    def misses(self) -> list[int]:
        return [i for i, entry in enumerate(self.entries) if entry is None]

    @property
    def needs_forward(self) -> bool:
        return any(entry is None for entry in self.entries)

    def select(self, loaded: list[Any]) -> tuple[list[Any], Sequence[int] | None]:
        misses = self.misses
        return [loaded[i] for i in misses], misses

    def describe(self, pre: PreprocessResult | None) -> PreprocessResult:
        """Cached items included; ``inputs`` are only the misses' (what the forward gets)."""
        parts = _item_parts(self.entries, pre)
        return PreprocessResult(self.modality, dict(pre.inputs) if pre is not None else {},
                                tuple(p.grid_thw for p in parts if p.grid_thw is not None),
                                tuple(p.token_count for p in parts), _join_extras(parts))

    def finish(self, pre: PreprocessResult | None, embedding: torch.Tensor | None) -> EncodeOutput:
        """Store the misses' rows, then answer from hits and misses in item order."""
        if pre is not None:
            assert embedding is not None, "a forward ran for the misses"
            self._store_misses(pre, embedding)
        parts = _item_parts(self.entries, pre)
        return EncodeOutput(self.modality, _join_rows(self.entries, pre, embedding),
                            [p.token_count for p in parts],
                            [p.grid_thw for p in parts if p.grid_thw is not None], _join_extras(parts),
                            forwarded=pre is not None)

    def _store_misses(self, pre: PreprocessResult, embedding: torch.Tensor) -> None:
        """``embedding`` holds the misses' rows, in their order."""
        misses = self.misses
        start = 0
        for i, part in zip(misses, _item_parts([None] * len(misses), pre), strict=True):
            self.cache.put(self.keys[i], embedding[start:start + part.token_count], part.token_count,
                           part.grid_thw, part.extras)
            start += part.token_count


def given_names(items: Sequence[Any], hashes: Sequence[str] | None) -> list[str | None]:
    """Each item's client-given name: its ``hashes`` entry, else its ``content_hash``, else None.

    The two are named apart: a ``sha256:`` ``content_hash`` is checked against the bytes when
    they are loaded, a ``hashes`` entry is taken as given, so the same string from ``hashes``
    must never find (or fill) the entry a checked ``content_hash`` made.
    """
    if hashes is not None and len(hashes) != len(items):
        raise RequestError(f"'hashes' must have one entry per item ({len(items)}), got {len(hashes)}")
    out: list[str | None] = []
    for i, item in enumerate(items):
        name = f"hashes:{hashes[i]}" if hashes is not None and hashes[i] is not None else None
        if name is None and isinstance(item, dict) and isinstance(item.get("content_hash"), str):
            name = f"content_hash:{item['content_hash']}" if item["content_hash"] else None
        out.append(name)
    return out


# ---- putting a partly cached answer together ------------------------------------
@dataclass(frozen=True)
class _ItemPart:
    """What one item contributes to an answer, besides its rows."""

    token_count: int
    grid_thw: tuple[int, int, int] | None
    extras: Mapping[str, Any]


def _item_parts(entries: Sequence[CacheEntry | None], misses: PreprocessResult | None) -> list[_ItemPart]:
    """Every item in order: a hit from its entry, a miss from the misses' preprocessing."""
    parts, j = [], 0
    for entry in entries:
        if entry is not None:
            parts.append(_ItemPart(entry.token_count, entry.grid_thw, entry.extras))
            continue
        assert misses is not None, "a miss without a preprocessed result"
        grid = tuple(misses.grid_thw[j]) if misses.grid_thw else None  # audio has no grids
        parts.append(_ItemPart(misses.token_counts[j], grid,  # type: ignore[arg-type]
                               {k: v[j] for k, v in misses.extras.items()}))
        j += 1
    return parts


def _join_extras(parts: Sequence[_ItemPart]) -> dict[str, list[Any]]:
    keys = list(dict.fromkeys(k for p in parts for k in p.extras))
    return {k: [p.extras.get(k) for p in parts] for k in keys}


def _join_rows(entries: Sequence[CacheEntry | None], misses: PreprocessResult | None,
               embedding: torch.Tensor | None) -> torch.Tensor:
    """The answer's rows in item order. With any hit it is a new tensor (``torch.cat``
    allocates), so the caller owns it; with none, the forward's own output (no copy)."""
    import torch

    if all(entry is None for entry in entries):
        assert embedding is not None, "all misses: the forward ran"
        return embedding
    rows = iter(torch.split(embedding, list(misses.token_counts))
                if misses is not None and embedding is not None else ())
    return torch.cat([entry.embedding if entry is not None else next(rows) for entry in entries])
