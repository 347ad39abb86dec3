"""EmbeddingPool: one buffer, first-fit slots, strict FIFO admission, leak backstop."""

from __future__ import annotations

import gc
import logging

import pytest
import torch
import trio
import trio.lowlevel
import trio.testing

from epd_trio.client.pool import ALIGNMENT, EmbeddingPool, PoolStatistics
from epd_trio.errors import OverloadedError, PayloadTooLargeError, RequestError

KiB = 1024


def assert_idle(pool: EmbeddingPool) -> None:
    s = pool.statistics()
    assert (s.used_bytes, s.slots, s.waiters, s.waiting_bytes) == (0, 0, 0, 0), s
    assert s.acquired == s.released + s.leaked, s


async def test_slots_are_contiguous_aligned_ranges_of_one_buffer() -> None:
    pool = EmbeddingPool(4 * KiB)
    address = pool.address
    a = await pool.acquire(100)
    b = await pool.acquire(1)
    assert (a.offset, a.size, a.nbytes) == (0, 128, 100)
    assert (b.offset, b.size) == (128, ALIGNMENT)
    assert a.address == address and b.address == address + 128
    assert pool.statistics() == PoolStatistics(
        capacity=4 * KiB, used_bytes=192, slots=2, waiters=0, waiting_bytes=0, peak_used=192,
        acquired=2, released=0, leaked=0)
    a.release()
    a.release()  # idempotent
    b.release()
    assert pool.address == address
    assert pool.statistics().peak_used == 192
    assert_idle(pool)


async def test_views_alias_the_slot_bytes() -> None:
    pool = EmbeddingPool(KiB)
    async with pool.reserve(64) as slot:
        f32 = slot.view(torch.float32, (2, 4))
        f32.copy_(torch.arange(8, dtype=torch.float32).view(2, 4))
        bf = slot.view(torch.bfloat16, (4, 2), offset=32)
        bf.fill_(1.5)
        raw = slot.bytes()
        assert raw.shape == (64,)
        assert torch.equal(raw[:32].view(torch.float32), torch.arange(8, dtype=torch.float32))
        assert torch.equal(raw[32:48].view(torch.bfloat16), torch.full((8,), 1.5, dtype=torch.bfloat16))
        assert pool.buffer[slot.offset:slot.offset + 32].view(torch.float32)[3] == 3.0
        assert slot.view(torch.float32, (0, 4), offset=64).shape == (0, 4)
        with pytest.raises(ValueError, match="does not fit"):
            slot.view(torch.float32, (5, 4))
        with pytest.raises(ValueError, match="does not fit"):
            slot.view(torch.uint8, (1,), offset=64)
        with pytest.raises(ValueError, match="aligned"):
            slot.view(torch.float32, (2,), offset=2)
    assert slot.released
    with pytest.raises(RuntimeError, match="released"):
        slot.view(torch.float32, (1,))
    s = pool.statistics()  # the views still show the bytes: the range stays out of the allocator
    assert (s.used_bytes, s.view_held, s.released) == (64, 1, 1), s
    del f32, bf, raw
    await trio.testing.wait_all_tasks_blocked()  # the last view's death frees the range in the loop
    assert_idle(pool)
    assert pool.statistics().view_held == 0


