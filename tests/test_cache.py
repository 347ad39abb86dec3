"""The embedding cache on its own: LRU by bytes, keys, private copies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import png_bytes, random_image
from epd_trio.engine.cache import EmbeddingCache, content_digest, item_key


def rows(n: int, value: float = 1.0) -> torch.Tensor:
    return torch.full((n, 4), value)  # 16 bytes per row


def test_lru_by_bytes_evicts_the_least_recently_used() -> None:
    cache = EmbeddingCache(100)
    cache.put(b"a", rows(2), 2, (1, 2, 4), {})  # 32 bytes
    cache.put(b"b", rows(2), 2, (1, 2, 4), {})
    cache.put(b"c", rows(2), 2, (1, 2, 4), {})  # 96 bytes
    assert cache.get(b"a") is not None  # a is now the most recent
    cache.put(b"d", rows(1), 1, None, {"x": 1})  # 112 > 100: b goes
    assert cache.get(b"b") is None
    assert all(cache.get(k) is not None for k in (b"a", b"c", b"d"))
    s = cache.statistics()
    assert (s.bytes, s.entries, s.hits, s.misses, s.evictions) == (80, 3, 4, 1, 1)
    assert s.hit_ratio == 0.8
    cache.put(b"huge", rows(7), 7, None, {})  # 112 bytes: larger than the whole cache
    assert cache.get(b"huge") is None and cache.statistics().too_large == 1
    assert cache.statistics().entries == 3  # nothing was evicted for it
    cache.put(b"a", rows(3), 3, None, {})  # replacing an entry frees the old bytes first
    assert cache.statistics().bytes == 48 + 32 + 16


def test_entries_are_private_copies() -> None:
    cache = EmbeddingCache(1 << 20)
    source = rows(3, 5.0)
    cache.put(b"k", source[1:], 2, (1, 2, 4), {"fps": 2.0})
    source.fill_(0.0)  # the caller's tensor changes after the put
    entry = cache.get(b"k")
    assert entry is not None and torch.equal(entry.embedding, rows(2, 5.0))
    assert entry.embedding.is_contiguous() and entry.embedding.untyped_storage().nbytes() == 32
    assert (entry.token_count, entry.grid_thw, dict(entry.extras)) == (2, (1, 2, 4), {"fps": 2.0})


def test_keys_separate_given_names_from_content_and_settings() -> None:
    data = png_bytes(32, 32)
    digest = content_digest(data)
    assert digest == content_digest(bytes(data)) and digest != content_digest(png_bytes(32, 32, seed=1))
    # a client naming an item by the hex of a content digest cannot reach the content entry
    assert item_key("fp", "image", given=digest.hex()) != item_key("fp", "image", digest=digest)
    assert item_key("fp", "image", digest=digest) != item_key("fp", "video", digest=digest)
    assert item_key("fp", "image", digest=digest) != item_key("fp2", "image", digest=digest)
    with pytest.raises(ValueError):
        item_key("fp", "image")


def test_digests_of_in_process_items() -> None:
    image = random_image(20, 10)
    assert content_digest(image) == content_digest(random_image(20, 10))
    assert content_digest(image) != content_digest(random_image(10, 20))
    frames = np.zeros((2, 4, 4, 3), dtype=np.uint8)
    assert content_digest(frames) != content_digest(frames.astype(np.float32))
    assert content_digest([image, image]) != content_digest([image])
    with pytest.raises(TypeError):
        content_digest(object())


def test_palette_images_differ_by_their_palette() -> None:
    from PIL import Image

    red, blue = Image.new("P", (4, 4), 0), Image.new("P", (4, 4), 0)  # the same indices...
    red.putpalette([255, 0, 0] * 256)
    blue.putpalette([0, 0, 255] * 256)  # ...other colours
    assert red.tobytes() == blue.tobytes() and content_digest(red) != content_digest(blue)
    see_through = red.copy()
    see_through.info["transparency"] = 0
    assert content_digest(see_through) != content_digest(red)
    again = Image.new("P", (4, 4), 0)
    again.putpalette([255, 0, 0] * 256)
    assert content_digest(again) == content_digest(red)
