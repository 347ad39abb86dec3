"""Data parallel over fake devices: least-pending dispatch, a dying device, re-dispatch."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch
import trio
import trio.testing

from epd_trio.errors import EncodeError, OverloadedError, WorkerDeadError
from epd_trio.model.adapters import PreprocessResult
from epd_trio.scheduling.dispatch import Admission, Dispatcher, JobNotRun
from epd_trio.scheduling.policy import BatchPolicy
from epd_trio.scheduling.scheduler import Scheduler
from epd_trio.scheduling.worker import WorkerStatistics

CUDA_CRASH = "CUDA error: an illegal memory access was encountered"


def payload(value: float) -> PreprocessResult:
    return PreprocessResult("image", {"x": torch.full((2, 3), value)}, ((1, 2, 2),), (2,))


class FakeDevice:
    """A worker whose forward doubles its inputs, can be held, and can be made to crash."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.batches: list[list[float]] = []
        self.hold = threading.Event()
        self.hold.set()
        self.crash: str | None = None

    def forward(self, payloads: Sequence[PreprocessResult]) -> list[torch.Tensor]:
        self.batches.append([float(p.inputs["x"][0, 0]) for p in payloads])
        self.hold.wait(timeout=10)  # bounded: a failing test must not hang its teardown
        if self.crash is not None:
            raise RuntimeError(self.crash)
        return [p.inputs["x"] * 2 for p in payloads]

    def statistics(self) -> WorkerStatistics:
        return WorkerStatistics(self.name, len(self.batches), sum(map(len, self.batches)), 0.0)

    def busy_fraction(self) -> float:
        return 0.0


def fleet(n: int = 2, max_pending: int = 16) -> tuple[Dispatcher, list[FakeDevice]]:
    devices = [FakeDevice(f"fake:{i}") for i in range(n)]
    admission = Admission(max_pending)
    schedulers = [Scheduler(d.forward, BatchPolicy(max_batch_size=4), max_pending=max_pending,
                            admission=admission, index=i) for i, d in enumerate(devices)]
    return Dispatcher(devices, schedulers), devices  # type: ignore[arg-type]


async def start(nursery: trio.Nursery, dispatcher: Dispatcher) -> None:
    for scheduler in dispatcher.schedulers:
        await nursery.start(scheduler.run)


async def settle(devices: list[FakeDevice], batches: int) -> None:
    """Wait (real time: threads) until the devices have started ``batches`` forwards in all."""
    with trio.fail_after(5):
        while sum(len(d.batches) for d in devices) < batches:
            await trio.sleep(0.001)
    await trio.testing.wait_all_tasks_blocked()


async def test_least_pending_spreads_load_and_admission_is_shared(nursery: trio.Nursery) -> None:
    dispatcher, devices = fleet(max_pending=3)
    await start(nursery, dispatcher)
    for d in devices:
        d.hold.clear()
    results: dict[float, torch.Tensor] = {}

    async def call(v: float) -> None:
        with dispatcher.schedulers[0].admit():
            results[v] = await dispatcher.submit(payload(v))

    for v in (1.0, 2.0, 3.0):
        nursery.start_soon(call, v)
    await settle(devices, 2)
    assert [len(d.batches) for d in devices] == [1, 1]  # both devices took one at once
    assert sorted(s.pending for s in dispatcher.schedulers) == [1, 2]
    with pytest.raises(OverloadedError):  # one bound for all devices: 3 admitted
        with dispatcher.schedulers[1].admit():
            pass
    for d in devices:
        d.hold.set()
    with trio.fail_after(5):
        while len(results) < 3:
            await trio.sleep(0.001)
    assert all(torch.equal(results[v], torch.full((2, 3), 2 * v)) for v in results)
    assert dispatcher.schedulers[0].admission.statistics().admitted == 0


async def test_sequential_requests_take_turns(nursery: trio.Nursery) -> None:
    dispatcher, devices = fleet(3)
    await start(nursery, dispatcher)
    for v in range(6):
        await dispatcher.submit(payload(float(v)))
    assert [len(d.batches) for d in devices] == [2, 2, 2]


async def test_a_dead_device_fails_its_batch_and_hands_back_its_queue(nursery: trio.Nursery) -> None:
    dispatcher, (dev0, dev1) = fleet()
    await start(nursery, dispatcher)
    dev0.hold.clear()
    dev1.hold.clear()
    outcomes: dict[float, object] = {}

    async def call(v: float) -> None:
        try:
            outcomes[v] = await dispatcher.submit(payload(v))
        except WorkerDeadError as exc:
            outcomes[v] = exc

    for v in (1.0, 2.0, 3.0, 4.0):  # one running and one queued on each device
        nursery.start_soon(call, v)
        await trio.testing.wait_all_tasks_blocked()
    await settle([dev0, dev1], 2)
    assert [s.pending for s in dispatcher.schedulers] == [2, 2]
    (running_on_1,) = dev1.batches[0]
    dev1.crash = CUDA_CRASH
    dev1.hold.set()
    with trio.fail_after(5):
        while running_on_1 not in outcomes:
            await trio.sleep(0.001)
    await trio.testing.wait_all_tasks_blocked()
    dead = dispatcher.schedulers[1]
    assert dead.dead is not None and "illegal memory access" in dead.dead
    failed = outcomes[running_on_1]
    # The request on the device when it died fails (the input may have killed it) ...
    assert type(failed) is WorkerDeadError and "during this request's forward" in str(failed)
    assert len(outcomes) == 1 and dispatcher.schedulers[0].pending == 3  # ... its queue moved over
    dev0.hold.set()
    with trio.fail_after(5):
        while len(outcomes) < 4:
            await trio.sleep(0.001)
    for v in (1.0, 2.0, 3.0, 4.0):
        if v != running_on_1:
            assert torch.equal(outcomes[v], torch.full((2, 3), 2 * v)), v  # type: ignore[arg-type]
    assert len(dev1.batches) == 1  # nothing ran there after it died
    stats = dead.statistics()
    assert (stats.dead, stats.redispatched, stats.requests_failed, stats.queued) == (True, 1, 1, 0)
    states = dispatcher.states()
    assert [s.state for s in states] == ["alive", "dead"] and "illegal memory" in (states[1].error or "")
    # Later requests go to the live device only; the dead one refuses at once.
    for v in (5.0, 6.0):
        assert torch.equal(await dispatcher.submit(payload(v)), torch.full((2, 3), 2 * v))
    assert len(dev1.batches) == 1
    with pytest.raises(JobNotRun):
        await dead.submit(payload(7.0))
    # With no device left, WorkerDeadError (503) at once.
    dev0.crash = "CUDA error: unspecified launch failure"
    with pytest.raises(WorkerDeadError, match="during this request's forward"):
        await dispatcher.submit(payload(8.0))
    with pytest.raises(WorkerDeadError, match="every device worker has failed"):
        await dispatcher.submit(payload(9.0))


async def test_input_errors_do_not_kill_a_device(nursery: trio.Nursery) -> None:
    dispatcher, (dev0,) = fleet(1)
    await start(nursery, dispatcher)
    dev0.crash = "shape mismatch"
    with pytest.raises(EncodeError, match="shape mismatch"):
        await dispatcher.submit(payload(1.0))
    dev0.crash = None
    assert torch.equal(await dispatcher.submit(payload(2.0)), torch.full((2, 3), 4.0))
    assert dispatcher.schedulers[0].dead is None