async def test_a_kept_view_is_never_handed_to_the_next_slot() -> None:
    """A tensor kept after its slot was released keeps its bytes: the next slots go
    elsewhere, or wait until the tensor dies; the tensor is never written through."""
    pool = EmbeddingPool(2 * KiB)
    slot = await pool.acquire(KiB)
    kept = slot.view(torch.float32, (KiB // 4,))
    kept.fill_(7.0)
    slot.release()
    second = await pool.acquire(KiB)
    assert second.offset == KiB  # not at 0, where `kept` still shows its bytes
    second.bytes().fill_(0)
    with pytest.raises(OverloadedError):
        await pool.acquire(KiB, timeout=1.0)
    got = trio.Event()

    async def next_request() -> None:
        async with pool.reserve(KiB) as later:
            assert later.offset == 0
            later.bytes().fill_(0)
            got.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(next_request)
        await trio.testing.wait_all_tasks_blocked()
        assert not got.is_set() and pool.statistics().waiters == 1
        assert torch.equal(kept, torch.full((KiB // 4,), 7.0))
        del kept  # the last view: the range goes back, the waiter is served
        with trio.fail_after(5):
            await got.wait()
    second.release()
    assert_idle(pool)


async def test_a_dropped_slot_whose_view_is_kept_counts_a_leak_and_frees_with_the_view(
        caplog: pytest.LogCaptureFixture) -> None:
    pool = EmbeddingPool(KiB)
    slot = await pool.acquire(512)
    kept = slot.bytes()
    kept.fill_(3)
    with caplog.at_level(logging.WARNING, logger="epd_trio.client.pool"):
        del slot
        gc.collect()
        await trio.testing.wait_all_tasks_blocked()
    s = pool.statistics()
    assert (s.leaked, s.slots, s.used_bytes, s.view_held) == (1, 1, 512, 1), s
    async with pool.reserve(512) as second:  # the other half: it never overlaps `kept`
        second.bytes().fill_(9)
        assert second.offset == 512
    assert bool((kept == 3).all())
    del kept
    await trio.testing.wait_all_tasks_blocked()
    assert_idle(pool)
    assert "never released" in caplog.text


async def test_a_view_that_dies_in_another_thread_frees_its_range_in_the_trio_loop() -> None:
    pool = EmbeddingPool(KiB)
    slot = await pool.acquire(KiB)
    box = [slot.view(torch.int32, (4,), offset=64)]
    slot.release()
    assert pool.statistics().used_bytes == KiB
    await trio.to_thread.run_sync(box.clear)  # the view's last reference dies over there
    with trio.fail_after(5):
        while pool.statistics().used_bytes:
            await trio.lowlevel.checkpoint()
    assert_idle(pool)


async def test_first_fit_reuses_holes_and_merges_neighbours() -> None:
    pool = EmbeddingPool(4 * ALIGNMENT)
    a, b, c, d = [await pool.acquire(ALIGNMENT) for _ in range(4)]
    b.release()
    c.release()
    # b and c merged into one hole of two units, which is the first that fits
    e = await pool.acquire(2 * ALIGNMENT)
    assert e.offset == ALIGNMENT
    a.release()
    f = await pool.acquire(ALIGNMENT)
    assert f.offset == 0
    for s in (d, e, f):
        s.release()
    whole = await pool.acquire(4 * ALIGNMENT)  # everything merged back into one range
    assert whole.offset == 0
    whole.release()
    assert_idle(pool)


async def test_too_large_fails_at_once_as_a_request_error() -> None:
    pool = EmbeddingPool(KiB)
    with trio.testing.assert_no_checkpoints():
        with pytest.raises(PayloadTooLargeError, match="never fit") as info:
            await pool.acquire(KiB + 1)
    assert isinstance(info.value, RequestError) and info.value.status_code == 413
    slot = await pool.acquire(KiB)  # exactly the capacity fits
    slot.release()
    with pytest.raises(ValueError):
        await pool.acquire(-1)
    assert_idle(pool)


async def _take(pool: EmbeddingPool, nbytes: int, log: list[tuple[str, float]], name: str,
                hold: float) -> None:
    async with pool.reserve(nbytes):
        log.append((name, trio.current_time()))
        await trio.sleep(hold)


async def test_fifo_a_large_waiter_is_not_overtaken(autojump_clock: trio.testing.MockClock) -> None:
    pool = EmbeddingPool(1024)
    granted: list[tuple[str, float]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_take, pool, 768, granted, "first", 10.0)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(_take, pool, 512, granted, "large", 1.0)
        await trio.testing.wait_all_tasks_blocked()
        # 256 bytes are free, enough for each small one, but the large one is first in line.
        for i in range(3):
            nursery.start_soon(_take, pool, 256, granted, f"small{i}", 1.0)
            await trio.testing.wait_all_tasks_blocked()
        s = pool.statistics()
        assert (s.waiters, s.waiting_bytes, s.used_bytes) == (4, 512 + 3 * 256, 768)
    # (tasks woken in the same tick run in any order: compare times, not list order)
    assert dict(granted) == {"first": 0.0, "large": 10.0, "small0": 10.0, "small1": 10.0,
                             "small2": 11.0}
    assert_idle(pool)


async def test_no_starvation_under_a_stream_of_small_requests(
        autojump_clock: trio.testing.MockClock) -> None:
    """Small requests keep arriving every 0.5 s, each holding 1 s; the large one waits
    only for those admitted before it, never for the ones that came after."""
    pool = EmbeddingPool(1024)
    granted: list[tuple[str, float]] = []
    async with trio.open_nursery() as nursery:
        for i in range(20):
            if i == 4:
                nursery.start_soon(_take, pool, 1024, granted, "large", 1.0)
                await trio.testing.wait_all_tasks_blocked()  # queued before s4
            nursery.start_soon(_take, pool, 256, granted, f"s{i}", 1.0)
            await trio.sleep(0.5)
    times = dict(granted)
    # s0..s3 were admitted on arrival; the large one (t=2.0) needs the whole pool, so it
    # waits for s3 (granted at 1.5) to release at 2.5 -- and for nothing that came later.
    assert times["large"] == 2.5
    # nothing queued behind the large one ran before it
    assert all(times[f"s{i}"] >= 3.5 for i in range(4, 20))
    assert_idle(pool)


async def test_cancelling_the_head_waiter_admits_the_next(
        autojump_clock: trio.testing.MockClock) -> None:
    pool = EmbeddingPool(1024)
    holder = await pool.acquire(768)
    granted: list[tuple[str, float]] = []
    async with trio.open_nursery() as nursery:
        large_scope = trio.CancelScope()

        async def large() -> None:
            with large_scope:
                await _take(pool, 512, granted, "large", 1.0)
        nursery.start_soon(large)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(_take, pool, 128, granted, "small", 1.0)
        await trio.testing.wait_all_tasks_blocked()
        assert pool.statistics().waiters == 2 and granted == []
        await trio.sleep(3)
        large_scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert granted == [("small", 3.0)]  # admitted by the cancellation, not by a release
        assert pool.statistics().waiters == 0
    holder.release()
    assert_idle(pool)


async def test_cancelling_a_waiter_in_the_middle_keeps_the_order(
        autojump_clock: trio.testing.MockClock) -> None:
    pool = EmbeddingPool(1024)
    holder = await pool.acquire(768)
    granted: list[tuple[str, float]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_take, pool, 512, granted, "head", 1.0)
        await trio.testing.wait_all_tasks_blocked()
        middle_scope = trio.CancelScope()

        async def middle() -> None:
            with middle_scope:
                await _take(pool, 1024, granted, "middle", 1.0)
        nursery.start_soon(middle)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(_take, pool, 128, granted, "tail", 1.0)
        await trio.testing.wait_all_tasks_blocked()
        middle_scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        s = pool.statistics()
        assert (s.waiters, s.waiting_bytes) == (2, 512 + 128) and granted == []
        await trio.sleep(2)
        holder.release()
    assert dict(granted) == {"head": 2.0, "tail": 2.0}
    assert_idle(pool)


async def test_a_wait_has_a_deadline(autojump_clock: trio.testing.MockClock) -> None:
    pool = EmbeddingPool(1024)
    holder = await pool.acquire(1024)
    with pytest.raises(OverloadedError, match=r"within 2.5 s"):
        await pool.acquire(1, timeout=2.5)
    assert trio.current_time() == 2.5
    assert pool.statistics().waiters == 0
    with trio.move_on_after(1.0):
        await pool.acquire(1)
    assert trio.current_time() == 3.5
    assert pool.statistics().waiters == 0
    holder.release()
    assert_idle(pool)


async def test_cancelled_before_waiting_takes_nothing() -> None:
    pool = EmbeddingPool(1024)
    with trio.CancelScope() as scope:
        scope.cancel()
        await pool.acquire(8)
        pytest.fail("a cancelled acquire must raise")
    assert_idle(pool)
    assert pool.statistics().acquired == 0


async def test_a_reserve_block_releases_on_error() -> None:
    pool = EmbeddingPool(1024)
    with pytest.raises(KeyError):
        async with pool.reserve(100):
            raise KeyError("boom")
    assert_idle(pool)


async def test_a_forgotten_slot_is_reclaimed_by_the_gc_backstop(
        caplog: pytest.LogCaptureFixture) -> None:
    pool = EmbeddingPool(1024)
    slot = await pool.acquire(1024)
    done = trio.Event()

    async def waiter() -> None:
        async with pool.reserve(512):
            done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert pool.statistics().waiters == 1
        with caplog.at_level(logging.WARNING, logger="epd_trio.client.pool"):
            del slot
            gc.collect()
            with trio.fail_after(5):
                await done.wait()  # the reclaimed memory admitted the waiter
    s = pool.statistics()
    assert (s.leaked, s.released, s.acquired) == (1, 1, 2)
    assert "never released" in caplog.text
    assert_idle(pool)


def test_a_forgotten_slot_outside_a_run_is_reclaimed_directly() -> None:
    pool = EmbeddingPool(1024)
    slot = trio.run(pool.acquire, 100)
    assert pool.statistics().slots == 1
    del slot
    gc.collect()
    s = pool.statistics()
    assert (s.slots, s.used_bytes, s.leaked) == (0, 0, 1)


async def test_repr_shows_the_statistics() -> None:
    pool = EmbeddingPool(1000)
    async with pool.reserve(10) as slot:
        assert repr(pool) == ("<EmbeddingPool used 64/1024 bytes in 1 slots, 0 waiting (0 bytes),"
                              " peak 64, leaked 0>")
        assert "held" in repr(slot)
    assert "released" in repr(slot)
