"""The embedding cache: a host LRU of per-item embeddings, bounded in bytes.

Keyed per item (one image, one video, one audio clip), so a request whose
items are partly cached encodes only the others. A key is a blake2b digest of
the engine's fingerprint (model directory and dtype, and the settings that
change what preprocessing produces), the modality, and either

- the item's client-given hash (the wire's ``hashes`` entry, or an item
  object's ``content_hash``), in a namespace of its own, so a client-chosen
  name can never collide with (and so never poison) a content-derived key; or
- a digest of the item's bytes as loaded (encoded media, not decoded pixels:
  the same file under another URL is the same item).

An entry keeps everything the item contributes to an answer: its rows of the
embedding, its token count, its ``grid_thw`` (None for audio) and its per-item
extras. **Immutability**: the cache stores its own copy of the rows and hands
out only copies (``torch.cat`` of the entries always allocates), so a caller
mutating its result can never change what a later caller gets.

The request-level helpers below (``given_names``, ``item_parts``,
``store_misses``, ``join_rows``) are what the engine uses to answer a request
whose items are partly cached: look every item up, encode only the misses as
one request, then put the answer back together in item order.

Pure: no trio, no clock, no torch import at module level. Single-threaded use
(the trio thread); hashing large items may run in a worker thread, lookups not.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from epd_trio.errors import RequestError

if TYPE_CHECKING:
    from epd_trio.model.adapters import PreprocessResult

__all__ = [
    "CacheEntry", "CacheStatistics", "EmbeddingCache", "ItemPart", "content_digest", "given_names",
    "item_key", "item_parts", "join_extras", "join_rows", "store_misses",
]

_DIGEST_BYTES = 32


@dataclass(frozen=True)
class CacheEntry:
    embedding: Any  # torch.Tensor [token_count, dim] on the host, owned by the cache
    token_count: int
    grid_thw: tuple[int, int, int] | None
    extras: Mapping[str, Any] = field(default_factory=dict)  # one value per extras key

    @property
    def nbytes(self) -> int:
        return int(self.embedding.numel() * self.embedding.element_size())


@dataclass(frozen=True)
class CacheStatistics:
    capacity_bytes: int
    bytes: int
    entries: int
    hits: int
    misses: int
    evictions: int
    too_large: int  # items bigger than the whole cache: never stored

    @property
    def hit_ratio(self) -> float:
        looked_up = self.hits + self.misses
        return self.hits / looked_up if looked_up else 0.0


def _update(h: Any, *parts: str | bytes) -> None:
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))  # length-prefixed: no ambiguous joins
        h.update(data)


def content_digest(loaded: Any) -> bytes:
    """A digest of an item as loaded: bytes, a PIL image, or a video's frames (arrays or images).

    Blocking for large items (about 1 GB/s); callers hash big requests in a thread.
    """
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    _digest_into(h, loaded)
    return h.digest()


def _digest_into(h: Any, loaded: Any) -> None:
    import numpy as np

    if isinstance(loaded, (bytes, bytearray, memoryview)):
        _update(h, "bytes", bytes(loaded))
    elif isinstance(loaded, np.ndarray):
        array = np.ascontiguousarray(loaded)
        _update(h, "array", str(array.dtype), repr(array.shape), array.tobytes())
    elif isinstance(loaded, (list, tuple)):
        _update(h, "frames", str(len(loaded)))
        for frame in loaded:
            _digest_into(h, frame)
    elif hasattr(loaded, "tobytes") and hasattr(loaded, "mode") and hasattr(loaded, "size"):
        _update(h, "image", loaded.mode, repr(loaded.size), loaded.tobytes())  # a PIL image
    else:
        raise TypeError(f"cannot hash an item of type {type(loaded).__name__}")


def item_key(fingerprint: str, modality: str, *, given: str | None = None,
             digest: bytes | None = None) -> bytes:
    """The cache key of one item: from its client-given hash, else from its content digest."""
    if (given is None) == (digest is None):
        raise ValueError("exactly one of given and digest")
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    if given is not None:
        _update(h, fingerprint, modality, "given", given)
    else:
        assert digest is not None
        _update(h, fingerprint, modality, "content", digest)
    return h.digest()


class EmbeddingCache:
    """LRU by bytes; ``get`` and ``put`` count hits, misses and evictions."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError("capacity_bytes must be at least 1")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, CacheEntry] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._evictions = self._too_large = 0

    def get(self, key: bytes) -> CacheEntry | None:
        entry = self._entries.get(key)
        if entry is None:
            self._misses += 1
            return None
        self._entries.move_to_end(key)
        self._hits += 1
        return entry

    def put(self, key: bytes, embedding: Any, token_count: int, grid_thw: Sequence[int] | None,
            extras: Mapping[str, Any]) -> None:
        """Store a private copy of ``embedding``; evict the least recently used to make room."""
        entry = CacheEntry(embedding.detach().clone(memory_format=_contiguous()), token_count,
                           tuple(grid_thw) if grid_thw is not None else None,  # type: ignore[arg-type]
                           dict(extras))
        if entry.nbytes > self.capacity_bytes:
            self._too_large += 1
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes
        while self._entries and self._bytes + entry.nbytes > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.nbytes
            self._evictions += 1
        self._entries[key] = entry
        self._bytes += entry.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def statistics(self) -> CacheStatistics:
        return CacheStatistics(self.capacity_bytes, self._bytes, len(self._entries), self._hits,
                               self._misses, self._evictions, self._too_large)

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<EmbeddingCache {s.bytes}/{s.capacity_bytes} bytes in {s.entries} entries, "
                f"{s.hits} hits, {s.misses} misses, {s.evictions} evictions>")


