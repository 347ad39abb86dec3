"""Fault installation for the Mooncake transport: its point ``write``, and held writes.

``MooncakeTransport.engine`` is the transfer engine the transport calls from
its threads; wrapping it is the seam. A plan's ``write`` point fires in the
submit thread of every write (a short delay, or an error the transport types
as ``TransportError``). ``held_writes`` keeps every write's submit waiting
until the test lets it go, so a write is *surely* in flight while the test
aborts, times out or shuts down around it: no timing luck. The transport
itself never looks for a plan.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Final

from epd_trio.transport.mooncake import MooncakeTransport

if TYPE_CHECKING:
    from epd_trio.testing import FaultPlan

__all__ = ["FaultyEngine", "WriteGate", "held_writes", "install"]

# A held write is let go after this long even if the test never opens the gate, so a
# failing test ends instead of leaving a thread blocked forever.
_HOLD_LIMIT: Final = 60.0


class _Wrapper:
    """Everything but what a subclass overrides goes to the real engine."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class FaultyEngine(_Wrapper):
    """The real transfer engine with the plan's ``write`` point before each submit."""

    def __init__(self, inner: Any, plan: FaultPlan) -> None:
        super().__init__(inner)
        self._plan = plan

    def transfer_submit_write(self, peer: str, local: int, remote: int, nbytes: int) -> int:
        self._plan.inject_sync("write")
        return int(self.inner.transfer_submit_write(peer, local, remote, nbytes))


class WriteGate(_Wrapper):
    """The real transfer engine whose writes wait at their submit until ``open()``."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self._open = threading.Event()
        self._lock = threading.Lock()
        self.waiting = 0  # submits held right now (read from the trio thread)
        self.held = 0  # submits ever held

    def transfer_submit_write(self, peer: str, local: int, remote: int, nbytes: int) -> int:
        with self._lock:
            self.waiting += 1
            self.held += 1
        try:
            self._open.wait(_HOLD_LIMIT)
        finally:
            with self._lock:
                self.waiting -= 1
        return int(self.inner.transfer_submit_write(peer, local, remote, nbytes))

    def open(self) -> None:
        """Let every held write (and every later one) go to the real engine."""
        self._open.set()


@contextmanager
def held_writes(transport: MooncakeTransport) -> Iterator[WriteGate]:
    """Hold ``transport``'s writes for the block (or until ``gate.open()``); open on exit."""
    gate = WriteGate(transport.engine)
    transport.engine = gate
    try:
        yield gate
    finally:
        gate.open()
        transport.engine = gate.inner


def install(plan: FaultPlan | None, owner: Any) -> bool:
    """Install ``plan`` on ``owner`` if it is a Mooncake transport; False if it is not."""
    if not isinstance(owner, MooncakeTransport):
        return False
    engine = owner.engine
    while isinstance(engine, FaultyEngine):  # installing twice does not stack
        engine = engine.inner
    owner.engine = engine if plan is None else FaultyEngine(engine, plan)
    return True
