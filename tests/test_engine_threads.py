"""The CPU thread budget: explicit, per thread, and overridable."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import png_bytes
from epd_trio.config import EngineConfig
from epd_trio.engine import open_engine
from epd_trio.engine.threads import ThreadBudget, thread_budget, with_torch_threads
from epd_trio.model.adapters import PreprocessResult
from epd_trio.model.loader import LoadedEncoder
from epd_trio.scheduling.worker import EncoderWorker


@pytest.mark.parametrize(
    ("devices", "cores", "cpu_threads", "expected"),
    [
        (("cpu",), 2, 0, ThreadBudget(2, 1)),
        (("cpu",), 16, 0, ThreadBudget(16, 1)),
        (("cpu", "cpu"), 16, 0, ThreadBudget(8, 1)),  # data parallel on CPU: the cores shared
        (("cpu", "cpu", "cpu"), 2, 0, ThreadBudget(1, 1)),  # never below one
        (("cpu",), 16, 3, ThreadBudget(3, 1)),  # an explicit count wins
        (("cuda:0",), 16, 0, ThreadBudget(None, 1)),  # a GPU forward keeps torch's default
        (("cuda:0", "cuda:1"), 16, 4, ThreadBudget(None, 1)),
    ],
)
def test_budget(devices: tuple[str, ...], cores: int, cpu_threads: int,
                expected: ThreadBudget) -> None:
    assert thread_budget(devices, cores, cpu_threads=cpu_threads) == expected


def test_preprocess_threads_are_overridable_and_checked() -> None:
    assert thread_budget(("cpu",), 4, preprocess_threads=2).preprocess == 2
    with pytest.raises(ValueError):
        thread_budget(("cpu",), 4, preprocess_threads=0)
    with pytest.raises(ValueError):
        EngineConfig(cpu_threads=-1)
    with pytest.raises(ValueError):
        EngineConfig(preprocess_threads=0)


def test_a_count_is_the_calling_threads_own() -> None:
    """One thread's budget does not change another running thread's, nor later threads'."""
    main = torch.get_num_threads()
    seen: list[int] = []

    def job() -> None:
        seen.append(with_torch_threads(1, torch.get_num_threads))
        seen.append(torch.get_num_threads())  # the thread's own count is back

    torch.set_num_threads(2)
    try:
        worker = threading.Thread(target=job)
        worker.start()
        worker.join()
        later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        later.start()
        later.join()
        # a thread started later is not left at the preprocessing count
        assert seen == [1, 2, 2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(main)  # new threads default to the last count set anywhere


class ThreadsSeenAdapter:
    """Records the torch thread count each forward ran with."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def collate(self, results: Sequence[PreprocessResult]) -> dict[str, torch.Tensor]:
        return {"x": torch.cat([r.inputs["x"] for r in results])}

    def forward(self, module: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        self.seen.append(torch.get_num_threads())
        return inputs["x"]


def test_a_cpu_forward_runs_with_its_budget_in_whatever_thread_runs_it() -> None:
    adapter = ThreadsSeenAdapter()
    worker = EncoderWorker(LoadedEncoder(adapter=adapter, module=None, processors={},
                                         model_dir=Path("."), device="cpu", dtype=torch.float32,
                                         random_weights=True), threads=1)
    item = PreprocessResult("image", {"x": torch.ones(2, 3)}, ((1, 2, 2),), (2,))
    main = torch.get_num_threads()
    try:
        with ThreadPoolExecutor(1) as pool:
            pool.submit(torch.set_num_threads, 3).result()  # a thread left at another count
            pool.submit(worker.forward, [item]).result()
        assert adapter.seen == [1] and torch.get_num_threads() == main
        with pytest.raises(ValueError):
            EncoderWorker(worker.encoder, threads=0)
    finally:
        torch.set_num_threads(main)


async def test_preprocessing_and_forwards_run_on_the_engines_own_thread_lanes(qwen25_path: str) -> None:
    """``open_engine`` gives preprocessing ``preprocess_workers`` threads and each device one
    (``scheduling.lane``), named for them, and ends them with its block."""
    seen: list[str] = []

    def lanes() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith(("epd-preprocess-", "epd-device"))]

    async with open_engine(model_path=qwen25_path, device="cpu,cpu", preprocess_workers=2) as engine:
        real = engine.preprocessor.preprocess

        def preprocess(*args: Any, **kwargs: Any) -> Any:
            seen.append(threading.current_thread().name)
            return real(*args, **kwargs)

        engine.preprocessor.preprocess = preprocess  # type: ignore[method-assign]
        await engine.encode([png_bytes(32, 32)], "image")
        device_threads = {await s.run_sync(lambda: threading.current_thread().name) for s in engine.schedulers}
        assert sorted(lanes()) == ["epd-device0-0", "epd-device1-0", "epd-preprocess-0", "epd-preprocess-1"]
    assert seen and seen[0].startswith("epd-preprocess-")
    assert device_threads == {"epd-device0-0", "epd-device1-0"}
    assert lanes() == []
