"""Live requests: one scope per (req_id, part_idx), with its cancel scope and result.

The registry is how ``/abort``, duplicates (409), shutdown and ``/stats`` see a
request. A scope is registered synchronously when the request is accepted and
unregistered in the scope task's ``finally`` — so "live requests" returns to
zero exactly when every request has released what it held.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import outcome
import trio

from epd_trio.errors import DuplicateRequestError, EPDError, UnknownRequestError

__all__ = ["RegistryStatistics", "RequestRegistry", "RequestScope"]

Key = tuple[str, int]


@dataclass(eq=False)
class RequestScope:
    """A request's handle: cancel it, wait for its outcome."""

    key: Key
    cancel_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    ready: trio.Event = field(default_factory=trio.Event)  # the HTTP answer can be given
    finished: trio.Event = field(default_factory=trio.Event)  # released
    result: outcome.Outcome | None = None
    cancel_reason: EPDError | None = None
    mailbox: Any = None  # a staging.Mailbox while a Mooncake delivery waits for /send
    failure: BaseException | None = None  # how it ended, if badly (after any early answer)

    @property
    def req_id(self) -> str:
        return self.key[0]

    def set_result(self, result: outcome.Outcome) -> None:
        """First answer wins: a later failure (a send) cannot replace a given answer."""
        if self.result is None:
            self.result = result
            self.ready.set()

    def cancel(self, reason: EPDError) -> None:
        if self.cancel_reason is None:
            self.cancel_reason = reason
        self.cancel_scope.cancel()


@dataclass(frozen=True)
class RegistryStatistics:
    live_requests: int
    started: int
    completed: int
    failed: int
    aborted: int


class RequestRegistry:
    """Owns the table of live request scopes of one encoder."""

    def __init__(self) -> None:
        self._live: dict[Key, RequestScope] = {}
        self._started = self._completed = self._failed = self._aborted = 0
        self._idle = trio.Event()
        self._idle.set()

    @contextmanager
    def register(self, key: Key) -> Iterator[RequestScope]:
        """Hold ``key`` for the scope's lifetime; a live duplicate is a 409."""
        if key in self._live:
            raise DuplicateRequestError(
                f"request {key[0]!r} part {key[1]} is already live on this encoder", req_id=key[0])
        scope = self._live[key] = RequestScope(key)
        self._started += 1
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        try:
            yield scope
        finally:
            del self._live[key]
            self._count(scope)
            scope.finished.set()
            if not self._live:
                self._idle.set()

    def _count(self, scope: RequestScope) -> None:
        if scope.cancel_reason is not None:
            self._aborted += 1
        elif scope.failure is None and isinstance(scope.result, outcome.Value):
            self._completed += 1
        else:
            self._failed += 1

    def get(self, key: Key) -> RequestScope:
        try:
            return self._live[key]
        except KeyError:
            raise UnknownRequestError(f"no live request {key[0]!r} part {key[1]}", req_id=key[0]) from None

    def abort(self, req_id: str, part_idx: int | None, reason: EPDError) -> list[RequestScope]:
        """Cancel the matching scopes and return them (404 when none)."""
        hits = [s for k, s in self._live.items()
                if k[0] == req_id and (part_idx is None or k[1] == part_idx)]
        if not hits:
            raise UnknownRequestError(f"no live request {req_id!r}", req_id=req_id)
        for scope in hits:
            scope.cancel(reason)
        return hits

    def cancel_all(self, reason: EPDError) -> None:
        for scope in list(self._live.values()):
            scope.cancel(reason)

    async def wait_idle(self) -> None:
        """Until no request is live (used to drain on shutdown)."""
        await self._idle.wait()

    def statistics(self) -> RegistryStatistics:
        return RegistryStatistics(len(self._live), self._started, self._completed,
                                  self._failed, self._aborted)

    def __repr__(self) -> str:
        s = self.statistics()
        return f"<RequestRegistry {s.live_requests} live, {s.completed} completed, {s.failed} failed>"

