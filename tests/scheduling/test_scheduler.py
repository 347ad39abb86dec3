"""The scheduler loop with a scripted fake forward (no model)."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import pytest
import torch
import trio
import trio.testing

from epd_trio.errors import EncodeError, NotReadyError, OverloadedError
from epd_trio.model.adapters import PreprocessResult
from epd_trio.scheduling.policy import BatchPolicy
from epd_trio.scheduling.scheduler import Scheduler


def payload(value: float, tokens: int = 2, modality: str = "image", poison: bool = False) -> PreprocessResult:
    inputs = {"x": torch.full((tokens, 3), value)}
    if poison:
        inputs["poison"] = torch.ones(1)
    return PreprocessResult(modality, inputs, ((1, 2, tokens),), (tokens,))


# Real-time bounds, never reached by a passing test: a failing one must not hang.
GATE_TIMEOUT = 30.0
ENTER_TIMEOUT = 10.0


class FakeForward:
    """Doubles its inputs; can be held mid-forward, poisoned, and given a device
    memory budget (``oom_tokens``) that a forward of more tokens runs out of.

    It runs in the scheduler's worker thread and tells the trio side of each
    forward it enters (``wait_entered``), so the tests wait on events, not polls.
    """

    def __init__(self) -> None:
        self.batches: list[list[float]] = []
        self._gate = threading.Condition()
        self._open = True  # closed: forwards wait until opened, or one ``step``
        self._steps = 0
        self._entered_send, self.entered = trio.open_memory_channel[list[float]](math.inf)
        self.oom_tokens: int | None = None

    def hold(self) -> None:
        with self._gate:
            self._open = False

    def release(self) -> None:
        with self._gate:
            self._open = True
            self._gate.notify_all()

    def step(self) -> None:
        """Exactly one held forward may go on."""
        with self._gate:
            self._steps += 1
            self._gate.notify_all()

    def _pass_gate(self) -> None:
        with self._gate:
            if not self._gate.wait_for(lambda: self._open or self._steps, timeout=GATE_TIMEOUT):
                raise AssertionError("a held forward was never released")
            if not self._open:
                self._steps -= 1

    def __call__(self, payloads: Sequence[PreprocessResult]) -> list[torch.Tensor]:
        batch = [float(p.inputs["x"][0, 0]) for p in payloads]
        self.batches.append(batch)
        trio.from_thread.run_sync(self._entered_send.send_nowait, batch)
        self._pass_gate()
        if any("poison" in p.inputs for p in payloads):
            raise RuntimeError("poisoned input")
        if self.oom_tokens is not None and sum(p.tokens for p in payloads) > self.oom_tokens:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return [p.inputs["x"] * 2 for p in payloads]


async def started(policy: BatchPolicy = BatchPolicy(max_batch_size=4), **kw) -> tuple[Scheduler, FakeForward]:
    fake = FakeForward()
    return Scheduler(fake, policy, **kw), fake


async def encode(s: Scheduler, p: PreprocessResult) -> torch.Tensor:
    with s.admit():
        return await s.submit(p)


async def wait_entered(fake: FakeForward) -> list[float]:
    """The next forward the fake entered (its batch); bounded."""
    with trio.fail_after(ENTER_TIMEOUT):
        return await fake.entered.receive()


async def test_batches_what_queued_during_a_forward(nursery: trio.Nursery) -> None:
    s, fake = await started()
    await nursery.start(s.run)
    fake.hold()
    results: dict[float, torch.Tensor] = {}

    async def call(v: float) -> None:
        results[v] = await encode(s, payload(v))

    nursery.start_soon(call, 0.0)
    await wait_entered(fake)  # the first forward is running
    async with trio.open_nursery() as inner:
        for v in (1.0, 2.0, 3.0, 4.0, 5.0):
            inner.start_soon(call, v)
        await trio.testing.wait_all_tasks_blocked()
        fake.release()
    # trio starts tasks in no promised order: check sizes and membership
    assert [len(b) for b in fake.batches] == [1, 4, 1]
    assert sorted(v for b in fake.batches for v in b) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    await trio.testing.wait_all_tasks_blocked()  # the first caller (outer nursery) has its answer too
    assert sorted(results) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # every caller answered
    assert all(torch.equal(results[v], torch.full((2, 3), v * 2)) for v in results)
    stats = s.statistics()
    assert (stats.requests_done, stats.batches_run, stats.admitted, stats.queued) == (6, 3, 0, 0)


async def test_coalesce_delay_is_exact(autojump_clock: trio.testing.MockClock, nursery: trio.Nursery) -> None:
    s, fake = await started(BatchPolicy(max_batch_size=4, coalesce_delay=1.5))
    await nursery.start(s.run)
    t0 = trio.current_time()
    async with trio.open_nursery() as inner:
        inner.start_soon(encode, s, payload(1.0))
        await trio.sleep(1.0)
        inner.start_soon(encode, s, payload(2.0))
    assert trio.current_time() - t0 == 1.5
    assert fake.batches == [[1.0, 2.0]]


async def test_cancelled_waiting_caller_is_dropped_before_the_forward(nursery: trio.Nursery) -> None:
    s, fake = await started()
    await nursery.start(s.run)
    fake.hold()
    nursery.start_soon(encode, s, payload(0.0))
    await wait_entered(fake)
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as waiter:
            waiter.start_soon(encode, s, payload(1.0))
            await trio.testing.wait_all_tasks_blocked()
            assert s.statistics().queued == 1  # waiting behind the running forward
            scope.cancel()
    assert scope.cancelled_caught
    assert s.statistics().admitted == 1  # only the running one holds a slot now
    fake.release()
    out = await encode(s, payload(2.0))
    assert torch.equal(out, torch.full((2, 3), 4.0))
    assert fake.batches == [[0.0], [2.0]]
    assert s.statistics().requests_dropped == 1


async def test_a_cancelled_callers_payload_is_gone_at_once_even_mid_forward(nursery: trio.Nursery) -> None:
    """While a forward runs, callers that leave take their jobs (and payloads) with them:
    the queue, the only place the scheduler keeps jobs waiting, is empty at once."""
    s, fake = await started()
    await nursery.start(s.run)
    fake.hold()
    nursery.start_soon(encode, s, payload(0.0))
    await wait_entered(fake)  # the loop is in the forward: it takes nothing in meanwhile
    for v in (1.0, 2.0, 3.0):
        with trio.move_on_after(0):  # cancelled at its first wait
            await encode(s, payload(v))
    stats = s.statistics()
    assert (stats.queued, stats.requests_dropped, stats.running) == (0, 3, 1), stats
    fake.release()
    assert torch.equal(await encode(s, payload(4.0)), torch.full((2, 3), 8.0))
    assert fake.batches == [[0.0], [4.0]]


async def test_cancellation_churn_during_a_forward_never_refuses(nursery: trio.Nursery) -> None:
    """Admission frees a caller's slot the moment it leaves; its job must leave as promptly,
    or many admitted-then-cancelled callers during one forward overflow the queue (503)."""
    s, fake = await started(max_pending=2)
    await nursery.start(s.run)
    fake.hold()
    nursery.start_soon(encode, s, payload(0.0))
    await wait_entered(fake)
    for n in range(40):  # far more than max_pending (+ any headroom) jobs, one at a time
        with trio.move_on_after(0):
            await encode(s, payload(float(n)))
    assert s.statistics().queued == 0
    fake.release()
    assert torch.equal(await encode(s, payload(5.0)), torch.full((2, 3), 10.0))
    stats = s.statistics()
    assert (stats.requests_dropped, stats.requests_failed, stats.admitted) == (40, 0, 0), stats


async def test_cancelled_running_caller_leaves_batch_mates_intact(nursery: trio.Nursery) -> None:
    s, fake = await started()
    await nursery.start(s.run)
    fake.hold()
    nursery.start_soon(encode, s, payload(0.0))
    await wait_entered(fake)
    got: dict[str, torch.Tensor] = {}
    cancel_me = trio.CancelScope()

    async def victim() -> None:
        with cancel_me:
            await encode(s, payload(1.0))

    async def mate() -> None:
        got["mate"] = await encode(s, payload(2.0))

    async with trio.open_nursery() as inner:
        inner.start_soon(victim)
        inner.start_soon(mate)
        await trio.testing.wait_all_tasks_blocked()
        fake.hold()
        fake.step()  # only the first batch may finish; [1, 2] starts and is held
        await wait_entered(fake)
        cancel_me.cancel()  # while [1, 2] runs
        await trio.testing.wait_all_tasks_blocked()
        fake.release()
    assert fake.batches[0] == [0.0] and sorted(fake.batches[1]) == [1.0, 2.0]
    assert torch.equal(got["mate"], torch.full((2, 3), 4.0))
    stats = s.statistics()
    assert (stats.requests_dropped, stats.requests_done, stats.admitted) == (1, 2, 0)


async def test_full_queue_refuses_at_once(autojump_clock: trio.testing.MockClock) -> None:
    s, _ = await started(max_pending=2)
    with s.admit(), s.admit():
        t0 = trio.current_time()
        with pytest.raises(OverloadedError, match="full"):
            with s.admit():
                pass
        assert trio.current_time() == t0
        with s.admit(bypass=True):  # health probes are not counted against the bound
            assert s.statistics().admitted == 3
    assert s.statistics().admitted == 0


async def test_poisoned_item_fails_alone(nursery: trio.Nursery) -> None:
    s, fake = await started()
    await nursery.start(s.run)
    fake.hold()
    nursery.start_soon(encode, s, payload(0.0))
    await wait_entered(fake)
    results: dict[float, object] = {}

    async def call(v: float, poison: bool = False) -> None:
        try:
            results[v] = await encode(s, payload(v, poison=poison))
        except EncodeError as exc:
            results[v] = exc

    async with trio.open_nursery() as inner:
        inner.start_soon(call, 1.0)
        inner.start_soon(call, 2.0, True)
        inner.start_soon(call, 3.0)
        await trio.testing.wait_all_tasks_blocked()
        fake.release()
    batch = fake.batches[1]
    assert sorted(batch) == [1.0, 2.0, 3.0]
    assert fake.batches == [[0.0], batch, *([v] for v in batch)]  # retried one at a time
    assert torch.equal(results[1.0], torch.full((2, 3), 2.0))  # type: ignore[arg-type]
    assert torch.equal(results[3.0], torch.full((2, 3), 6.0))  # type: ignore[arg-type]
    assert isinstance(results[2.0], EncodeError) and "poisoned input" in str(results[2.0])
    stats = s.statistics()
    assert (stats.requests_failed, stats.batches_retried) == (1, 1)


async def test_out_of_device_memory_retries_singly_and_fails_alone_with_503(
        nursery: trio.Nursery) -> None:
    s, fake = await started()
    fake.oom_tokens = 6
    await nursery.start(s.run)
    fake.hold()
    nursery.start_soon(encode, s, payload(0.0))
    await wait_entered(fake)
    results: dict[float, object] = {}

    async def call(v: float, tokens: int) -> None:
        try:
            results[v] = await encode(s, payload(v, tokens=tokens))
        except OverloadedError as exc:
            results[v] = exc

    async with trio.open_nursery() as inner:
        for v, tokens in ((1.0, 2), (2.0, 8), (3.0, 2)):
            inner.start_soon(call, v, tokens)
        await trio.testing.wait_all_tasks_blocked()
        fake.release()
    batch = fake.batches[1]
    assert sorted(batch) == [1.0, 2.0, 3.0]  # 12 tokens: out of memory together
    assert fake.batches[2:] == [[v] for v in batch]  # then one at a time
    assert torch.equal(results[1.0], torch.full((2, 3), 2.0))  # type: ignore[arg-type]
    assert torch.equal(results[3.0], torch.full((2, 3), 6.0))  # type: ignore[arg-type]
    too_big = results[2.0]
    assert isinstance(too_big, OverloadedError) and too_big.status_code == 503
    assert "out of memory" in str(too_big)
    # The device is not dead: the next request runs on it.
    assert torch.equal(await encode(s, payload(4.0)), torch.full((2, 3), 8.0))
    stats = s.statistics()
    assert (stats.requests_failed, stats.batches_retried) == (1, 1)


async def test_stopping_fails_every_waiter() -> None:
    s, fake = await started()
    fake.hold()
    outcomes: dict[float, object] = {}

    async def call(v: float) -> None:
        try:
            outcomes[v] = await encode(s, payload(v))
        except NotReadyError as exc:
            outcomes[v] = exc

    async with trio.open_nursery() as outer:
        loop_scope = trio.CancelScope()

        async def loop() -> None:
            with loop_scope:
                await s.run()

        outer.start_soon(loop)
        outer.start_soon(call, 0.0)
        await wait_entered(fake)
        outer.start_soon(call, 1.0)  # queued behind the running forward
        await trio.testing.wait_all_tasks_blocked()
        loop_scope.cancel()
        fake.release()
    # the running forward cannot be interrupted: it finishes and delivers;
    # the queued request fails at once instead of hanging.
    assert torch.equal(outcomes[0.0], torch.full((2, 3), 0.0))  # type: ignore[arg-type]
    assert isinstance(outcomes[1.0], NotReadyError)
    with pytest.raises(NotReadyError):
        await encode(s, payload(2.0))
    assert s.statistics().admitted == 0


async def test_a_forward_that_miscounts_fails_its_requests_not_the_loop(nursery: trio.Nursery) -> None:
    """The forward is a replaceable hook: one that returns a wrong number of outputs fails the
    batch's requests as EncodeErrors (one at a time, as a failed batch), and the loop serves on."""
    s, fake = await started()
    real = fake.__call__
    short = [True]

    def miscounting(payloads: Sequence[PreprocessResult]) -> list[torch.Tensor]:
        out = real(payloads)
        return out[:-1] if short[0] else out

    s.forward = miscounting
    errors: list[BaseException] = []

    async def call(v: float) -> None:
        try:
            await encode(s, payload(v))
        except EncodeError as exc:
            errors.append(exc)

    await nursery.start(s.run)
    fake.hold()
    async with trio.open_nursery() as inner:
        inner.start_soon(call, 0.0)
        await wait_entered(fake)
        inner.start_soon(call, 1.0)
        inner.start_soon(call, 2.0)
        await trio.testing.wait_all_tasks_blocked()
        fake.release()
    assert fake.batches[1] in ([1.0, 2.0], [2.0, 1.0])  # a batch of two, then each alone
    assert len(errors) == 3 and all("returned 0 outputs for 1 requests" in str(e) for e in errors), errors
    short[0] = False
    assert torch.equal(await encode(s, payload(4.0)), torch.full((2, 3), 8.0))  # still serving