# ---- a request of several items ------------------------------------------------
@dataclass(frozen=True)
class ItemPart:
    """What one item contributes to an answer, besides its rows."""

    token_count: int
    grid_thw: tuple[int, int, int] | None
    extras: Mapping[str, Any]


def given_names(items: Sequence[Any], hashes: Sequence[str] | None) -> list[str | None]:
    """Each item's client-given name: its ``hashes`` entry, else its ``content_hash``, else None."""
    if hashes is not None and len(hashes) != len(items):
        raise RequestError(f"'hashes' must have one entry per item ({len(items)}), got {len(hashes)}")
    out: list[str | None] = []
    for i, item in enumerate(items):
        name = hashes[i] if hashes is not None else None
        if name is None and isinstance(item, dict) and isinstance(item.get("content_hash"), str):
            name = item["content_hash"] or None
        out.append(name)
    return out


def item_parts(entries: Sequence[CacheEntry | None], misses: PreprocessResult | None) -> list[ItemPart]:
    """Every item in order: a hit from its entry, a miss from the misses' preprocessing."""
    parts, j = [], 0
    for entry in entries:
        if entry is not None:
            parts.append(ItemPart(entry.token_count, entry.grid_thw, entry.extras))
            continue
        assert misses is not None, "a miss without a preprocessed result"
        grid = tuple(misses.grid_thw[j]) if misses.grid_thw else None  # audio has no grids
        parts.append(ItemPart(misses.token_counts[j], grid,  # type: ignore[arg-type]
                              {k: v[j] for k, v in misses.extras.items()}))
        j += 1
    return parts


def join_extras(parts: Sequence[ItemPart]) -> dict[str, list[Any]]:
    keys = list(dict.fromkeys(k for p in parts for k in p.extras))
    return {k: [p.extras.get(k) for p in parts] for k in keys}


def store_misses(cache: EmbeddingCache, keys: Sequence[bytes], misses: Sequence[int],
                 pre: PreprocessResult, embedding: Any) -> None:
    """Store each miss's rows (``embedding`` holds the misses' rows, in their order)."""
    start = 0
    for i, part in zip(misses, item_parts([None] * len(misses), pre), strict=True):
        cache.put(keys[i], embedding[start:start + part.token_count], part.token_count,
                  part.grid_thw, part.extras)
        start += part.token_count


def join_rows(entries: Sequence[CacheEntry | None], misses: PreprocessResult | None,
              embedding: Any) -> Any:
    """The answer's rows in item order. With any hit it is a new tensor (``torch.cat``
    allocates), so the caller owns it; with none, the forward's own output (no copy)."""
    import torch

    if all(entry is None for entry in entries):
        return embedding
    rows = iter(torch.split(embedding, list(misses.token_counts)) if misses is not None else ())
    return torch.cat([entry.embedding if entry is not None else next(rows) for entry in entries])


def _contiguous() -> Any:
    import torch

    return torch.contiguous_format
