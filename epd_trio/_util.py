"""Small helpers shared across the package."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import trio

from epd_trio.errors import EPDError

__all__ = ["first_leaf", "leaves", "wait_done"]

log = logging.getLogger(__name__)


def leaves(exc: BaseException) -> Iterator[BaseException]:
    """Every non-group exception of a (nested) exception group, in order."""
    if isinstance(exc, BaseExceptionGroup):
        for child in exc.exceptions:
            yield from leaves(child)
    else:
        yield exc


def first_leaf(group: BaseException) -> BaseException:
    """The first non-group exception of a (nested) exception group; the others are logged.

    The caller answers with one typed error, not the group trio wraps it in.
    The siblings are not dropped silently: an ``EPDError`` is an expected
    failure (logged at INFO), a ``trio.Cancelled`` is the nursery's own
    clean-up (DEBUG), a ``KeyboardInterrupt`` or ``SystemExit`` is logged at
    WARNING, and any other exception is a bug, logged at ERROR with its
    traceback. Logged rather than re-raised: the answer is already chosen and
    re-raising a sibling would replace it (a 4xx would become a 500), while a
    caller that must not answer over a bug filters first with
    ``except* EPDError`` — the leaves that clause does not match are re-raised
    by Python itself.
    """
    first, *siblings = leaves(group)
    for sibling in siblings:
        if isinstance(sibling, trio.Cancelled):
            log.debug("beside %r: %r", first, sibling)
        elif isinstance(sibling, EPDError):
            log.info("beside %s: also %s: %s", type(first).__name__, type(sibling).__name__, sibling)
        elif not isinstance(sibling, Exception):  # KeyboardInterrupt, SystemExit: not bugs
            log.warning("beside %s: also %r", type(first).__name__, sibling)
        else:
            log.error("beside %s: a sibling failed with a bug", type(first).__name__,
                      exc_info=(type(sibling), sibling, sibling.__traceback__))
    return first


async def wait_done(future: Any) -> None:
    """Until ``future`` is done, without a thread: its done-callback, run by whichever
    thread completes it (or at once when it already is), wakes this task.

    ``future`` is a ``concurrent.futures.Future`` or a grpcio one (anything whose
    ``add_done_callback`` calls back with the future). A cancelled wait leaves the
    future as it is: the caller decides whether to cancel it or clean up after it.
    """
    token, done = trio.lowlevel.current_trio_token(), trio.Event()
    future.add_done_callback(lambda _: _wake(token, done))
    await done.wait()


def _wake(token: trio.lowlevel.TrioToken, done: trio.Event) -> None:
    try:
        token.run_sync_soon(done.set)
    except trio.RunFinishedError:  # trio has ended: nobody waits any more
        pass
