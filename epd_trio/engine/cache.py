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

How a request whose items are partly cached is answered (look every item up,
encode only the misses, put the answer back together in item order) is the
engine's plan, ``plan.py``.

Pure: no trio, no clock, no torch import at module level. Single-threaded use
(the trio thread); hashing large items may run in a worker thread, lookups not.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["CacheEntry", "CacheStatistics", "EmbeddingCache", "content_digest", "item_key"]

_DIGEST_BYTES = 32


@dataclass(frozen=True)
class CacheEntry:
    embedding: torch.Tensor  # [token_count, dim] on the host, owned by the cache
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
        # A PIL image. Its pixels alone are palette indices in mode P: the palette (and a
        # transparent index) is what makes them colours, so it is part of the content.
        palette = loaded.getpalette() if loaded.mode in ("P", "PA") else None
        _update(h, "image", loaded.mode, repr(loaded.size), loaded.tobytes(),
                repr(palette), repr(loaded.info.get("transparency")))
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

    def put(self, key: bytes, embedding: torch.Tensor, token_count: int, grid_thw: Sequence[int] | None,
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


def _contiguous() -> Any:
    import torch

    return torch.contiguous_format
