"""Waiting on a completion that only a poll can see (a ZMQ tracker, a Mooncake batch).

Both the ZMQ and the Mooncake delivery answer their HTTP request only when the
transfer is done, so a late look is added latency. A timed trio sleep lasts at
least 1 ms (epoll's resolution), longer than a 1-4 MiB transfer takes on
loopback; so the first ``spin`` seconds look at every scheduler pass (other
tasks still run), and after that the pauses grow with the time already spent,
so the look comes at most ~1/8 late. Time comes from ``trio.current_time()``
only, so a ``MockClock`` drives it in tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import trio

__all__ = ["SPIN", "poll_until"]

SPIN: Final = 0.002  # seconds of looking at every pass: ~4-6 MiB on loopback
SPIN_PASSES: Final = 500  # ...and at most this many, so a MockClock (frozen while we spin) moves on
LATE: Final = 8  # a pause is the time spent so far divided by this


async def poll_until(done: Callable[[], bool], *, max_pause: float, spin: float = SPIN) -> None:
    """Return once ``done()`` is true (checked at once, then as described above)."""
    start, passes = trio.current_time(), 0
    while not done():
        elapsed = trio.current_time() - start
        passes += 1
        spinning = elapsed < spin and passes <= SPIN_PASSES
        await trio.sleep(0 if spinning else max(min(elapsed / LATE, max_pause), 1e-6))
