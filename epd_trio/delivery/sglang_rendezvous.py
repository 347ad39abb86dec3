"""SGLang's per-part rendezvous: where a part goes and how big it is, known in any order.

An SGLang language server tells an encoder where a part goes with one
``/scheduler_receive_url`` per tensor-parallel rank (zmq_to_scheduler), and
pulls a part's sizes with ``/scheduler_receive_meta_data`` (mooncake); either
may come before the part's ``/encode``. One ``Entry`` per ``req_id`` (SGLang's
part id, ``<rid>_local_part_<k>``) holds what is known so far.

It is a resource like any other: an entry lives while a delivery holds it
(``claim`` … ``release``) or a caller waits on it, never longer. A
registration that no ``/encode`` claims within its wait is withdrawn (504), a
sizes wait that times out leaves nothing behind, and ``statistics()`` shows
that the table is empty once the traffic has gone. How the last ``MAX_ENDED``
parts ended is remembered (a bounded table), so a caller that comes after its
part was released is answered at once, with how it ended, instead of waiting out its
timeout or hearing only that the part is unknown.

Calls that wait for a part no delivery has claimed yet (its ``/encode`` not
come, or not yet preprocessed) are *early*: each is an open request that no
admission bound has counted (``max_pending`` counts
``/encode`` calls), so their number is bounded here, ``max_early``; one more is
a 503 at once, with nothing registered.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import trio

from epd_trio.errors import (
    ConflictError,
    DeadlineExceeded,
    EPDError,
    OverloadedError,
    RequestError,
    UnknownRequestError,
)

__all__ = ["MAX_EARLY", "MAX_ENDED", "Entry", "Rendezvous", "RendezvousStatistics"]

MAX_ENDED = 4096  # endings remembered: minutes of traffic, a few hundred KiB at most
MAX_EARLY = 4096  # early waits at once: 256 pending parts × 16 tensor-parallel ranks


@dataclass(frozen=True)
class RendezvousStatistics:
    entries: int
    claimed: int  # held by a live request's delivery
    waiters: int  # handlers waiting for a claim or for sizes
    destinations: int  # registered, over all entries
    ended: int  # endings remembered (bounded by MAX_ENDED)
    early: int  # of the waiters, those whose part is not claimed yet (bounded by max_early)
    refused: int  # early calls turned away (503) since the table was made


class Entry:
    """What is known of one part: its destinations, its sizes, how it ended."""

    def __init__(self, req_id: str) -> None:
        self.req_id = req_id
        self.receive_count: int | None = None  # set by the first registration
        # An ordered set of "host:port", with how many registrations wait on each (a rank's
        # retry may register the same one again while its first call still waits).
        self.destinations: dict[str, int] = {}
        self.claimed = False
        self.closed = False  # its delivery let go
        self.sizes: dict[str, int] | None = None
        self.error: EPDError | None = None
        self.waiters = 0
        self._changed = trio.Event()

    def notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self) -> None:
        """Until the next change; callers check their condition first, with no await between."""
        await self._changed.wait()

    @property
    def unclaimed(self) -> bool:
        """Not yet held by a delivery (and never was: an entry is claimed at most once)."""
        return not (self.claimed or self.closed)

    def publish_sizes(self, sizes: dict[str, int]) -> None:
        self.sizes = dict(sizes)
        self.notify()

    def publish_error(self, error: EPDError) -> None:
        # A copy, without the traceback: that would keep the failed request's frames (its
        # body, its items) alive for as long as the endings table remembers the part.
        self.error = _fresh(error)
        self.notify()

    def __repr__(self) -> str:
        return (f"<Entry {self.req_id!r} {len(self.destinations)}/{self.receive_count} destinations"
                f"{', claimed' if self.claimed else ''}{', closed' if self.closed else ''}>")


class Rendezvous:
    """The encoder's table of entries, keyed by SGLang's part id."""

    def __init__(self, max_ended: int = MAX_ENDED, max_early: int = MAX_EARLY) -> None:
        if max_early < 1:
            raise ValueError(f"max_early must be at least 1, got {max_early}")
        self._entries: dict[str, Entry] = {}
        self._ended: OrderedDict[str, EPDError | None] = OrderedDict()  # req_id → its error
        self._max_ended = max_ended
        self._max_early = max_early
        self._early = 0  # waiters on unclaimed entries
        self._refused = 0

    def check_not_ended(self, req_id: str) -> None:
        """Raise how ``req_id`` ended (its error, or a 404 saying it was delivered) if it did."""
        if req_id in self._ended:
            error = self._ended[req_id]
            raise _fresh(error) if error is not None else UnknownRequestError(
                f"request {req_id!r} has already been delivered and released", req_id=req_id)

    def _entry(self, req_id: str) -> Entry:
        entry = self._entries.get(req_id)
        if entry is None:
            entry = self._entries[req_id] = Entry(req_id)
        return entry

    def _drop_if_unused(self, entry: Entry) -> None:
        if not entry.claimed and entry.waiters == 0 and self._entries.get(entry.req_id) is entry:
            del self._entries[entry.req_id]

    def _admit(self, req_id: str) -> Entry:
        """The entry a new waiter joins; a 503 if its part is unclaimed and the early bound is full."""
        self.check_not_ended(req_id)
        entry = self._entry(req_id)
        if entry.unclaimed and self._early >= self._max_early:
            self._refused += 1
            self._drop_if_unused(entry)
            raise OverloadedError(f"{self._early} calls already wait for parts no delivery holds "
                                  f"yet (at most {self._max_early}); retry later", req_id=req_id)
        return entry

    @contextmanager
    def _waiting(self, entry: Entry) -> Iterator[None]:
        early = entry.unclaimed  # counted as early until its entry is claimed (``claim``)
        entry.waiters += 1
        if early:
            self._early += 1
        try:
            yield
        finally:
            entry.waiters -= 1
            if early and entry.unclaimed:  # else ``claim`` has taken it off already
                self._early -= 1
            self._drop_if_unused(entry)

    # ---- the face's side ------------------------------------------------------
    async def register(self, req_id: str, receive_count: int, destination: str, *,
                       timeout: float) -> None:
        """``/scheduler_receive_url``: add ``destination``; return once a delivery holds it.

        A different ``receive_count`` for the same part is a 400; no
        ``/encode`` within ``timeout`` withdraws the destination (504); a part
        that has already ended answers how it ended; too many early calls, a 503.
        """
        entry = self._admit(req_id)
        if entry.receive_count is not None and entry.receive_count != receive_count:
            self._drop_if_unused(entry)
            raise RequestError(f"receive_count {receive_count} differs from the "
                               f"{entry.receive_count} registered before for {req_id!r}", req_id=req_id)
        entry.receive_count = receive_count
        entry.destinations[destination] = entry.destinations.get(destination, 0) + 1
        entry.notify()
        with self._waiting(entry):
            try:
                with trio.move_on_after(timeout):
                    while not (entry.claimed or entry.closed):
                        await entry.wait_changed()
            finally:  # timed out, or the rank left (cancelled): nobody waits there any more
                held = entry.claimed or entry.closed
                if not held:
                    self._withdraw(entry, destination)
            if not held:
                raise DeadlineExceeded(f"no /encode for {req_id!r} arrived within {timeout} s",
                                       req_id=req_id)

    async def wait_sizes(self, req_id: str, *, timeout: float) -> dict[str, int]:
        """``/scheduler_receive_meta_data``: the part's sizes once known (504 after ``timeout``);
        its error if it failed first; too many early calls, a 503."""
        entry = self._admit(req_id)
        with self._waiting(entry):
            with trio.move_on_after(timeout):
                while entry.sizes is None and entry.error is None and not entry.closed:
                    await entry.wait_changed()
        if entry.error is not None:
            raise _fresh(entry.error)
        if entry.sizes is None:
            if entry.closed:
                raise UnknownRequestError(f"request {req_id!r} was released", req_id=req_id)
            raise DeadlineExceeded(f"the sizes of {req_id!r} were not known within {timeout} s",
                                   req_id=req_id)
        return entry.sizes

    @staticmethod
    def _withdraw(entry: Entry, destination: str) -> None:
        """One registration of ``destination`` gave up; the last one takes it off the set."""
        left = entry.destinations.get(destination, 0) - 1
        if left > 0:
            entry.destinations[destination] = left
        else:
            entry.destinations.pop(destination, None)
        if not entry.destinations:
            entry.receive_count = None

    # ---- the delivery's side --------------------------------------------------
    def expect(self, req_id: str) -> None:
        """A new ``/encode`` of ``req_id`` is admitted: forget how an earlier part of that id
        ended, so that a rank registering before this one's claim (its preprocessing takes
        a while) waits for it instead of hearing the old ending."""
        self._ended.pop(req_id, None)

    def claim(self, req_id: str) -> Entry:
        """The entry for a live request's delivery (a second claim is a 409).

        A new claim of an ended part's id (a request id reused) starts afresh.
        """
        self._ended.pop(req_id, None)
        entry = self._entry(req_id)
        if entry.claimed:
            raise ConflictError(f"request {req_id!r} already has a live delivery", req_id=req_id)
        self._early -= entry.waiters  # an unclaimed entry's waiters were all early
        entry.claimed = True
        entry.notify()
        return entry

    def release(self, entry: Entry) -> None:
        """The delivery let go: wake every waiter, forget the entry."""
        entry.claimed = False
        entry.closed = True
        entry.notify()
        if self._entries.get(entry.req_id) is entry:
            del self._entries[entry.req_id]
        self._ended[entry.req_id] = entry.error
        self._ended.move_to_end(entry.req_id)
        while len(self._ended) > self._max_ended:
            self._ended.popitem(last=False)

    def statistics(self) -> RendezvousStatistics:
        entries = list(self._entries.values())
        return RendezvousStatistics(len(entries), sum(e.claimed for e in entries),
                                    sum(e.waiters for e in entries),
                                    sum(len(e.destinations) for e in entries), len(self._ended),
                                    self._early, self._refused)

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<Rendezvous {s.entries} entries, {s.claimed} claimed, {s.waiters} waiting "
                f"({s.early} early, {s.refused} refused), {s.destinations} destinations>")


def _fresh(error: EPDError) -> EPDError:
    """A copy to raise: one stored error raised again and again would grow its traceback by
    every raise (keeping each caller's frames alive) for as long as the table remembers it."""
    return copy.copy(error)
