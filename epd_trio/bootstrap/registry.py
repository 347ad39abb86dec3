"""The registry's state and every decision about it, as pure functions of ``now``.

Nothing here imports trio or reads a clock: the health loop (``health.py``)
and the HTTP app (``app.py``) pass ``trio.current_time()`` in, so ``MockClock``
controls all of it. One encoder's life::

    register ─► healthy ──(max_failures-th consecutive miss)──► evicted ──(evicted_ttl)──► forgotten
                   ▲  (a miss: failures + 1; an answer: failures = 0)    │
                   └──────────────────(an answer: revived)───────────────┘

Evicted encoders stay in the registry (and keep being probed) but are left
out of ``healthy_urls()``; ``unregister`` removes one at once.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from epd_trio.errors import OverloadedError

# An encoder URL's rule lives with the wire (protocol/urls.py); re-exported for bootstrap's callers.
from epd_trio.protocol.urls import normalize_url

__all__ = [
    "EncoderEntry",
    "Registry",
    "RegistryStatistics",
    "Transition",
    "after_probe",
    "is_expired",
    "normalize_url",
]

# ---- one encoder's state and the decisions about it -------------------------
@dataclass(frozen=True)
class EncoderEntry:
    """What the registry knows of one encoder. Times are ``trio.current_time()`` values."""

    url: str
    registered_at: float
    healthy: bool = True
    failures: int = 0  # consecutive missed probes
    last_ok: float | None = None  # last successful probe (None: never probed OK)
    evicted_at: float | None = None


class Transition(enum.Enum):
    """What a probe result changed about an encoder's membership in the list."""

    UNCHANGED = "unchanged"
    EVICTED = "evicted"
    REVIVED = "revived"


def after_probe(entry: EncoderEntry, ok: bool, now: float, max_failures: int) -> EncoderEntry:
    """The entry after one probe: an answer resets the misses (and revives), the
    ``max_failures``-th consecutive miss evicts; evicted entries stay evicted."""
    if ok:
        return dataclasses.replace(entry, healthy=True, failures=0, last_ok=now, evicted_at=None)
    failures = entry.failures + 1
    if entry.healthy and failures >= max_failures:
        return dataclasses.replace(entry, healthy=False, failures=failures, evicted_at=now)
    return dataclasses.replace(entry, failures=failures)


def transition(before: EncoderEntry, after: EncoderEntry) -> Transition:
    if before.healthy and not after.healthy:
        return Transition.EVICTED
    if after.healthy and not before.healthy:
        return Transition.REVIVED
    return Transition.UNCHANGED


def is_expired(entry: EncoderEntry, now: float, evicted_ttl: float) -> bool:
    """An encoder evicted for ``evicted_ttl`` seconds is forgotten."""
    return entry.evicted_at is not None and now - entry.evicted_at >= evicted_ttl


# ---- the registry -------------------------------------------------------------
@dataclass(frozen=True)
class RegistryStatistics:
    encoders: int
    healthy: int
    evicted: int
    registrations: int  # new entries (a duplicate register is not counted)
    unregistrations: int
    probes: int
    probe_failures: int
    evictions: int
    revivals: int
    forgotten: int


class Registry:
    """Encoders by normalized URL, in registration order. Plain state: no I/O, no clock."""

    def __init__(self, *, max_failures: int, evicted_ttl: float, max_encoders: int = 1024) -> None:
        if max_failures < 1 or evicted_ttl <= 0 or max_encoders < 1:
            raise ValueError("max_failures and max_encoders must be >= 1 and evicted_ttl > 0")
        self.max_failures = max_failures
        self.evicted_ttl = evicted_ttl
        self.max_encoders = max_encoders
        self._entries: dict[str, EncoderEntry] = {}
        self._counts = dict.fromkeys(
            ("registrations", "unregistrations", "probes", "probe_failures",
             "evictions", "revivals", "forgotten"), 0)

    def register(self, url: str, now: float) -> bool:
        """Add ``url`` (already normalized) as healthy; a duplicate is ignored → False.

        ``OverloadedError`` (503) when ``max_encoders`` are registered: every entry costs a
        probe per round, and registration may be open to anyone on the network.
        """
        if url in self._entries:
            return False
        if len(self._entries) >= self.max_encoders:
            raise OverloadedError(f"the registry holds its maximum of {self.max_encoders} encoders "
                                  "(--max-encoders); unregister some, or wait for dead ones to be forgotten")
        self._entries[url] = EncoderEntry(url=url, registered_at=now)
        self._counts["registrations"] += 1
        return True

    def unregister(self, url: str) -> bool:
        """Remove ``url`` at once, evicted or not; unknown → False (idempotent)."""
        if self._entries.pop(url, None) is None:
            return False
        self._counts["unregistrations"] += 1
        return True

    def record_probe(self, url: str, ok: bool, now: float) -> Transition | None:
        """Apply one probe result; None if ``url`` left the registry while being probed."""
        before = self._entries.get(url)
        if before is None:
            return None
        after = after_probe(before, ok, now, self.max_failures)
        self._entries[url] = after
        self._counts["probes"] += 1
        self._counts["probe_failures"] += not ok
        change = transition(before, after)
        if change is Transition.EVICTED:
            self._counts["evictions"] += 1
        elif change is Transition.REVIVED:
            self._counts["revivals"] += 1
        return change

    def expire(self, now: float) -> list[str]:
        """Forget encoders evicted ``evicted_ttl`` ago or more; returns their URLs."""
        gone = [url for url, e in self._entries.items() if is_expired(e, now, self.evicted_ttl)]
        for url in gone:
            del self._entries[url]
        self._counts["forgotten"] += len(gone)
        return gone

    def urls(self) -> list[str]:
        """Every known encoder, evicted ones included (the health loop probes them all)."""
        return list(self._entries)

    def healthy_urls(self) -> list[str]:
        return [url for url, e in self._entries.items() if e.healthy]

    def get(self, url: str) -> EncoderEntry | None:
        return self._entries.get(url)

    def entries(self) -> list[EncoderEntry]:
        return list(self._entries.values())

    def statistics(self) -> RegistryStatistics:
        healthy = sum(e.healthy for e in self._entries.values())
        return RegistryStatistics(encoders=len(self._entries), healthy=healthy,
                                  evicted=len(self._entries) - healthy, **self._counts)

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<Registry {s.encoders} encoders: {s.healthy} healthy, {s.evicted} evicted; "
                f"{s.evictions} evictions, {s.revivals} revivals, {s.forgotten} forgotten>")
