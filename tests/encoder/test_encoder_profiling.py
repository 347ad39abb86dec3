"""The profiler under failure: what it cannot stop or write is logged, never raised."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from epd_trio.encoder.profiling import Profiler


class FailingProfile:
    """A torch profile whose stop fails as it does on CUDA once the device is in a failed state."""

    def __init__(self) -> None:
        self.steps = 0

    def start(self) -> None:
        pass

    def step(self) -> None:
        self.steps += 1

    def stop(self) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def export_chrome_trace(self, path: str) -> None:
        raise AssertionError("nothing to export")


async def test_a_profile_that_cannot_stop_by_itself_does_not_take_the_service_down(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("epd_trio.encoder.profiling._new_profile", FailingProfile)
    async with trio.open_nursery() as nursery:  # the service's nursery: a crash here ends it
        profiler = Profiler(str(tmp_path), nursery)
        profiler.start(num_steps=1)
        profiler.batch(0, 1, 4)  # the last step: stops by itself, in a task of that nursery
        await trio.testing.wait_all_tasks_blocked()
        assert not profiler.running
        profiler.start()  # a new one may start
        profiler.close()  # shutdown with a stop that fails: logged, not raised
    assert not profiler.running and profiler.statistics().traces_written == 0


@pytest.mark.parametrize("output_dir", ["x" * 300, "a-file", "a-file/below"])
async def test_an_output_dir_that_cannot_be_a_directory_is_a_400(tmp_path: Path, output_dir: str) -> None:
    from epd_trio.errors import RequestError

    (tmp_path / "a-file").write_text("an earlier trace")
    async with trio.open_nursery() as nursery:
        profiler = Profiler(str(tmp_path), nursery)
        with pytest.raises(RequestError, match="'output_dir' cannot be used as a directory") as info:
            profiler.start(output_dir)
        assert info.value.status_code == 400 and not profiler.running
        assert str(tmp_path) not in info.value.message  # the caller's words, not our paths
