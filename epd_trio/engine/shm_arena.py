"""Shared-memory slots that the preprocessing pool's children write their tensors into.

A fresh segment per result costs more than the preprocessing it carries: the
child faults in every page of a new segment as it writes, the parent faults
them in again as it maps them, and both walk ``shm_open``/``ftruncate``/
``mmap``/``unlink`` (measured: ``tools/bench_preprocess.py``'s CPU per image). So the
parent owns a few segments, *slots* (the pool makes two per worker), and hands a free
one to each call; a child keeps each slot it was given mapped between calls and writes
into pages that are already resident, and the parent reads from its own standing
mapping. A result that does not fit goes the old way (a fresh segment) and the
slot grows to fit the next one, up to ``SLOT_MAX_BYTES`` (a video's frames can
be hundreds of MB: those always take a fresh segment, so the arena never pins
more than ``slots x SLOT_MAX_BYTES`` of ``/dev/shm``).

The arena is sans-trio and thread-safe: a cancelled call gives its slot back
from a ``concurrent.futures`` callback, once its child has finished writing.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Final

__all__ = ["ALIGN", "SLOT_MAX_BYTES", "ArenaStatistics", "ChildSlots", "SegmentArena", "SlotTicket",
           "layout_of", "mapping", "write_tensors"]

ALIGN: Final = 64  # each tensor starts on a cache line of its segment
SLOT_MAX_BYTES: Final = 64 << 20
_GROW_ROUND: Final = 1 << 20  # slots grow in whole MiB, so near sizes share one

Layout = list[tuple[str, str, list[int], int, int]]
"""``(key, dtype name, shape, offset, nbytes)`` per tensor, in order."""


@dataclass(frozen=True)
class ArenaStatistics:
    slots: int
    free: int  # not handed out (a cancelled call's slot comes back once its child is done)
    made: int  # slots with a segment (one is made on a slot's first miss)
    bytes: int  # shared memory the slots hold


@dataclass(frozen=True)
class SlotTicket:
    """What a child is told of the slot it may write into: plain and picklable."""

    index: int
    name: str
    size: int


def layout_of(tensors: Mapping[str, Any]) -> tuple[Layout, int]:
    """Where each (contiguous, CPU) tensor goes in a segment, and the bytes needed."""
    layout: Layout = []
    offset = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        dtype = str(tensor.dtype).removeprefix("torch.")
        layout.append((key, dtype, list(tensor.shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return layout, offset


def write_tensors(buf: memoryview, tensors: Mapping[str, Any], layout: Layout) -> None:
    """Copy each tensor's bytes to its place in ``buf`` (a segment's mapping)."""
    import torch

    for (key, _, _, start, nbytes) in layout:
        if nbytes:
            target = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=start)
            target.copy_(tensors[key].reshape(-1).view(torch.uint8))
            del target  # no export of the buffer may outlive the segment's close()


class SegmentArena:
    """``slots`` reusable segments, owned by the parent process (``close`` unlinks them)."""

    def __init__(self, slots: int, *, max_bytes: int = SLOT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._segments: list[SharedMemory | None] = [None] * slots  # made on the first miss
        self._free = list(range(slots))
        self._closed = False

    def acquire(self) -> SlotTicket | None:
        """A free slot, or None when every slot is taken (the call then uses a fresh segment)."""
        with self._lock:
            if self._closed or not self._free:
                return None
            index = self._free.pop()
            segment = self._segments[index]
        return SlotTicket(index, segment.name if segment else "", segment.size if segment else 0)

    def release(self, ticket: SlotTicket | None) -> None:
        if ticket is not None:
            with self._lock:
                self._free.append(ticket.index)

    def buffer(self, ticket: SlotTicket) -> memoryview:
        """The parent's mapping of a slot its child wrote into (held while the ticket is)."""
        segment = self._segments[ticket.index]
        assert segment is not None and segment.name == ticket.name
        return mapping(segment)

    def grow(self, ticket: SlotTicket, needed: int) -> None:
        """After a miss: give the slot (still held by the caller) room for ``needed`` bytes."""
        if needed > self.max_bytes or needed <= ticket.size:
            return
        size = min(self.max_bytes, -(-needed // _GROW_ROUND) * _GROW_ROUND)
        fresh = SharedMemory(create=True, size=size)
        old: SharedMemory | None
        with self._lock:
            if self._closed:  # a copy that finished after the pool closed: keep nothing
                old = fresh
            else:
                old, self._segments[ticket.index] = self._segments[ticket.index], fresh
        if old is not None:  # a child that mapped it lets go when it sees the new name
            _drop(old)

    def close(self) -> None:
        """Unlink every slot; call once no child can write any more."""
        with self._lock:
            self._closed = True
            segments, self._segments = self._segments, [None] * len(self._segments)
        for segment in segments:
            if segment is not None:
                _drop(segment)

    def statistics(self) -> ArenaStatistics:
        with self._lock:
            made = [s.size for s in self._segments if s is not None]
            return ArenaStatistics(len(self._segments), len(self._free), len(made), sum(made))


class ChildSlots:
    """A child's standing mappings of the slots it was handed, by slot index (unmapped
    when the child exits; the parent unlinks)."""

    def __init__(self) -> None:
        self._mapped: dict[int, SharedMemory] = {}

    def buffer(self, ticket: SlotTicket) -> memoryview:
        mapped = self._mapped.get(ticket.index)
        if mapped is None or mapped.name != ticket.name:  # first use, or the slot grew
            if mapped is not None:
                mapped.close()
            mapped = self._mapped[ticket.index] = SharedMemory(name=ticket.name)
        return mapping(mapped)


def mapping(segment: SharedMemory) -> memoryview:
    """An open segment's bytes (``SharedMemory.buf`` is ``None`` only once it is closed)."""
    buf = segment.buf
    if buf is None:
        raise RuntimeError(f"shared-memory segment {segment.name} is closed")
    return buf


def _drop(segment: SharedMemory) -> None:
    segment.unlink()
    try:
        segment.close()
    except BufferError:  # a view is still out (a read in flight): unmapped when it goes
        pass
