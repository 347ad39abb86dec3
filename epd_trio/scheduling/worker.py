"""The device worker: one batched forward, run in a dedicated thread.

``forward`` blocks; the scheduler calls it on the device's own thread lane
(``scheduling.lane``: one thread per device), so one forward runs per device at
a time. On CUDA it uses its own stream, copies inputs host→device from pinned
memory without blocking, copies the output into pinned host memory and
synchronizes an event before returning: a result handed back is always fully
written, so delivery (ZMQ, Mooncake) can never read an unfinished buffer.

Which forward failures mean the *device* is gone is ``failures.is_device_error``.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from epd_trio.errors import EncodeError
from epd_trio.model.adapters import PreprocessResult
from epd_trio.model.loader import LoadedEncoder

if TYPE_CHECKING:
    import torch

__all__ = ["EncoderWorker", "NullForwardWorker", "WorkerStatistics"]

# Forwards remembered for ``busy_fraction``: enough for a 10 s window at ~400 forwards/s.
_BUSY_HISTORY = 4096


@dataclass(frozen=True)
class WorkerStatistics:
    device: str
    forwards: int
    items: int
    busy_seconds: float


class EncoderWorker:
    """Runs batches through one device's copy of the encoder.

    ``compile=True`` wraps the module's forward in ``torch.compile`` (dynamic
    shapes: every image size would otherwise recompile); the first forwards of
    each new shape are slow while it compiles.
    """

    def __init__(self, encoder: LoadedEncoder, *, compile: bool = False,
                 threads: int | None = None) -> None:
        import torch

        self.encoder = encoder
        self.device = torch.device(encoder.device)
        # torch intra-op threads of each forward (None: leave the thread's own);
        # the engine's CPU budget (``engine/threads.py``) chooses it.
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        if self._cuda:
            # The weights were written on the device's default stream, and a
            # replica's by an asynchronous device-to-device copy (no host sync);
            # our stream is non-blocking (no implicit ordering with the default
            # stream), so its first forward could read them half-copied.
            torch.cuda.synchronize(self.device)
        if compile:
            encoder.module.compile(dynamic=True)
        self.compiled = compile
        self._forwards = self._items = 0
        self._busy = 0.0
        # (start, end) of recent forwards in perf_counter time, and the start of
        # the running one: written by the forward's thread, read by the trio thread.
        self._history: collections.deque[tuple[float, float]] = collections.deque(maxlen=_BUSY_HISTORY)
        self._running_since: float | None = None
        self._lock = threading.Lock()

    def forward(self, payloads: Sequence[PreprocessResult]) -> list[Any]:
        """Encode several requests in one forward; one output tensor per request."""
        import torch

        started = time.perf_counter()
        self._running_since = started
        try:
            if self.threads is not None and torch.get_num_threads() != self.threads:
                torch.set_num_threads(self.threads)  # this thread's own count (OpenMP, MKL)
            host = self._run(payloads)
            sizes = [p.tokens for p in payloads]
            if host.shape[0] != sum(sizes):
                raise EncodeError(f"encoder produced {host.shape[0]} tokens, expected {sum(sizes)}")
            self._forwards += 1
            self._items += sum(len(p.token_counts) for p in payloads)
        finally:
            ended = time.perf_counter()
            with self._lock:
                self._busy += ended - started
                self._history.append((started, ended))
                self._running_since = None
        # Row slices of a contiguous tensor are contiguous views: no copies.
        return list(torch.split(host, sizes))

    def _run(self, payloads: Sequence[PreprocessResult]) -> Any:
        """The batch's output rows, on the host and fully written."""
        import torch

        adapter = self.encoder.adapter
        with ExitStack() as stack:
            stack.enter_context(torch.inference_mode())
            if self._cuda:
                stack.enter_context(torch.cuda.device(self.device))
                stack.enter_context(torch.cuda.stream(self._stream))
            # Collated on this stream: with --preprocess-device cuda the inputs are
            # device tensors, and a cat on the default stream would race the forward.
            inputs = adapter.collate(payloads)
            inputs = {k: self._to_device(v) for k, v in inputs.items()}
            output = adapter.forward(self.encoder.module, inputs)
            return self._to_host(output)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device == self.device:
            return tensor  # --preprocess-device put it here already (its stream synchronized)
        if tensor.is_cuda or not self._cuda:  # another device's preprocessing
            return tensor.to(self.device)
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _to_host(self, output: torch.Tensor) -> torch.Tensor:
        import torch

        if not self._cuda:
            return output.contiguous()
        host = torch.empty(output.shape, dtype=output.dtype, pin_memory=True)
        host.copy_(output, non_blocking=True)
        # Blocking: the thread sleeps until the copy is done instead of spinning a
        # core that preprocessing (CPU-bound, on the same host) could use.
        event = torch.cuda.Event(blocking=True)
        event.record(self._stream)
        event.synchronize()  # the bytes are on the host before anyone may read them
        return host

    def busy_fraction(self, window: float = 10.0, now: float | None = None) -> float:
        """Share of the last ``window`` seconds spent in forwards (the running one included)."""
        now = time.perf_counter() if now is None else now
        since = now - window
        with self._lock:
            intervals = list(self._history)
            if self._running_since is not None:
                intervals.append((self._running_since, now))
        busy = sum(max(0.0, min(end, now) - max(start, since)) for start, end in intervals)
        return min(1.0, busy / window)

    def statistics(self) -> WorkerStatistics:
        return WorkerStatistics(str(self.device), self._forwards, self._items, self._busy)

    def __repr__(self) -> str:
        s = self.statistics()
        return f"<EncoderWorker {s.device}: {s.forwards} forwards, {s.busy_seconds:.3f} s busy>"


class NullForwardWorker(EncoderWorker):
    """A stand-in device for benchmarks (``--null-forward``): zeros at once, never the model.

    The rows are what the model would give in number (the adapter's token
    counts, computed by preprocessing), width (``embedding_dim``) and dtype,
    on the host like a real forward's, so everything around the forward —
    HTTP, preprocessing, scheduling, delivery — runs unchanged and is all
    that a benchmark then measures. The batch is not even collated.
    """

    def _run(self, payloads: Sequence[PreprocessResult]) -> Any:
        import torch

        rows = sum(p.tokens for p in payloads)
        return torch.zeros(rows, self.encoder.adapter.embedding_dim, dtype=self.encoder.dtype)
