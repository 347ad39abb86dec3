"""Request scopes: each live request's phase, what it holds, and how it ended.

A scope moves through ``Phase``s in one direction::

    ADMITTED → PREPROCESSED → ENCODED → DELIVERED | FAILED | ABORTED → RELEASED

(a cached or failing request may skip a phase; none goes back). The way it
ended is recorded once, with its error; the face's answer is given once
(``answer`` refuses a second). ``release`` is the scope's own last step: it
closes the delivery, shielded and bounded (``CLOSE_TIMEOUT``), then leaves the
registry whatever the closing did: a delivery's bug is logged with its
traceback and counted (``release_errors``), never let into the request
nursery, where it would cancel every other request.

``ScopeRegistry`` is how ``/abort``, duplicates (409), drain and ``/stats``
see live requests: one scope per ``(req_id, part_idx)``, admitted
synchronously, so "live requests" returns to zero exactly when every request
has released what it held.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

import outcome
import trio

from epd_trio.delivery import Answer, Delivery, PulledDelivery
from epd_trio.errors import AbortedError, DuplicateRequestError, EPDError, UnknownRequestError
from epd_trio.protocol.requests import EncodeRequest

__all__ = ["Phase", "RegistryStatistics", "RequestScope", "ScopeRegistry", "ScopeStatistics"]

log = logging.getLogger(__name__)

Key = tuple[str, int]

# Seconds a delivery's ``aclose`` may take inside the release's shield. Closing
# holds nothing that waits on a peer (the writes have settled before it), so
# running into this is a bug, logged and counted like one.
CLOSE_TIMEOUT: Final = 10.0
# Released scopes whose writes may still land, remembered for /abort (the oldest go first).
MAX_UNSETTLED: Final = 1024


class Phase(enum.Enum):
    ADMITTED = "admitted"
    PREPROCESSED = "preprocessed"  # its size is known; an early answer may have been given
    ENCODED = "encoded"  # the embedding exists; delivering it
    DELIVERED = "delivered"
    FAILED = "failed"
    ABORTED = "aborted"  # /abort, a client that left, or shutdown
    RELEASED = "released"


ENDINGS: Final = frozenset({Phase.DELIVERED, Phase.FAILED, Phase.ABORTED})
_NEXT: Final[dict[Phase, frozenset[Phase]]] = {
    Phase.ADMITTED: frozenset({Phase.PREPROCESSED, Phase.ENCODED}) | ENDINGS - {Phase.DELIVERED},
    Phase.PREPROCESSED: frozenset({Phase.ENCODED, Phase.FAILED, Phase.ABORTED}),
    Phase.ENCODED: ENDINGS,
    **{ending: frozenset({Phase.RELEASED}) for ending in ENDINGS},
    Phase.RELEASED: frozenset(),
}


@dataclass(frozen=True)
class ScopeStatistics:
    req_id: str
    part_idx: int
    phase: str
    answered: bool
    error: str | None  # the error's type, once it ended badly
    age: float


class RequestScope:
    """One live request: its phase, its delivery, its cancel scope, its one answer."""

    def __init__(self, request: EncodeRequest, delivery: Delivery, *, deadline: float,
                 on_release: Callable[[RequestScope], None]) -> None:
        self.request = request
        self.delivery = delivery
        self.phase = Phase.ADMITTED
        self.ending: Phase | None = None  # DELIVERED, FAILED or ABORTED, set once
        self.error: EPDError | None = None  # set with a FAILED or ABORTED ending
        self.abort_reason: EPDError | None = None  # why it was cancelled, if it was
        self.cancel_scope = trio.CancelScope(deadline=deadline)
        self.started = trio.current_time()
        self._answer: outcome.Outcome | None = None
        self._answered = trio.Event()
        self._waiting: trio.CancelScope | None = None  # a wait_answer watching its client
        self._released = trio.Event()
        self._on_release = on_release
        self.close_failure: str | None = None  # "error" or "timeout": the delivery's aclose failed

    @property
    def key(self) -> Key:
        return self.request.key

    @property
    def ended(self) -> bool:
        return self.ending is not None

    @property
    def answered(self) -> bool:
        return self._answer is not None

    def advance(self, phase: Phase) -> None:
        """Move to ``phase``; a step backwards or sideways is a bug."""
        if phase not in _NEXT[self.phase]:
            raise RuntimeError(f"{self!r}: no way from {self.phase.value} to {phase.value}")
        self.phase = phase

    def end(self, error: EPDError | None) -> None:
        """Record how it ended: delivered, or failed / aborted with ``error``."""
        if error is None:
            self.advance(Phase.DELIVERED)
        else:
            self.advance(Phase.ABORTED if self.abort_reason is not None else Phase.FAILED)
            self.error = error
        self.ending = self.phase

    def answer(self, result: outcome.Outcome[Answer]) -> None:
        """Give the face its answer; there is exactly one."""
        if self._answer is not None:
            raise RuntimeError(f"{self!r} was already answered")
        self._answer = result
        self._answered.set()
        if self._waiting is not None:
            self._waiting.cancel()

    async def wait_answer(self, until_gone: Callable[[], Awaitable[None]] | None = None) -> Answer:
        """The answer; with ``until_gone`` (returns once the caller's client has left), an
        ``AbortedError`` if the client leaves first. Both are watched in this one task: the
        answer cancels the wait for the client, so no watcher task is needed beside it."""
        if until_gone is None:
            await self._answered.wait()
        elif self._answer is None:
            with trio.CancelScope() as waiting:
                self._waiting = waiting
                try:
                    await until_gone()
                finally:
                    self._waiting = None
            if self._answer is None:
                raise AbortedError("the client went away", req_id=self.request.req_id)
        assert self._answer is not None
        return self._answer.unwrap()

    def abort(self, reason: EPDError) -> None:
        """Cancel the scope (the first reason is kept); one that has ended is left alone."""
        if self.ended:
            return
        if self.abort_reason is None:
            self.abort_reason = reason
        self.cancel_scope.cancel()

    async def release(self) -> None:
        """Close the delivery (shielded, at most ``CLOSE_TIMEOUT``), then leave the registry.

        Whatever ``aclose`` raises or however long it hangs, the scope leaves
        the registry: its id may be admitted again and a drain does not wait
        for it. An ``EPDError`` is an expected failure (logged); anything else
        is a bug, logged with its traceback and counted.
        """
        try:
            with trio.CancelScope(shield=True) as closing:
                closing.deadline = trio.current_time() + CLOSE_TIMEOUT
                try:
                    await self.delivery.aclose()
                except EPDError as exc:
                    log.info("closing the delivery of %s failed: %s (released anyway)",
                             self.request.req_id, exc)
                except Exception:  # a delivery's bug: logged and counted, never raised here
                    self.close_failure = "error"
                    log.exception("closing the delivery of %s part %d failed unexpectedly "
                                  "(released anyway)", self.request.req_id, self.request.part_idx)
            if closing.cancelled_caught:
                self.close_failure = "timeout"
                log.error("closing the delivery of %s part %d took over %g s (released anyway)",
                          self.request.req_id, self.request.part_idx, CLOSE_TIMEOUT)
        finally:
            if self.ending is None:  # a bug in the lifecycle; the release still completes
                log.error("%r was released before it ended", self)
            self.phase = Phase.RELEASED
            self._on_release(self)
            self._released.set()

    @property
    def released(self) -> bool:
        return self._released.is_set()

    @property
    def unsettled(self) -> bool:
        """A write this scope started may still land in a receiver's memory (see
        ``PulledDelivery.unsettled``): until it has stopped, the receiver must not
        reuse that memory."""
        return isinstance(self.delivery, PulledDelivery) and self.delivery.unsettled

    @property
    def let_go(self) -> bool:
        """Released, and nothing it started can still touch a receiver's memory."""
        return self.released and not self.unsettled

    async def wait_released(self) -> None:
        await self._released.wait()

    def statistics(self) -> ScopeStatistics:
        return ScopeStatistics(self.request.req_id, self.request.part_idx, self.phase.value,
                               self.answered, type(self.error).__name__ if self.error else None,
                               trio.current_time() - self.started)

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<RequestScope {s.req_id!r} part {s.part_idx}: {s.phase}"
                f"{', answered' if s.answered else ''}{f', {s.error}' if s.error else ''}>")


