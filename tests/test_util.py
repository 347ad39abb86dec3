"""``first_leaf``: one error for the answer, and no sibling lost without a trace; ``wait_done``."""

from __future__ import annotations

import logging

import pytest
import trio

from epd_trio._util import first_leaf, leaves, wait_done
from epd_trio.errors import PeerUnavailable, TransferTimeout

UTIL = "epd_trio._util"


def raised(exc: BaseException) -> BaseException:
    """``exc`` with a traceback, as a child task's exception has one."""
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001 - only what was just raised
        return caught


def test_a_bare_exception_is_its_own_first_leaf(caplog: pytest.LogCaptureFixture) -> None:
    exc = TransferTimeout("slow")
    with caplog.at_level(logging.DEBUG, logger=UTIL):
        assert first_leaf(exc) is exc
    assert caplog.records == []


def test_nested_groups_flatten_in_order() -> None:
    a, b, c = ValueError("a"), KeyError("b"), TransferTimeout("c")
    group = BaseExceptionGroup("outer", [ExceptionGroup("inner", [a, b]), c])
    assert list(leaves(group)) == [a, b, c]
    assert first_leaf(group) is a


def test_expected_siblings_are_logged_at_info(caplog: pytest.LogCaptureFixture) -> None:
    first, second = TransferTimeout("to A"), PeerUnavailable("B is gone")
    with caplog.at_level(logging.DEBUG, logger=UTIL):
        assert first_leaf(ExceptionGroup("sends", [first, second])) is first
    [record] = caplog.records
    assert record.levelno == logging.INFO and "B is gone" in record.getMessage()
    assert record.exc_info is None


def test_a_sibling_that_is_a_bug_is_logged_with_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    first = TransferTimeout("to A")
    bug = raised(ZeroDivisionError("division by zero in a send"))
    with caplog.at_level(logging.DEBUG, logger=UTIL):
        assert first_leaf(ExceptionGroup("sends", [first, bug])) is first
    [record] = caplog.records
    assert record.levelno == logging.ERROR
    assert record.exc_info is not None and record.exc_info[1] is bug
    assert "ZeroDivisionError: division by zero in a send" in caplog.text
    assert "in raised" in caplog.text  # the traceback, not just the message


async def test_cancelled_siblings_are_only_debug(caplog: pytest.LogCaptureFixture) -> None:
    """A nursery that a failure cancelled: the others' Cancelled is clean-up, not news."""
    with caplog.at_level(logging.DEBUG, logger=UTIL):
        cancelled = None
        with trio.CancelScope() as scope:
            scope.cancel()
            try:
                await trio.sleep_forever()
            except trio.Cancelled as exc:
                cancelled = exc
        assert cancelled is not None
        first = raised(TransferTimeout("to A"))
        assert first_leaf(BaseExceptionGroup("g", [first, cancelled])) is first
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]


def test_an_interrupt_beside_is_a_warning_not_a_bug(caplog: pytest.LogCaptureFixture) -> None:
    first = TransferTimeout("to A")
    with caplog.at_level(logging.DEBUG, logger=UTIL):
        assert first_leaf(BaseExceptionGroup("g", [first, KeyboardInterrupt()])) is first
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


async def test_wait_done_wakes_on_the_completing_thread_and_leaves_a_cancelled_wait_alone() -> None:
    """A future completed on another thread wakes the waiting task; one already done returns
    at once; a cancelled wait leaves the future pending for its owner."""
    import threading
    from concurrent.futures import Future

    later: Future[int] = Future()
    threading.Timer(0.05, later.set_result, (7,)).start()
    with trio.fail_after(10):
        await wait_done(later)
    assert later.result() == 7

    done: Future[int] = Future()
    done.set_result(1)
    with trio.fail_after(10):
        await wait_done(done)

    pending: Future[int] = Future()
    with trio.move_on_after(0.01) as scope:
        await wait_done(pending)
    assert scope.cancelled_caught and not pending.done()
    pending.set_result(2)  # its callback finds nobody waiting: no error
