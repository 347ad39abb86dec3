"""The worker's CUDA path on a fake ``torch.cuda`` (no GPU here; tests/test_gpu.py runs it for real).

What must hold on a device: the weights are settled before the worker's
non-blocking stream may read them; a forward, from whatever pooled thread runs
it, selects its device, then its own stream; inputs go host→device from pinned
memory without blocking; the output comes back into a pinned buffer, and an
event recorded on the stream after that copy is synchronized before the
forward returns, so nothing downstream can see an unwritten buffer.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from epd_trio.model.adapters import PreprocessResult
from epd_trio.model.loader import LoadedEncoder
from epd_trio.scheduling.worker import EncoderWorker


class FakeCuda:
    """Stands in for the parts of torch.cuda (and pinned tensors) the worker uses; logs each call."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.local = threading.local()  # the current device and stream are per thread, as in CUDA
        self.pinned: list[torch.Tensor] = []

    def current(self) -> tuple[Any, Any]:
        return getattr(self.local, "device", None), getattr(self.local, "stream", None)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        fake = self

        class Stream:
            def __init__(self, device: Any = None, priority: int = 0) -> None:
                self.device = torch.device(device)
                fake.log.append(("new stream", str(self.device)))

        class Event:
            def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
                self.blocking = blocking

            def record(self, stream: Any = None) -> None:
                fake.log.append(("record", stream, "blocking" if self.blocking else "spinning"))

            def synchronize(self) -> None:
                fake.log.append(("synchronize event",))

        @contextmanager
        def device(dev: Any) -> Iterator[None]:
            before = getattr(fake.local, "device", None)
            fake.local.device = str(dev)
            fake.log.append(("enter device", str(dev)))
            try:
                yield
            finally:
                fake.local.device = before
                fake.log.append(("exit device", str(dev)))

        @contextmanager
        def stream(s: Any) -> Iterator[None]:
            before = getattr(fake.local, "stream", None)
            fake.local.stream = s
            fake.log.append(("enter stream", s))
            try:
                yield
            finally:
                fake.local.stream = before
                fake.log.append(("exit stream", s))

        real_to, real_copy, real_empty = torch.Tensor.to, torch.Tensor.copy_, torch.empty

        def pin_memory(self: torch.Tensor, *args: Any) -> torch.Tensor:
            fake.log.append(("pin", *fake.current()))
            return self.clone()

        def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if args and isinstance(args[0], torch.device) and args[0].type == "cuda":
                fake.log.append(("host to device", str(args[0]), kwargs.get("non_blocking", False),
                                 *fake.current()))
                return self
            return real_to(self, *args, **kwargs)

        def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
            if any(self is p for p in fake.pinned):
                fake.log.append(("device to host", non_blocking, *fake.current()))
            return real_copy(self, src)

        def empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
            out = real_empty(*args, **kwargs)
            if pin_memory:
                fake.pinned.append(out)
                fake.log.append(("pinned buffer", *fake.current()))
            return out

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "device", device)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "synchronize",
                            lambda dev=None: fake.log.append(("synchronize device", str(dev))))
        monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
        monkeypatch.setattr(torch.Tensor, "to", to)
        monkeypatch.setattr(torch.Tensor, "copy_", copy_)
        monkeypatch.setattr(torch, "empty", empty)


class DoublingAdapter:
    """Each request's rows, doubled; logs the device and stream the collate and forward ran under."""

    def __init__(self, fake: FakeCuda) -> None:
        self.fake = fake

    def collate(self, results: Sequence[PreprocessResult]) -> dict[str, torch.Tensor]:
        self.fake.log.append(("collate", *self.fake.current()))
        return {"x": torch.cat([r.inputs["x"] for r in results])}

    def forward(self, module: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        self.fake.log.append(("forward", *self.fake.current()))
        return inputs["x"] * 2


class CompilableModule:
    def __init__(self) -> None:
        self.compiled_with: dict[str, Any] | None = None

    def compile(self, **kwargs: Any) -> None:
        self.compiled_with = kwargs


def encoder(adapter: Any, device: str, module: Any = None) -> LoadedEncoder:
    return LoadedEncoder(adapter=adapter, module=module, processors={}, model_dir=Path("."),
                         device=device, dtype=torch.float32, random_weights=True)


def payload(value: float, rows: int) -> PreprocessResult:
    return PreprocessResult("image", {"x": torch.full((rows, 3), value)}, ((1, 2, 2),), (rows,))


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    fake.install(monkeypatch)
    return fake


def test_a_cuda_worker_settles_the_weights_before_its_stream_reads_them(fake_cuda: FakeCuda) -> None:
    worker = EncoderWorker(encoder(DoublingAdapter(fake_cuda), "cuda:1"))
    assert fake_cuda.log == [("new stream", "cuda:1"), ("synchronize device", "cuda:1")]
    assert worker._stream is not None and worker._stream.device == torch.device("cuda:1")


def test_a_forward_uses_its_device_and_stream_and_waits_for_the_copy_out(fake_cuda: FakeCuda) -> None:
    worker = EncoderWorker(encoder(DoublingAdapter(fake_cuda), "cuda:1"))
    stream = worker._stream
    fake_cuda.log.clear()
    with ThreadPoolExecutor(1) as pool:  # a pooled thread, as trio.to_thread runs forwards
        out = pool.submit(worker.forward, [payload(1.0, 2), payload(3.0, 1)]).result()

    on = ("cuda:1", stream)
    assert fake_cuda.log == [
        ("enter device", "cuda:1"),
        ("enter stream", stream),
        ("collate", *on),  # on the stream: device-preprocessed inputs are cat there
        ("pin", *on), ("host to device", "cuda:1", True, *on),
        ("forward", *on),
        ("pinned buffer", *on), ("device to host", True, *on),
        ("record", stream, "blocking"),  # after the copy out, on the worker's own stream
        ("synchronize event",),  # before the forward returns
        ("exit stream", stream),
        ("exit device", "cuda:1"),
    ]
    (buffer,) = fake_cuda.pinned
    assert [t.tolist() for t in out] == [[[2.0] * 3] * 2, [[6.0] * 3]]
    for t in out:  # views of the pinned buffer: no copy after the synchronized one
        assert t.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    assert worker.statistics().forwards == 1


def test_a_failed_forward_leaves_the_thread_on_its_own_device_and_stream(fake_cuda: FakeCuda) -> None:
    adapter = DoublingAdapter(fake_cuda)

    def crash(module: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    adapter.forward = crash  # type: ignore[method-assign]
    worker = EncoderWorker(encoder(adapter, "cuda:1"))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        worker.forward([payload(1.0, 2)])
    assert fake_cuda.current() == (None, None)
    assert not fake_cuda.pinned  # no buffer was handed out


def test_compile_is_set_up_lazily_with_dynamic_shapes() -> None:
    module = CompilableModule()
    worker = EncoderWorker(encoder(None, "cpu", module), compile=True)
    # Only wrapped here; compiling happens at the first forward, in the worker thread.
    assert worker.compiled and module.compiled_with == {"dynamic": True}
