"""Tools for proving that nothing leaks and nothing hangs: fault plans and quiescence.

``FaultPlan`` injects a delay, an exception or a cancellation at named points
of the request lifecycle. Production code has no fault branch: ``install_faults``
wraps an owner's seams (the engine's media source, preprocessing step and
admission; a scheduler's forward; the service's deliveries; a Mooncake
transport's writes; the client's dispatch, gather and demultiplexer hand-off)
with wrappers that ask the plan, one installer module per part
(``engine_faults``, ``encoder_faults``, ``transport_faults``, ``client_faults``). Without a
plan nothing is wrapped, so it costs nothing.
Plans are installed from Python only: no flag, variable or endpoint can reach them.

``assert_quiescent`` walks every owner's ``statistics()`` and checks that each
count of live things is back to its idle value, naming the owner and field
that still holds something.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from epd_trio.errors import EncodeError, TransportError

__all__ = [
    "AppRouter",
    "FAULT_POINTS",
    "Fault",
    "FaultPlan",
    "InjectedFault",
    "LIVE_FIELDS",
    "NotQuiescent",
    "assert_quiescent",
    "install_faults",
    "quiescence_problems",
    "run_threads_inline",
]

FAULT_POINTS = ("media_load", "preprocess", "admission", "forward", "send", "release",
                "client_dispatch", "client_gather", "demux", "write")

# Statistics fields that count things alive right now; idle means 0.
LIVE_FIELDS = frozenset({
    "admitted", "preprocessing", "queued", "running", "live_requests", "requests_live",
    "parts_live", "used_bytes", "slots", "waiters", "waiting_bytes", "busy_sockets",
    "registered_regions", "registered_bytes", "reaping", "inflight", "outstanding", "pending",
})


class InjectedFault(EncodeError):
    """The exception a plan raises by default: typed, so callers see an EPDError."""


@dataclass(frozen=True)
class Fault:
    """At ``point``, with ``probability``: ``delay`` seconds, then raise or cancel."""

    point: str
    probability: float = 1.0
    delay: float = 0.0
    error: Callable[[str], BaseException] | None = None
    cancel: bool = False

    def __post_init__(self) -> None:
        if self.point not in FAULT_POINTS:
            raise ValueError(f"unknown fault point {self.point!r}; points: {', '.join(FAULT_POINTS)}")


@dataclass
class FaultPlan:
    """A seeded script of faults; the same seed replays the same decisions."""

    seed: int
    faults: list[Fault] = field(default_factory=list)
    hits: dict[str, int] = field(default_factory=dict)
    fired: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    @classmethod
    def random(cls, seed: int, *, points: Iterable[str] = FAULT_POINTS, rate: float = 0.15,
               max_delay: float = 2.0) -> FaultPlan:
        """A plan of a few random faults at random points (the chaos suite's generator)."""
        rng = random.Random(seed)
        faults = []
        for point in points:
            if rng.random() >= rate * 3:
                continue
            kind = rng.choice(["delay", "error", "cancel"])
            faults.append(Fault(
                point, probability=rng.choice([0.2, 0.5, 1.0]),
                delay=rng.uniform(0, max_delay) if kind == "delay" or rng.random() < 0.3 else 0.0,
                error=_error_for(point) if kind == "error" else None,
                cancel=kind == "cancel"))
        return cls(seed, faults)

    def _decide(self, point: str) -> Fault | None:
        self.hits[point] = self.hits.get(point, 0) + 1
        for fault in self.faults:
            if fault.point == point and self._rng.random() < fault.probability:
                return fault
        return None

    async def inject(self, point: str, cancel: Callable[[], Any] | None = None) -> None:
        """An async point: maybe sleep, then maybe raise or cancel ``cancel``'s scope."""
        fault = self._decide(point)
        if fault is None:
            return
        if fault.delay:
            self.fired.append((point, f"delay {fault.delay:.3f}"))
            await trio.sleep(fault.delay)
        self._act(point, fault, cancel)
        await trio.lowlevel.checkpoint()  # a cancellation lands here

    def inject_sync(self, point: str) -> None:
        """A point in a worker thread (the forward): maybe block, then maybe raise."""
        fault = self._decide(point)
        if fault is None:
            return
        if fault.delay:
            self.fired.append((point, f"delay {fault.delay:.3f}"))
            time.sleep(min(fault.delay, 0.05))  # real time: keep thread faults short
        self._act(point, fault, None)

    def _act(self, point: str, fault: Fault, cancel: Callable[[], Any] | None) -> None:
        if fault.cancel and cancel is not None:
            self.fired.append((point, "cancel"))
            cancel()
        elif fault.error is not None:
            self.fired.append((point, "error"))
            raise fault.error(point)

    def describe(self) -> str:
        """Enough to replay: the seed and what fired."""
        return f"FaultPlan(seed={self.seed}): " + (", ".join(f"{p}: {a}" for p, a in self.fired) or "nothing fired")


def _error_for(point: str) -> Callable[[str], BaseException]:
    if point in ("send", "client_gather", "demux", "write"):
        return lambda p: TransportError(f"injected transport fault at {p}")
    return lambda p: InjectedFault(f"injected fault at {p}")


def install_faults(plan: FaultPlan | None, *owners: Any) -> None:
    """Install (or with None remove) ``plan`` on every owner.

    Each part of the package has its own installer module here (encoder,
    engine, client): an installer wraps its owner's seams and says whether it
    knew the owner. Production code never looks for a plan.
    """
    from epd_trio.testing import client_faults, encoder_faults, engine_faults, transport_faults

    installers = (encoder_faults.install, engine_faults.install, transport_faults.install,
                  client_faults.install)
    for owner in owners:
        if not any(install(plan, owner) for install in installers):
            raise TypeError(f"{type(owner).__name__} has no fault injection points")


class NotQuiescent(AssertionError):
    """Something still holds a resource after all work has finished."""


def _walk(path: tuple[str, ...], value: Any) -> Iterable[tuple[tuple[str, ...], Any]]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # field by field, not asdict(): that deep-copies, and mappingproxy fields cannot be
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        for key, sub in value.items():
            yield from _walk((*path, str(key)), sub)
    elif isinstance(value, (list, tuple)):  # e.g. /stats "workers": one entry per device
        for index, sub in enumerate(value):
            yield from _walk((*path, str(index)), sub)
    else:
        yield path, value


def quiescence_problems(owners: Mapping[str, Any], idle: Mapping[str, int] | None = None) -> list[str]:
    """``owner.field=value`` for every live count not at its idle value.

    ``owners`` maps a name to an object with ``statistics()`` or to a
    statistics value itself (e.g. a remote ``/stats`` JSON). A count is live
    when its field, or a mapping it sits in (``outstanding[url]``), is named in
    ``LIVE_FIELDS``. ``idle`` gives expected values, by dotted path, for counts
    whose idle value is not 0 (``{"client.pool_registrations": 1}``).
    """
    idle = idle or {}
    problems = []
    for name, owner in owners.items():
        stats = owner.statistics() if hasattr(owner, "statistics") else owner
        for path, value in _walk((name,), stats):
            if not any(part in LIVE_FIELDS for part in path[1:]):
                continue
            if isinstance(value, int) and not isinstance(value, bool):
                dotted = ".".join(path)
                want = idle.get(dotted, 0)
                if value != want:
                    problems.append(f"{dotted}={value} (idle is {want})")
    return problems


def assert_quiescent(owners: Mapping[str, Any], idle: Mapping[str, int] | None = None) -> None:
    """Raise ``NotQuiescent`` naming every owner that still holds something."""
    problems = quiescence_problems(owners, idle)
    if problems:
        raise NotQuiescent("not quiescent: " + "; ".join(problems))


class AppRouter(httpx.AsyncBaseTransport):
    """An in-process HTTP "network": ``http://NAME/...`` goes to the ASGI app named NAME.

    With it, a client and several encoder apps run in one trio program with no
    sockets, so ``MockClock`` controls every wait. An unknown host answers
    like a dead peer (``httpx.ConnectError``).
    """

    def __init__(self, apps: Mapping[str, Any]) -> None:
        self._transports = {name: httpx.ASGITransport(app=app) for name, app in apps.items()}
        self.down: set[str] = set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        transport = self._transports.get(host)
        if transport is None or host in self.down:
            raise httpx.ConnectError(f"no app at {host}", request=request)
        return await transport.handle_async_request(request)


def run_threads_inline(*owners: Any) -> None:
    """Make owners run their blocking work inline instead of in worker threads.

    Under ``MockClock(autojump_threshold=0)`` a task waiting for a thread
    looks idle, so the clock would jump to the next deadline while the thread
    works; inline, the work happens between two checkpoints in virtual time 0.
    An engine's schedulers (one per device) are included with it.
    """
    async def inline(fn: Callable[..., Any], *args: Any, limiter: Any = None, **_: Any) -> Any:
        await trio.lowlevel.checkpoint()
        return fn(*args)

    for owner in owners:
        if not hasattr(owner, "run_sync"):
            raise TypeError(f"{type(owner).__name__} has no run_sync seam")
        owner.run_sync = inline
        for scheduler in getattr(owner, "schedulers", ()):
            scheduler.run_sync = inline
