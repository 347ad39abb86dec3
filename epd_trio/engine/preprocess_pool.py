"""Preprocessing in a pool of processes (``--preprocess-mode process``).

Threads share one interpreter: the decoders and the processor's torch ops
release the GIL for their heavy parts, but the Python between them does not,
and their OpenMP teams compete with the forward's. A process per worker
sidesteps both: each child builds its own ``EncoderPreprocessor`` from the
checkpoint's processors (one torch thread each) and runs the same code the
thread path runs.

What crosses the boundary, and which way:

- parent → child: the request's loaded items (the bytes this process fetched
  or was sent, or in-process PIL images / frame arrays), pickled by the
  executor for its own child: the child unpickles what its parent wrote;
- child → parent: one **shared-memory segment** per result with every input
  tensor in it, and a plain dict (segment name, dtypes, shapes, offsets,
  grid_thw, token counts, extras; or an error's class name and message). The
  parent copies the tensors out and unlinks the segment at once; a request
  cancelled while its child works has its segment unlinked when the child
  finishes. Nothing the network sent is ever unpickled in the parent.

The pool is owned by ``open_preprocess_pool`` (an ``async with``): leaving it
cancels queued work, waits for running items and ends every child; no segment
outlives it. Children are *spawned* (no fork of a threaded, CUDA-aware parent).
"""

from __future__ import annotations

import functools
import multiprocessing
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import CancelledError, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import asynccontextmanager
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

import trio

import epd_trio.errors as errors
from epd_trio.errors import EncodeError, EPDError, ModelLoadError
from epd_trio.model.adapters import PreprocessResult
from epd_trio.model.media import MediaLimits

__all__ = ["PoolSpec", "PoolStatistics", "PreprocessPool", "open_preprocess_pool"]

_ALIGN = 64  # each tensor starts on a cache line of the segment


@dataclass(frozen=True)
class PoolSpec:
    """What a child needs to build its preprocessor: plain, picklable values only."""

    model_dir: str
    limits: MediaLimits
    video_fps: float = 2.0
    video_min_frames: int = 4
    video_max_frames: int = 768
    torch_threads: int = 1


@dataclass(frozen=True)
class PoolStatistics:
    workers: int
    running: int
    done: int
    failed: int
    restarts: int


# ---- the child side (runs in the spawned processes) ---------------------------
# A child's preprocessor, set once by the executor's initializer: the only
# process-wide state, and it lives in the child process only.
_CHILD: dict[str, Any] = {}


def _init_child(spec: PoolSpec) -> None:
    import torch
    from transformers import AutoConfig

    from epd_trio.model.adapters import adapter_for
    from epd_trio.model.loader import load_processors
    from epd_trio.model.preprocess import EncoderPreprocessor

    torch.set_num_threads(spec.torch_threads)
    adapter = adapter_for(AutoConfig.from_pretrained(spec.model_dir, local_files_only=True))
    processors = load_processors(adapter, Path(spec.model_dir))
    _CHILD["preprocessor"] = EncoderPreprocessor(
        adapter, processors, spec.limits, video_fps=spec.video_fps,
        video_min_frames=spec.video_min_frames, video_max_frames=spec.video_max_frames)


def _child_ready() -> int:
    return len(_CHILD)


def _child_preprocess(items: Sequence[Any], modality: str,
                      indices: Sequence[int] | None) -> dict[str, Any]:
    """Preprocess in the child; the answer is plain data and a segment name."""
    try:
        result = _CHILD["preprocessor"].preprocess(items, modality, indices)
    except EPDError as exc:
        return {"error": type(exc).__name__, "message": exc.message}
    except Exception as exc:  # a bug: the parent's 500, with what a log needs
        return {"error": "EncodeError", "message": f"preprocessing failed: {type(exc).__name__}: {exc}"}
    return _to_shared(result)


