"""The engine with its embedding cache: hits skip the forward, partial hits, immutability."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch

from conftest import data_uri, png_bytes
from epd_trio import RequestError, open_engine
from epd_trio.engine.cache import EmbeddingCache
from epd_trio.model.samples import generated_frames, sample_tone

A, B, C = (png_bytes(28 * (i + 1), 56, seed=i) for i in range(3))


def forwards(engine: Any) -> tuple[int, int]:
    """(forwards, items forwarded) over every device."""
    stats = [w.statistics() for w in engine.workers]
    return sum(s.forwards for s in stats), sum(s.items for s in stats)


async def test_a_hit_equals_the_miss_bit_for_bit_and_skips_the_forward(qwen25_path: str) -> None:
    async with open_engine(model_path=qwen25_path, cache_mb=4) as engine:
        miss = await engine.encode([A, B])
        before = forwards(engine)
        hit = await engine.encode([A, B])
        assert forwards(engine) == before  # no forward, no preprocessing
        stats = engine.statistics().cache
    assert hit.embedding.dtype == miss.embedding.dtype and hit.embedding.shape == miss.embedding.shape
    assert torch.equal(hit.embedding.contiguous().view(torch.uint8),  # bits, not values (-0.0, NaN)
                       miss.embedding.contiguous().view(torch.uint8))
    assert (hit.token_counts, hit.grid_thw, hit.extras) == (miss.token_counts, miss.grid_thw, miss.extras)
    assert stats is not None and (stats.hits, stats.misses, stats.entries) == (2, 2, 2)
    assert stats.bytes == miss.embedding.numel() * miss.embedding.element_size()


async def test_partial_hits_encode_only_the_misses_in_item_order(qwen25_path: str) -> None:
    async with open_engine(model_path=qwen25_path, cache_mb=4) as engine:
        a, b = await engine.encode([A]), await engine.encode([B])
        alone_c = await engine.encode([C], use_cache=False)  # the same single-item forward
        before = forwards(engine)
        mixed = await engine.encode([B, C, A])
        after = forwards(engine)
        again = await engine.encode([C, B])
        stats = engine.statistics().cache
    assert after == (before[0] + 1, before[1] + 1)  # one forward, of C alone
    assert mixed.token_counts == [b.token_counts[0], alone_c.token_counts[0], a.token_counts[0]]
    assert mixed.grid_thw == [*b.grid_thw, *alone_c.grid_thw, *a.grid_thw]
    assert torch.equal(mixed.item(0), b.embedding) and torch.equal(mixed.item(2), a.embedding)
    assert torch.equal(mixed.item(1), alone_c.embedding)
    assert torch.equal(again.embedding, torch.cat([alone_c.embedding, b.embedding]))
    assert stats is not None and (stats.hits, stats.misses) == (4, 3)  # the use_cache=False call: neither


async def test_callers_cannot_change_what_the_cache_holds(qwen25_path: str) -> None:
    async with open_engine(model_path=qwen25_path, cache_mb=4) as engine:
        first = await engine.encode([A])
        reference = first.embedding.clone()
        with torch.inference_mode():  # the forward's output is an inference tensor
            first.embedding.fill_(7.0)  # the miss's own output, mutated by its caller
        before = forwards(engine)
        hit = await engine.encode([A])
        hit.embedding.fill_(9.0)  # a hit's output, mutated by its caller
        later = await engine.encode([A])
        after = forwards(engine)
        stats = engine.statistics().cache
    # Both later calls were answered by the cache (a fresh forward would hide a mutated entry).
    assert after == before
    assert stats is not None and (stats.hits, stats.misses) == (2, 1)
    assert torch.equal(later.embedding, reference)


async def test_given_hashes_name_items_and_a_full_hit_loads_nothing(qwen25_path: str) -> None:
    async with open_engine(model_path=qwen25_path, cache_mb=4) as engine:
        named = await engine.encode([A], hashes=["sha:a"])
        # A full hit on names never looks at the items: this is not an image at all.
        hit = await engine.encode([b"not an image"], hashes=["sha:a"])
        # Names and contents are separate key spaces: A by content is a miss.
        by_content = await engine.encode([A])
        with pytest.raises(RequestError, match="item 1: bytes are not an image"):
            await engine.encode([A, b"garbage"])  # the miss keeps its place in the error
        stats = engine.statistics().cache
    assert torch.equal(hit.embedding, named.embedding)
    assert torch.equal(by_content.embedding, named.embedding)
    assert stats is not None and stats.entries == 2 and stats.hits == 2  # sha:a, then A by content


async def test_evictions_keep_the_cache_within_its_bytes(qwen25_path: str) -> None:
    async with open_engine(model_path=qwen25_path, cache_mb=1) as engine:
        engine.cache = EmbeddingCache(50_000)  # a MiB would take dozens of images
        images = [png_bytes(28 * 12, 28 * 12, seed=100 + i) for i in range(4)]  # 23 kB each
        for image in images:
            await engine.encode([image])
        assert (await engine.encode([images[0]])).embedding.shape[0] > 0  # evicted: a miss
        stats = engine.statistics().cache
    assert stats is not None and (stats.entries, stats.evictions, stats.hits) == (2, 3, 0)
    assert stats.bytes <= stats.capacity_bytes


async def test_video_extras_and_audio_without_grids_survive_the_cache(checkpoints: dict[str, str]) -> None:
    clips = [generated_frames(4, seed=1), generated_frames(6, seed=2)]
    async with open_engine(model_path=checkpoints["qwen2_5_vl"], cache_mb=4) as engine:
        first = await engine.encode([clips[0]], "video")
        both = await engine.encode([clips[1], clips[0]], "video")
        fresh = await engine.encode([clips[1], clips[0]], "video", use_cache=False)
    assert both.extras == fresh.extras and both.extras["second_per_grid_ts"]
    assert both.grid_thw == fresh.grid_thw and both.token_counts == fresh.token_counts
    assert torch.equal(both.item(1), first.embedding)
    tones = [sample_tone(1.0), sample_tone(2.0, hz=220.0)]
    async with open_engine(model_path=checkpoints["qwen2_audio"], cache_mb=4) as engine:
        one = await engine.encode([tones[0]], "audio")
        mixed = await engine.encode([tones[1], tones[0]], "audio")
        fresh = await engine.encode([tones[1], tones[0]], "audio", use_cache=False)
    assert mixed.grid_thw == [] and mixed.token_counts == fresh.token_counts
    assert torch.equal(mixed.item(1), one.embedding)


async def test_a_hashes_name_never_answers_for_a_checked_content_hash(qwen25_path: str) -> None:
    """``hashes`` entries are taken as given, a ``sha256:`` content_hash is checked against the
    bytes: one client naming A "sha256:<B's digest>" must not poison what B's checked name finds."""
    name = "sha256:" + hashlib.sha256(B).hexdigest()
    async with open_engine(model_path=qwen25_path, cache_mb=4) as engine:
        forged = await engine.encode([A], hashes=[name])  # A's embedding, stored under the name
        honest = await engine.encode([{"url": data_uri(B), "content_hash": name}])
        fresh = await engine.encode([B], use_cache=False)
        again = await engine.encode([A], hashes=[name])  # the hashes namespace still answers
    assert torch.equal(honest.embedding, fresh.embedding) and not torch.equal(honest.embedding, forged.embedding)
    assert torch.equal(again.embedding, forged.embedding)
