"""The thread lane: trio.to_thread's semantics (without abandon) on threads of its own."""

from __future__ import annotations

import threading

import pytest
import trio

from epd_trio.scheduling.lane import open_thread_lane


def lane_threads(name: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(name + "-") and t.is_alive()]


async def test_runs_on_its_own_threads_and_gives_results_and_errors() -> None:
    def boom() -> None:
        raise ValueError("boom")

    async with open_thread_lane("lane-a", 2) as lane:
        names = {await lane.run_sync(lambda: threading.current_thread().name) for _ in range(8)}
        assert names <= {"lane-a-0", "lane-a-1"} and names
        assert await lane.run_sync(sum, [1, 2, 3]) == 6
        with pytest.raises(ValueError, match="boom"):
            await lane.run_sync(boom)
        assert len(lane_threads("lane-a")) == 2
    assert lane_threads("lane-a") == []  # the threads end with the block


async def test_its_threads_are_its_bound() -> None:
    running, most = 0, 0
    lock, release = threading.Lock(), threading.Event()

    def job() -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        release.wait(10)
        with lock:
            running -= 1

    async with open_thread_lane("lane-b", 2) as lane, trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(lane.run_sync, job)
        await trio.sleep(0.2)
        assert most == 2
        release.set()
    assert most == 2


async def test_a_job_cancelled_while_it_waits_never_runs() -> None:
    release, ran = threading.Event(), []
    async with open_thread_lane("lane-c", 1) as lane, trio.open_nursery() as nursery:
        nursery.start_soon(lane.run_sync, release.wait, 10)  # holds the one thread
        await trio.sleep(0.05)
        with trio.move_on_after(0.1) as waited:
            await lane.run_sync(ran.append, "queued")
        assert waited.cancelled_caught
        release.set()
        assert await lane.run_sync(lambda: "after") == "after"  # the thread went on past it
    assert ran == []


async def test_a_running_job_is_waited_for_then_cancelled() -> None:
    """A forward cannot be interrupted: the caller's cancellation waits for the job's end."""
    started, release, finished = threading.Event(), threading.Event(), []

    def job() -> str:
        started.set()
        release.wait(10)
        finished.append(True)
        return "done"

    scope = trio.CancelScope()
    checked = []

    async def cancel_when_running() -> None:
        await trio.to_thread.run_sync(started.wait, 10)
        scope.cancel()
        await trio.sleep(0.1)
        checked.append(finished == [])  # the caller still waits for the job
        release.set()

    async with open_thread_lane("lane-d", 1) as lane, trio.open_nursery() as nursery:
        nursery.start_soon(cancel_when_running)
        with scope:
            await lane.run_sync(job)
            await trio.sleep_forever()  # the pending cancellation lands here
    assert scope.cancelled_caught and checked == [True] and finished == [True]


def test_a_lane_needs_a_thread() -> None:
    async def main() -> None:
        async with open_thread_lane("lane-e", 0):
            pass

    with pytest.raises(ValueError, match="at least one thread"):
        trio.run(main)


async def test_close_is_bounded_by_a_job_that_still_runs() -> None:
    release = threading.Event()
    async with open_thread_lane("lane-f", 1) as lane, trio.open_nursery() as nursery:
        nursery.start_soon(lane.run_sync, release.wait, 10)
        await trio.sleep(0.05)
        assert lane.close(0.05) is False  # the job holds its thread past the timeout
        release.set()
    assert lane_threads("lane-f") == []  # the sentinel ended it once the job was done
