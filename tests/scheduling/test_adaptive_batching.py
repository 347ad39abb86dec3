"""The scheduler with the adaptive cap, on simulated devices whose forwards take virtual time.

The forward runs inline and ``run_sync`` sleeps what the device model says the
batch costs, so under ``MockClock`` the scheduler measures exact forward times
and the whole run's virtual time is the sum of its forwards' costs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import trio
import trio.testing

from epd_trio.model.adapters import PreprocessResult
from epd_trio.scheduling.batch_cap import BatchCapSettings
from epd_trio.scheduling.policy import BatchPolicy
from epd_trio.scheduling.scheduler import Scheduler

Cost = Callable[[int, int], float]  # (requests, tokens) → seconds
ITEM = 256


def cpu(n: int, tokens: int) -> float:
    """Per image 0.2025 s alone, 3.4% more per image for each more in the batch."""
    return tokens / ITEM * 0.2025 * (1 + 0.0343 * (n - 1))


def gpu(n: int, tokens: int) -> float:
    """Fixed 20 ms until ~2000 tokens saturate the device."""
    return max(0.02, tokens * 1e-5)


class SimulatedDevice:
    """Records each forward's request ids; ``run_sync`` takes the model's cost in virtual time."""

    def __init__(self, costs: dict[str, Cost]) -> None:
        self.costs = costs
        self.batches: list[tuple[str, list[int]]] = []

    def forward(self, payloads: Sequence[PreprocessResult]) -> list[int]:
        ids = [int(p.inputs["id"]) for p in payloads]
        self.batches.append((payloads[0].modality, ids))
        return ids

    async def run_sync(self, fn: Callable[..., Any], payloads: Sequence[PreprocessResult]) -> Any:
        cost = self.costs[payloads[0].modality]
        await trio.sleep(cost(len(payloads), sum(p.tokens for p in payloads)))
        return fn(payloads)

    def sizes(self, modality: str = "image") -> list[int]:
        return [len(ids) for m, ids in self.batches if m == modality]


def request(ident: int, modality: str = "image", tokens: int = ITEM) -> PreprocessResult:
    return PreprocessResult(modality, {"id": torch.tensor(ident)}, ((1, 2, tokens),), (tokens,))


async def serve(device: SimulatedDevice, *, learn: bool, callers: dict[str, int], requests: int,
                max_batch_size: int = 8) -> Scheduler:
    """``callers[modality]`` concurrent callers per modality share ``requests`` each, one at a time."""
    scheduler = Scheduler(device.forward, BatchPolicy(max_batch_size=max_batch_size),
                          batch_learning=BatchCapSettings() if learn else None)
    scheduler.run_sync = device.run_sync
    ids = itertools.count()

    async def caller(modality: str, work: Any) -> None:
        for _ in work:
            ident = next(ids)
            with scheduler.admit():
                assert await scheduler.submit(request(ident, modality)) == ident

    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        async with trio.open_nursery() as clients:
            for modality, count in callers.items():
                work = iter(range(requests))  # shared by the modality's callers
                for _ in range(count):
                    clients.start_soon(caller, modality, work)
        nursery.cancel_scope.cancel()
    return scheduler


async def test_where_batches_cost_throughput_requests_run_alone(
        autojump_clock: trio.testing.MockClock) -> None:
    device = SimulatedDevice({"image": cpu})
    t0 = trio.current_time()
    scheduler = await serve(device, learn=True, callers={"image": 16}, requests=64)
    elapsed = trio.current_time() - t0
    sizes = device.sizes()
    assert sizes == [1, 1, 1, 2, 2, 2] + [1] * 55  # one probe of pairs, then alone
    assert elapsed == pytest.approx(sum(cpu(n, n * ITEM) for n in sizes))
    assert elapsed == pytest.approx(64 * 0.2025 + 3 * 2 * 0.2025 * 0.0343)  # 0.3% over the best
    assert scheduler.statistics().batch_token_caps == {"image": 256}
    learned = scheduler.batch_learning()["image"]
    assert (learned.cap_tokens, learned.probing, learned.forwards, learned.batch_size) == (256, None, 61, 1.0)


async def test_the_fixed_ceiling_loses_there(autojump_clock: trio.testing.MockClock) -> None:
    """The same load with adaptation off: batches of 8, 24% slower per image."""
    device = SimulatedDevice({"image": cpu})
    t0 = trio.current_time()
    scheduler = await serve(device, learn=False, callers={"image": 16}, requests=64)
    elapsed = trio.current_time() - t0
    assert device.sizes() == [8] * 8
    assert elapsed == pytest.approx(8 * cpu(8, 8 * ITEM))
    assert elapsed > 1.2 * 64 * 0.2025
    assert scheduler.statistics().batch_token_caps == {} and scheduler.batch_learning() == {}


async def test_where_batches_pay_the_cap_climbs_to_the_ceiling(
        autojump_clock: trio.testing.MockClock) -> None:
    device = SimulatedDevice({"image": gpu})
    scheduler = await serve(device, learn=True, callers={"image": 16}, requests=128)
    sizes = device.sizes()
    assert sizes[:12] == [1, 1, 1, 2, 2, 2, 4, 4, 4, 8, 8, 8]
    assert sizes[12:] == [8] * 10 + [3]  # the probe past max_batch_size found nothing to add
    assert scheduler.statistics().batch_token_caps == {"image": 2048}


async def test_each_modality_learns_its_own_and_order_is_kept(
        autojump_clock: trio.testing.MockClock) -> None:
    """Images pay nothing for batching here, audio does; requests of a modality run in the order
    they were queued (the oldest always first), whatever the caps."""
    device = SimulatedDevice({"image": cpu, "audio": gpu})
    scheduler = await serve(device, learn=True, callers={"image": 8, "audio": 8}, requests=48)
    assert scheduler.statistics().batch_token_caps == {"image": 256, "audio": 2048}
    assert device.sizes("image")[-10:] == [1] * 10 and device.sizes("audio")[-3:] == [8, 8, 3]
    for modality in ("image", "audio"):
        order = [i for m, ids in device.batches if m == modality for i in ids]
        assert order == sorted(order) and len(order) == 48


async def test_solo_modalities_have_no_learner(autojump_clock: trio.testing.MockClock) -> None:
    device = SimulatedDevice({"video": cpu})
    scheduler = await serve(device, learn=True, callers={"video": 4}, requests=8)
    assert device.sizes("video") == [1] * 8 and scheduler.batch_learning() == {}
