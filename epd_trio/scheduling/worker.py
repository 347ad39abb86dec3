"""The device worker: one batched forward, run in a dedicated thread.

``forward`` blocks; the scheduler calls it through ``trio.to_thread.run_sync``
with a ``CapacityLimiter(1)`` per device, so one forward runs per device at a
time. On CUDA it uses its own stream, copies inputs host→device without
blocking, copies the output into pinned host memory and synchronizes an event
before returning: a result handed back is always fully written, so delivery
(ZMQ, Mooncake) can never read an unfinished buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from epd_trio.errors import EncodeError
from epd_trio.model.adapters import PreprocessResult
from epd_trio.model.loader import LoadedEncoder

__all__ = ["EncoderWorker", "WorkerStatistics"]


@dataclass(frozen=True)
class WorkerStatistics:
    device: str
    forwards: int
    items: int
    busy_seconds: float


class EncoderWorker:
    """Runs batches through one device's copy of the encoder."""

    def __init__(self, encoder: LoadedEncoder) -> None:
        import torch

        self.encoder = encoder
        self.device = torch.device(encoder.device)
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._forwards = self._items = 0
        self._busy = 0.0

    def forward(self, payloads: Sequence[PreprocessResult]) -> list[Any]:
        """Encode several requests in one forward; one output tensor per request."""
        import time

        import torch

        started = time.perf_counter()
        adapter = self.encoder.adapter
        inputs = adapter.collate(payloads)
        stream_ctx = torch.cuda.stream(self._stream) if self._cuda else nullcontext()
        with torch.inference_mode(), stream_ctx:
            inputs = {k: self._to_device(v) for k, v in inputs.items()}
            output = adapter.forward(self.encoder.module, inputs)
            host = self._to_host(output)
        sizes = [p.tokens for p in payloads]
        if host.shape[0] != sum(sizes):
            raise EncodeError(f"encoder produced {host.shape[0]} tokens, expected {sum(sizes)}")
        self._forwards += 1
        self._items += sum(len(p.token_counts) for p in payloads)
        self._busy += time.perf_counter() - started
        # Row slices of a contiguous tensor are contiguous views: no copies.
        return list(torch.split(host, sizes))

    def _to_device(self, tensor: Any) -> Any:
        if not self._cuda:
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _to_host(self, output: Any) -> Any:
        import torch

        if not self._cuda:
            return output.contiguous()
        host = torch.empty(output.shape, dtype=output.dtype, pin_memory=True)
        host.copy_(output, non_blocking=True)
        event = torch.cuda.Event()
        event.record(self._stream)
        event.synchronize()  # the bytes are on the host before anyone may read them
        return host

    def statistics(self) -> WorkerStatistics:
        return WorkerStatistics(str(self.device), self._forwards, self._items, self._busy)
