"""``EmbeddingPool``: one preallocated host buffer, carved into slots, admitted FIFO.

Why one buffer: a transfer engine (Mooncake) registers memory once, by address
and length, so every embedding a receiver holds must live inside one
contiguous buffer whose address never changes. Slots are contiguous byte
ranges handed out first-fit.

Why strict FIFO: the pool is the receiver's backpressure. If small requests
could overtake a large one whenever they fit, a steady stream of them would
starve it forever; instead a waiter at the head blocks everyone behind it
until enough memory is released for *it*. A waiter that gives up (deadline or
cancellation) leaves the queue, and if it was at the head the next one is
served at once.

Why memory lives as long as its views: a slot's tensors (``view``, ``bytes``,
and so ``EncodedRequest.embeddings`` and each ``ItemEmbedding.embedding``) are
built on an object that holds the slot's byte range, so a tensor a user keeps
keeps its range out of the allocator even after ``release()`` or after the
result was dropped: the pool never hands out memory a live tensor still shows.
CPython frees the range the moment the last such tensor dies (counted as
``view_held`` until then).

A slot that is never released is reclaimed when it is garbage-collected (a
``weakref.finalize`` backstop) and counted as ``leaked``: the statistics say
somebody forgot ``release()``; its memory comes back once no view of it is left.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import logging
import math
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Final

import torch
import trio

from epd_trio.errors import OverloadedError, PayloadTooLargeError

__all__ = ["ALIGNMENT", "EmbeddingPool", "PoolStatistics", "Slot"]

log = logging.getLogger(__name__)

ALIGNMENT: Final = 64
"""Every slot starts on a 64-byte boundary (a cache line; any dtype's alignment)."""


def _round_up(n: int, to: int = ALIGNMENT) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class PoolStatistics:
    capacity: int
    used_bytes: int  # bytes held by live slots, alignment included
    slots: int
    waiters: int
    waiting_bytes: int
    peak_used: int
    acquired: int
    released: int  # by release() (a granted slot whose waiter left counts here too)
    leaked: int  # reclaimed by the garbage-collection backstop
    view_held: int = 0  # of ``slots``, those let go but still shown by a live tensor


class _Range:
    """A granted byte range of the pool, freed once neither its slot nor a view holds it.

    The views' buffer (``viewer``) holds the range; the range holds it back only
    weakly, so the views' death is seen (``weakref.finalize``) and frees the range
    if the slot has let go by then.
    """

    __slots__ = ("_viewer", "freed", "offset", "pool", "size", "slot_holds", "view_held")

    def __init__(self, pool: EmbeddingPool, offset: int, size: int) -> None:
        self.pool = pool
        self.offset = offset
        self.size = size
        self.slot_holds = True
        self.view_held = False  # let go by its slot while a view still showed it
        self.freed = False
        self._viewer: weakref.ref[ctypes.Array[ctypes.c_uint8]] | None = None

    def viewer(self) -> ctypes.Array[ctypes.c_uint8]:
        """The pool's buffer as an object that keeps this range held while it lives: every
        view is made from it (``torch.frombuffer`` keeps its source alive)."""
        viewer = self._viewer() if self._viewer is not None else None
        if viewer is None:
            viewer = self.pool._viewer_type.from_address(self.pool.address)
            viewer._epd_range = self  # type: ignore[attr-defined]
            weakref.finalize(viewer, self._views_gone)
            self._viewer = weakref.ref(viewer)
        return viewer

    @property
    def viewed(self) -> bool:
        return self._viewer is not None and self._viewer() is not None

    def let_go(self, *, deferred: bool) -> None:
        """The slot lets go: free now, or once the last view dies."""
        self.slot_holds = False
        if not self.viewed:
            self.pool._free_range(self, deferred=deferred)

    def _views_gone(self) -> None:
        # Any thread, at any allocation (GC): the free itself is deferred to the trio loop.
        if not self.slot_holds:
            self.pool._free_range(self, deferred=True)


class Slot:
    """A contiguous byte range of the pool, held until ``release()``.

    Tensors from ``view`` and ``bytes`` alias the pool's memory and hold the
    range themselves: after ``release()`` it goes back to the pool only once the
    last of them is gone, so a kept tensor never shows another request's bytes.
    """

    __slots__ = ("_finalizer", "_range", "nbytes", "offset", "size", "__weakref__")

    def __init__(self, pool: EmbeddingPool, offset: int, size: int, nbytes: int) -> None:
        self._range: _Range | None = _Range(pool, offset, size)
        self.offset = offset  # from the start of the pool's buffer
        self.size = size  # bytes taken from the pool (rounded up to ALIGNMENT)
        self.nbytes = nbytes  # bytes asked for: the usable length
        self._finalizer = weakref.finalize(self, pool._slot_leaked, self._range, nbytes)
        self._finalizer.atexit = False  # interpreter exit frees everything anyway

    @property
    def released(self) -> bool:
        return self._range is None

    @property
    def address(self) -> int:
        """Host address of the slot's first byte (for a transfer engine)."""
        return self._held().pool.address + self.offset

    def bytes(self) -> torch.Tensor:
        """The slot's ``nbytes`` usable bytes as a flat uint8 tensor (a view)."""
        return self._raw(0, self.nbytes)

    def view(self, dtype: torch.dtype, shape: Sequence[int], offset: int = 0) -> torch.Tensor:
        """A ``dtype`` tensor of ``shape`` over the slot's bytes from ``offset`` (no copy)."""
        itemsize = dtype.itemsize
        count = math.prod(shape)
        end = offset + count * itemsize
        if offset < 0 or end > self.nbytes or any(d < 0 for d in shape):
            raise ValueError(
                f"a {dtype} {tuple(shape)} view at offset {offset} does not fit the"
                f" slot's {self.nbytes} bytes")
        if offset % itemsize:
            raise ValueError(f"offset {offset} is not aligned for {dtype} ({itemsize} bytes)")
        return self._raw(offset, count * itemsize).view(dtype).view(tuple(shape))

    def _raw(self, offset: int, nbytes: int) -> torch.Tensor:
        held = self._held()
        if not nbytes:  # shows no byte of the pool: nothing to hold
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(held.viewer(), dtype=torch.uint8, count=nbytes,
                                offset=self.offset + offset)

    def release(self) -> None:
        """Give the bytes back (once no view of them is left) and admit waiters; idempotent.
        Call from the trio thread."""
        held, self._range = self._range, None
        if held is not None:
            self._finalizer.detach()
            held.pool._slot_let_go(held, leaked=False)

    def _held(self) -> _Range:
        if self._range is None:
            raise RuntimeError("this pool slot was already released")
        return self._range

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<Slot {self.nbytes} bytes at +{self.offset} ({state})>"


@dataclass(eq=False)
class _Waiter:
    size: int
    nbytes: int
    event: trio.Event
    slot: Slot | None = None


class EmbeddingPool:
    """A bounded host buffer for received embeddings; see the module docstring.

    ``pin_memory=True`` page-locks the buffer (needs CUDA) for fast device copies.
    """

    def __init__(self, capacity_bytes: int, *, pin_memory: bool = False) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be at least 1, got {capacity_bytes}")
        self.capacity = _round_up(capacity_bytes)
        self.buffer = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=pin_memory)
        # One ctypes type for the whole buffer (a type per size would be cached forever).
        self._viewer_type = ctypes.c_uint8 * self.capacity
        self._free_list: list[tuple[int, int]] = [(0, self.capacity)]  # (offset, length), sorted
        self._waiters: deque[_Waiter] = deque()
        self._used = self._slots = self._peak = 0
        self._acquired = self._released = self._leaked = self._view_held = 0
        self._busy = 0  # inside the pool's own code: a free from GC waits for the loop's next turn
        self._token: trio.lowlevel.TrioToken | None = None

    @property
    def address(self) -> int:
        """Host address of the buffer: stable for the pool's life."""
        return self.buffer.data_ptr()

    async def acquire(self, nbytes: int, *, timeout: float = math.inf) -> Slot:
        """A slot of ``nbytes``, once every earlier waiter has been served.

        ``PayloadTooLargeError`` at once if it could never fit (waiting would
        be forever); ``OverloadedError`` if ``timeout`` passes first.
        Cancellation leaves the queue cleanly.
        """
        size = self._size_for(nbytes)
        self._token = trio.lowlevel.current_trio_token()
        await trio.lowlevel.checkpoint_if_cancelled()
        self._busy += 1
        try:
            offset = self._fit(size) if not self._waiters else None
            slot = self._grant(offset, size, nbytes) if offset is not None else None
        finally:
            self._busy -= 1
        if slot is not None:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return slot
        waiter = _Waiter(size, nbytes, trio.Event())
        self._waiters.append(waiter)
        try:
            with trio.move_on_after(timeout):
                await waiter.event.wait()
        except BaseException:
            self._abandon(waiter)
            raise
        if waiter.slot is None:
            self._abandon(waiter)
            raise OverloadedError(
                f"no room for {nbytes} bytes in the embedding pool within {timeout:g} s ({self!r})")
        return waiter.slot

    @asynccontextmanager
    async def reserve(self, nbytes: int, *, timeout: float = math.inf) -> AsyncIterator[Slot]:
        """``acquire`` for an ``async with`` block; leaving it releases the slot."""
        slot = await self.acquire(nbytes, timeout=timeout)
        try:
            yield slot
        finally:
            slot.release()

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(
            capacity=self.capacity, used_bytes=self._used, slots=self._slots,
            waiters=len(self._waiters), waiting_bytes=sum(w.size for w in self._waiters),
            peak_used=self._peak, acquired=self._acquired, released=self._released,
            leaked=self._leaked, view_held=self._view_held,
        )

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<EmbeddingPool used {s.used_bytes}/{s.capacity} bytes in {s.slots} slots,"
            f" {s.waiters} waiting ({s.waiting_bytes} bytes), peak {s.peak_used},"
            f" leaked {s.leaked}>"
        )

    # ---- allocation (synchronous: no checkpoint can interleave) -------------
    def _size_for(self, nbytes: int) -> int:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        size = max(_round_up(nbytes), ALIGNMENT)
        if size > self.capacity:
            raise PayloadTooLargeError(
                f"{nbytes} bytes can never fit the embedding pool of {self.capacity} bytes;"
                " raise the pool size or send fewer items per request")
        return size

    def _fit(self, size: int) -> int | None:
        """First fit: the lowest free range that holds ``size``, shrunk by it."""
        for i, (offset, length) in enumerate(self._free_list):
            if length >= size:
                if length == size:
                    del self._free_list[i]
                else:
                    self._free_list[i] = (offset + size, length - size)
                return offset
        return None

    def _grant(self, offset: int, size: int, nbytes: int) -> Slot:
        self._used += size
        self._slots += 1
        self._acquired += 1
        self._peak = max(self._peak, self._used)
        return Slot(self, offset, size, nbytes)

    def _slot_let_go(self, held: _Range, *, leaked: bool) -> None:
        """A slot was released (or garbage-collected): count it, free its range unless viewed."""
        if leaked:
            self._leaked += 1
        else:
            self._released += 1
        if held.viewed:
            held.view_held = True
            self._view_held += 1
        held.let_go(deferred=False)

    def _free_range(self, held: _Range, *, deferred: bool) -> None:
        """Free ``held``; ``deferred`` (the last view died: any thread, or GC inside any
        pool method) waits for the trio loop's next turn unless this is the loop's own
        thread outside the pool's code."""
        if deferred:
            self._now_or_soon(self._free, held)
        else:
            self._free(held)

    def _now_or_soon(self, fn: Callable[..., None], *args: Any) -> None:
        token = self._token
        if token is not None and (self._busy or not _in_run_of(token)):
            try:
                token.run_sync_soon(fn, *args)
                return
            except trio.RunFinishedError:
                pass
        fn(*args)

    def _free(self, held: _Range) -> None:
        """Return a range, merging it with free neighbours, then serve the queue."""
        if held.freed:
            return
        self._busy += 1
        try:
            self._merge_free(held)
            self._serve()
        finally:
            self._busy -= 1

    def _merge_free(self, held: _Range) -> None:
        held.freed = True
        if held.view_held:
            self._view_held -= 1
        offset, size = held.offset, held.size
        i = bisect.bisect_left(self._free_list, (offset, 0))
        end = offset + size
        if i < len(self._free_list) and self._free_list[i][0] == end:
            end += self._free_list.pop(i)[1]
        if i > 0 and sum(self._free_list[i - 1]) == offset:
            i -= 1
            offset = self._free_list.pop(i)[0]
        self._free_list.insert(i, (offset, end - offset))
        self._used -= size
        self._slots -= 1

    def _serve(self) -> None:
        """Grant slots to waiters in order, stopping at the first that does not fit."""
        while self._waiters:
            head = self._waiters[0]
            offset = self._fit(head.size)
            if offset is None:
                return
            self._waiters.popleft()
            head.slot = self._grant(offset, head.size, head.nbytes)
            head.event.set()

    def _abandon(self, waiter: _Waiter) -> None:
        """A waiter gave up: hand back what it was granted, or leave the queue."""
        if waiter.slot is not None:
            waiter.slot.release()
            return
        was_head = self._waiters[0] is waiter
        self._waiters.remove(waiter)
        if was_head:
            self._busy += 1
            try:
                self._serve()  # the new head may fit where the old one did not
            finally:
                self._busy -= 1

    # ---- the garbage-collection backstop -----------------------------------
    def _slot_leaked(self, held: _Range, nbytes: int) -> None:
        """Called by ``weakref.finalize`` when a slot is collected unreleased: GC may run
        inside any pool method (or thread), so the rest is deferred to the trio loop when
        one is running."""
        log.warning("an embedding pool slot of %d bytes at +%d was never released;"
                    " reclaimed by garbage collection", nbytes, held.offset)
        self._now_or_soon(functools.partial(self._slot_let_go, held, leaked=True))


def _in_run_of(token: trio.lowlevel.TrioToken) -> bool:
    """Whether the calling thread is running the trio run ``token`` belongs to."""
    try:
        return trio.lowlevel.current_trio_token() is token
    except RuntimeError:  # not a trio thread
        return False
