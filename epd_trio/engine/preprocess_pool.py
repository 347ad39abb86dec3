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
- child → parent: every input tensor in **shared memory** — the slot of the
  parent's ``SegmentArena`` that came with the call (mapped once per child,
  reused), or a fresh segment when none was free or the result does not fit
  (the slot then grows for the next one) — and a plain dict (slot or segment
  name, dtypes, shapes, offsets, grid_thw, token counts, extras; or an
  error's class name and message). The parent copies the tensors out, then
  frees the slot or unlinks the segment; a request cancelled while its child
  works frees them when the child finishes. Nothing the network sent is ever
  unpickled in the parent.

The pool is owned by ``open_preprocess_pool`` (an ``async with``): leaving it
cancels queued work, gives running items ``shutdown_grace`` seconds, then
terminates the children still working (a child stuck in a decode cannot hold
the engine's exit) and, if one ignores that too, kills it; no segment outlives
it. Children are *spawned* (no fork of a threaded, CUDA-aware parent).
"""

from __future__ import annotations

import functools
import logging
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
from epd_trio._util import wait_done
from epd_trio.engine.shm_arena import ChildSlots, SegmentArena, SlotTicket, layout_of, mapping, write_tensors
from epd_trio.errors import EncodeError, EPDError, ModelLoadError
from epd_trio.model.adapters import PreprocessResult
from epd_trio.model.media import MediaLimits

__all__ = ["PoolSpec", "PoolStatistics", "PreprocessPool", "open_preprocess_pool"]

log = logging.getLogger(__name__)

# Two calls per child in the pool: while the parent takes one answer, the child already
# works on the next, so it never idles for the round trip (JPEG 448 on 2 cores: 381 against
# 323 img/s with one child). A slot each, and a third the parent is still reading.
CALLS_PER_WORKER = 2
SLOTS_PER_WORKER = CALLS_PER_WORKER + 1
# Seconds running items get to finish when the pool closes, before their children are
# terminated; then as long again after a terminate, before a kill.
SHUTDOWN_GRACE = 5.0


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
    slot_hits: int = 0  # results written into a standing slot of the arena
    slot_misses: int = 0  # results that needed a fresh segment (no slot free, or too big)
    slots_free: int = 0
    slot_bytes: int = 0  # shared memory the slots hold


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
    _CHILD["slots"] = ChildSlots()
    _CHILD["preprocessor"] = EncoderPreprocessor(
        adapter, processors, spec.limits, video_fps=spec.video_fps,
        video_min_frames=spec.video_min_frames, video_max_frames=spec.video_max_frames)


def _child_ready() -> int:
    return len(_CHILD)


def _child_preprocess(items: Sequence[Any], modality: str, indices: Sequence[int] | None,
                      ticket: SlotTicket | None = None) -> dict[str, Any]:
    """Preprocess in the child; the answer is plain data and where the tensors are."""
    try:
        result = _CHILD["preprocessor"].preprocess(items, modality, indices)
    except EPDError as exc:
        return {"error": type(exc).__name__, "message": exc.message}
    except Exception as exc:  # noqa: BLE001 - a bug: the parent's 500, with what a log needs
        return {"error": "EncodeError", "message": f"preprocessing failed: {type(exc).__name__}: {exc}"}
    return _to_shared(result, ticket)


def _to_shared(result: PreprocessResult, ticket: SlotTicket | None) -> dict[str, Any]:
    tensors = {key: t.detach().cpu().contiguous() for key, t in result.inputs.items()}
    layout, size = layout_of(tensors)
    answer = {"tensors": layout, "size": size, "modality": result.modality,
              "grid_thw": [list(g) for g in result.grid_thw],
              "token_counts": list(result.token_counts), "extras": result.extras}
    if ticket is not None and ticket.name and size <= ticket.size:
        write_tensors(_CHILD["slots"].buffer(ticket), tensors, layout)
        return {**answer, "slot": ticket.index}
    segment = SharedMemory(create=True, size=max(size, 1))
    try:
        write_tensors(mapping(segment), tensors, layout)
    except BaseException:
        segment.close()
        segment.unlink()
        raise
    segment.close()  # the parent unlinks it
    return {**answer, "segment": segment.name}


# ---- the parent side -------------------------------------------------------------
def _read_tensors(buf: memoryview, layout: list[Any]) -> dict[str, Any]:
    import torch

    inputs = {}
    for key, dtype, shape, start, nbytes in layout:
        raw = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            view = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=start)
            raw.copy_(view)
            del view  # no export of the buffer may outlive the segment's close()
        inputs[key] = raw.view(getattr(torch, dtype)).reshape(shape)
    return inputs


def _result(answer: dict[str, Any], inputs: dict[str, Any]) -> PreprocessResult:
    return PreprocessResult(
        modality=answer["modality"], inputs=inputs,
        grid_thw=tuple((int(t), int(h), int(w)) for t, h, w in answer["grid_thw"]),
        token_counts=tuple(int(c) for c in answer["token_counts"]), extras=dict(answer["extras"]))


def _unlink_segment(answer: dict[str, Any]) -> None:
    try:
        segment = SharedMemory(name=answer["segment"])
    except FileNotFoundError:
        return
    segment.unlink()
    segment.close()


def _discard(arena: SegmentArena, ticket: SlotTicket | None, future: Future) -> None:
    """A cancelled request's answer, once its child is done: free its slot or segment."""
    try:
        answer = future.result()
    except (CancelledError, Exception):  # noqa: BLE001 - nobody waits for it: only its segment matters
        answer = {}
    if "segment" in answer:
        _unlink_segment(answer)
    arena.release(ticket)


async def _result_of(future: Future) -> Any:
    """A child's answer, waited for without a thread (the executor's own thread wakes us)."""
    await wait_done(future)
    return future.result()


def _raise_error(answer: dict[str, Any]) -> None:
    cls = getattr(errors, answer["error"], None)
    if not (isinstance(cls, type) and issubclass(cls, EPDError)):
        cls = EncodeError
    raise cls(answer["message"])


class PreprocessPool:
    """``preprocess`` runs ``EncoderPreprocessor.preprocess`` in a child process.

    At most ``CALLS_PER_WORKER × workers`` calls are in the pool at once (a
    ``CapacityLimiter``): each child has the next one queued while the parent
    takes its last answer; the rest wait in trio, where cancelling them costs nothing.
    """

    def __init__(self, spec: PoolSpec, workers: int, *, shutdown_grace: float = SHUTDOWN_GRACE) -> None:
        self.spec = spec
        self.workers = workers
        self.shutdown_grace = shutdown_grace
        self._limiter = trio.CapacityLimiter(CALLS_PER_WORKER * workers)
        self._arena = SegmentArena(SLOTS_PER_WORKER * workers)
        self._executor = self._new_executor()
        self._done = self._failed = self._restarts = 0
        self._slot_hits = self._slot_misses = 0
        self._retired: list[ProcessPoolExecutor] = []

    def _new_executor(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_child, initargs=(self.spec,))

    async def start(self) -> None:
        """Start every child and load its processors, so the first request is not the slow one."""
        futures = [self._executor.submit(_child_ready) for _ in range(self.workers)]
        try:
            for future in futures:
                await _result_of(future)
        except BrokenProcessPool as exc:
            raise ModelLoadError(f"a preprocessing process failed to start ({exc})") from None

    async def preprocess(self, items: Sequence[Any], modality: str,
                         indices: Sequence[int] | None = None) -> PreprocessResult:
        async with self._limiter:
            executor, future, ticket = self._executor, None, self._arena.acquire()
            try:
                future = executor.submit(_child_preprocess, list(items), modality,
                                         None if indices is None else list(indices), ticket)
                answer = await _result_of(future)
            except BrokenProcessPool:
                self._arena.release(ticket)
                self._failed += 1
                self._restart(executor)
                raise EncodeError("a preprocessing process died (the pool was restarted)") from None
            except BaseException:
                if future is not None and not future.cancel():  # the child may still write
                    future.add_done_callback(functools.partial(_discard, self._arena, ticket))
                else:
                    self._arena.release(ticket)
                raise
        taken = False
        try:
            if "error" in answer:
                self._failed += 1
                _raise_error(answer)
            self._done += 1
            # Not abandoned on cancel: the slot is freed only once the copy is out of it.
            result = await trio.to_thread.run_sync(self._take, answer, ticket)
            taken = True
        finally:
            if not taken and "segment" in answer:  # cancelled before the copy: nobody else will
                _unlink_segment(answer)
            self._arena.release(ticket)
        if "slot" in answer:
            self._slot_hits += 1
        else:
            self._slot_misses += 1
        return result

    def _take(self, answer: dict[str, Any], ticket: SlotTicket | None) -> PreprocessResult:
        """The tensors out of the child's slot or segment (blocking: a thread)."""
        if "slot" in answer:
            assert ticket is not None and ticket.index == answer["slot"]
            return _result(answer, _read_tensors(self._arena.buffer(ticket), answer["tensors"]))
        segment = SharedMemory(name=answer["segment"])
        try:
            inputs = _read_tensors(mapping(segment), answer["tensors"])
        finally:
            segment.unlink()
            segment.close()
        if ticket is not None:
            self._arena.grow(ticket, answer["size"])
        return _result(answer, inputs)

    def _restart(self, broken: ProcessPoolExecutor) -> None:
        if self._executor is broken:  # the first request to see it restarts it
            self._restarts += 1
            self._executor = self._new_executor()
            self._retired.append(broken)  # its manager ends the other children; aclose joins it

    async def aclose(self) -> None:
        """Cancel queued work, give running items ``shutdown_grace`` seconds (their segments
        are unlinked), then end the children still working: terminated, then killed."""
        executors = (*self._retired, self._executor)
        processes = [p for executor in executors for p in _processes(executor)]
        shut_down = trio.Event()

        async def shut_down_all() -> None:  # the executors' own joins: children and results
            for executor in executors:
                await trio.to_thread.run_sync(functools.partial(
                    executor.shutdown, wait=True, cancel_futures=True), abandon_on_cancel=True)
            shut_down.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(shut_down_all)
            for stop in ("terminate", "kill", None):
                with trio.move_on_after(self.shutdown_grace):
                    await shut_down.wait()
                if shut_down.is_set() or stop is None:
                    break
                alive = [p for p in processes if p.is_alive()]
                log.warning("%d preprocessing process(es) still running %g s after the pool "
                            "began to close: %s", len(alive), self.shutdown_grace, stop)
                for process in alive:
                    getattr(process, stop)()
            if not shut_down.is_set():
                log.error("the preprocessing pool did not shut down after its children were "
                          "killed; its threads are left to end alone")
                nursery.cancel_scope.cancel()
        self._arena.close()  # no child is left to write into a slot

    def statistics(self) -> PoolStatistics:
        arena = self._arena.statistics()
        return PoolStatistics(self.workers, self._limiter.borrowed_tokens, self._done,
                              self._failed, self._restarts, self._slot_hits, self._slot_misses,
                              arena.free, arena.bytes)

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<PreprocessPool {s.workers} processes: {s.running} running, {s.done} done, "
                f"{s.failed} failed, {s.restarts} restarts; slots {s.slot_hits} hits, "
                f"{s.slot_misses} misses, {s.slot_bytes >> 20} MiB>")


def _processes(executor: ProcessPoolExecutor) -> list[multiprocessing.process.BaseProcess]:
    """The executor's child processes (Python 3.14 adds ``terminate_workers``; before it the
    executor keeps them in ``_processes``, None once it has shut down)."""
    return list((getattr(executor, "_processes", None) or {}).values())


@asynccontextmanager
async def open_preprocess_pool(spec: PoolSpec, workers: int, *,
                               shutdown_grace: float = SHUTDOWN_GRACE) -> AsyncIterator[PreprocessPool]:
    """A started pool of ``workers`` processes for the duration of the block."""
    pool = PreprocessPool(spec, workers, shutdown_grace=shutdown_grace)
    try:
        await pool.start()
        yield pool
    finally:
        with trio.CancelScope(shield=True):
            await pool.aclose()