def _to_shared(result: PreprocessResult) -> dict[str, Any]:
    import torch

    flat = {key: t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            for key, t in result.inputs.items()}
    layout, offset = [], 0
    for key, tensor in result.inputs.items():
        nbytes = flat[key].numel()
        layout.append((key, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    segment = SharedMemory(create=True, size=max(offset, 1))
    try:
        for key, _, _, start, nbytes in layout:
            if nbytes:
                target = torch.frombuffer(segment.buf, dtype=torch.uint8, count=nbytes, offset=start)
                target.copy_(flat[key])
                del target  # no export of the buffer may outlive close()
    except BaseException:
        segment.close()
        segment.unlink()
        raise
    segment.close()  # the parent unlinks it
    return {"segment": segment.name, "tensors": layout, "modality": result.modality,
            "grid_thw": [list(g) for g in result.grid_thw],
            "token_counts": list(result.token_counts), "extras": result.extras}


# ---- the parent side -------------------------------------------------------------
def _from_shared(answer: dict[str, Any]) -> PreprocessResult:
    """Copy the tensors out of the child's segment and unlink it (blocking: a thread)."""
    import torch

    segment = SharedMemory(name=answer["segment"])
    try:
        inputs = {}
        for key, dtype, shape, start, nbytes in answer["tensors"]:
            raw = torch.empty(nbytes, dtype=torch.uint8)
            if nbytes:
                view = torch.frombuffer(segment.buf, dtype=torch.uint8, count=nbytes, offset=start)
                raw.copy_(view)
                del view
            inputs[key] = raw.view(getattr(torch, dtype)).reshape(shape)
    finally:
        segment.unlink()
        segment.close()
    return PreprocessResult(
        modality=answer["modality"], inputs=inputs,
        grid_thw=tuple((int(t), int(h), int(w)) for t, h, w in answer["grid_thw"]),
        token_counts=tuple(int(c) for c in answer["token_counts"]), extras=dict(answer["extras"]))


def _discard(future: Future) -> None:
    """A cancelled request's answer: unlink its segment (runs when the child finishes)."""
    try:
        answer = future.result()
    except (CancelledError, Exception):
        return
    if "segment" in answer:
        try:
            segment = SharedMemory(name=answer["segment"])
        except FileNotFoundError:
            return
        segment.unlink()
        segment.close()


def _raise_error(answer: dict[str, Any]) -> None:
    cls = getattr(errors, answer["error"], None)
    if not (isinstance(cls, type) and issubclass(cls, EPDError)):
        cls = EncodeError
    raise cls(answer["message"])


class PreprocessPool:
    """``preprocess`` runs ``EncoderPreprocessor.preprocess`` in a child process.

    At most ``workers`` calls are in the pool at once (a ``CapacityLimiter``):
    the rest wait in trio, where cancelling them costs nothing.
    """

    def __init__(self, spec: PoolSpec, workers: int) -> None:
        self.spec = spec
        self.workers = workers
        self._limiter = trio.CapacityLimiter(workers)
        self._executor = self._new_executor()
        self._done = self._failed = self._restarts = 0
        self._retired: list[ProcessPoolExecutor] = []

    def _new_executor(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_child, initargs=(self.spec,))

    async def start(self) -> None:
        """Start every child and load its processors, so the first request is not the slow one."""
        futures = [self._executor.submit(_child_ready) for _ in range(self.workers)]
        try:
            for future in futures:
                await trio.to_thread.run_sync(future.result, abandon_on_cancel=True)
        except BrokenProcessPool as exc:
            raise ModelLoadError(f"a preprocessing process failed to start ({exc})") from None

    async def preprocess(self, items: Sequence[Any], modality: str,
                         indices: Sequence[int] | None = None) -> PreprocessResult:
        async with self._limiter:
            executor, future = self._executor, None
            try:
                future = executor.submit(_child_preprocess, list(items), modality,
                                         None if indices is None else list(indices))
                answer = await trio.to_thread.run_sync(future.result, abandon_on_cancel=True)
            except BrokenProcessPool:
                self._failed += 1
                self._restart(executor)
                raise EncodeError("a preprocessing process died (the pool was restarted)") from None
            except BaseException:
                if future is not None and not future.cancel():
                    future.add_done_callback(_discard)  # at once if already done
                raise
        if "error" in answer:
            self._failed += 1
            _raise_error(answer)
        self._done += 1
        return await trio.to_thread.run_sync(_from_shared, answer)

    def _restart(self, broken: ProcessPoolExecutor) -> None:
        if self._executor is broken:  # the first request to see it restarts it
            self._restarts += 1
            self._executor = self._new_executor()
            self._retired.append(broken)  # its manager ends the other children; aclose joins it

    async def aclose(self) -> None:
        """Cancel queued work, wait for running items (their segments are unlinked), end the children."""
        for executor in (*self._retired, self._executor):
            await trio.to_thread.run_sync(functools.partial(
                executor.shutdown, wait=True, cancel_futures=True))

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(self.workers, self._limiter.borrowed_tokens, self._done,
                              self._failed, self._restarts)

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<PreprocessPool {s.workers} processes: {s.running} running, {s.done} done, "
                f"{s.failed} failed, {s.restarts} restarts>")


@asynccontextmanager
async def open_preprocess_pool(spec: PoolSpec, workers: int) -> AsyncIterator[PreprocessPool]:
    """A started pool of ``workers`` processes for the duration of the block."""
    pool = PreprocessPool(spec, workers)
    try:
        await pool.start()
        yield pool
    finally:
        with trio.CancelScope(shield=True):
            await pool.aclose()