@dataclass(frozen=True)
class RegistryStatistics:
    live_requests: int
    started: int
    completed: int
    failed: int
    aborted: int
    release_errors: int = 0  # a delivery's aclose raised a bug (logged with its traceback)
    release_timeouts: int = 0  # a delivery's aclose ran past CLOSE_TIMEOUT
    unsettled: int = 0  # released scopes with a write that may still land (see RequestScope.unsettled)


class ScopeRegistry:
    """The table of live request scopes of one encoder.

    Beside them it remembers released scopes whose writes may still land in a
    receiver's memory (``unsettled``), so that an ``/abort`` naming one hears
    that it has not let go, rather than a 404 the receiver would take for
    "nothing of yours is held".
    """

    def __init__(self) -> None:
        self._live: dict[Key, RequestScope] = {}
        self._unsettled: list[RequestScope] = []
        self._started = 0
        self._ended = {Phase.DELIVERED: 0, Phase.FAILED: 0, Phase.ABORTED: 0}
        self._close_failures = {"error": 0, "timeout": 0}
        self._idle = trio.Event()
        self._idle.set()

    def admit(self, request: EncodeRequest, delivery: Delivery, *, deadline: float) -> RequestScope:
        """A new scope for ``request``; a live duplicate is a 409."""
        if request.key in self._live:
            raise DuplicateRequestError(f"request {request.req_id!r} part {request.part_idx} "
                                        "is already live on this encoder", req_id=request.req_id)
        scope = RequestScope(request, delivery, deadline=deadline, on_release=self._release)
        self._live[request.key] = scope
        self._started += 1
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        return scope

    def _release(self, scope: RequestScope) -> None:
        if self._live.get(scope.key) is scope:
            del self._live[scope.key]
        if scope.ending is not None:
            self._ended[scope.ending] += 1
        if scope.close_failure is not None:
            self._close_failures[scope.close_failure] += 1
        if scope.unsettled:
            self._remember_unsettled(scope)
        if not self._live:
            self._idle.set()

    def _remember_unsettled(self, scope: RequestScope) -> None:
        self._prune_settled()
        self._unsettled.append(scope)
        if len(self._unsettled) > MAX_UNSETTLED:
            forgotten = self._unsettled.pop(0)
            log.warning("%r is forgotten while its write may still land (over %d such scopes)",
                        forgotten, MAX_UNSETTLED)

    def _prune_settled(self) -> None:
        self._unsettled = [s for s in self._unsettled if s.unsettled]

    def get(self, key: Key) -> RequestScope:
        try:
            return self._live[key]
        except KeyError:
            raise UnknownRequestError(f"no live request {key[0]!r} part {key[1]}", req_id=key[0]) from None

    def parts_of(self, req_id: str) -> list[int]:
        """The live parts of ``req_id``, in order."""
        return sorted(part for rid, part in self._live if rid == req_id)

    def abort(self, req_id: str, part_idx: int | None, reason: EPDError) -> list[RequestScope]:
        """Cancel the matching scopes and return them, with the released ones whose
        writes may still land (404 when there are none of either)."""
        def matches(key: Key) -> bool:
            return key[0] == req_id and (part_idx is None or key[1] == part_idx)

        self._prune_settled()
        hits = [s for k, s in self._live.items() if matches(k)]
        for scope in hits:
            scope.abort(reason)
        hits += [s for s in self._unsettled if matches(s.key)]
        if not hits:
            raise UnknownRequestError(f"no live request {req_id!r}", req_id=req_id)
        return hits

    def cancel_all(self, reason: EPDError) -> None:
        for scope in list(self._live.values()):
            scope.abort(reason)

    async def wait_idle(self) -> None:
        """Until no request is live (used to drain on shutdown)."""
        await self._idle.wait()

    def live(self) -> list[ScopeStatistics]:
        return [scope.statistics() for scope in self._live.values()]

    def statistics(self) -> RegistryStatistics:
        self._prune_settled()
        return RegistryStatistics(len(self._live), self._started, self._ended[Phase.DELIVERED],
                                  self._ended[Phase.FAILED], self._ended[Phase.ABORTED],
                                  self._close_failures["error"], self._close_failures["timeout"],
                                  len(self._unsettled))

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<ScopeRegistry {s.live_requests} live, {s.completed} completed, "
                f"{s.failed} failed, {s.aborted} aborted>")
