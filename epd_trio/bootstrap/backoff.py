"""Capped exponential backoff: a pure function of the attempt number.

No jitter on purpose: schedules stay exact under ``MockClock``, and the
callers (one heartbeat per encoder, one health loop per registry) are spread
by their own start times rather than synchronised by a shared event.
"""

from __future__ import annotations

__all__ = ["backoff_delay"]

# 2**62 already dwarfs any sane cap; bounding the exponent keeps a task that
# retries forever from overflowing float conversion after ~1000 attempts.
_MAX_EXPONENT = 62


def backoff_delay(attempt: int, initial: float, cap: float) -> float:
    """Seconds to wait before retry number ``attempt`` (0-based): ``initial · 2^attempt``, at most ``cap``."""
    if attempt < 0 or initial <= 0 or cap <= 0:
        raise ValueError(f"need attempt >= 0, initial > 0, cap > 0 (got {attempt}, {initial}, {cap})")
    return min(cap, initial * 2 ** min(attempt, _MAX_EXPONENT))
