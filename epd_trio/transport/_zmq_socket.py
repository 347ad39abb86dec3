"""``TrioSocket``: a pyzmq socket whose waits are trio checkpoints.

pyzmq has no trio support, so every call here is non-blocking and the waits go
through the socket's FD. That FD is *edge*-triggered and only says "something
changed": the truth is ``ZMQ_EVENTS``, read before every wait (skipping that can
sleep forever with data already queued).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Sequence
from typing import Final, Protocol, cast

import trio
import zmq

from epd_trio.errors import TransferTimeout
from epd_trio.protocol.codec import FrameLike
from epd_trio.transport._poll import SPIN, poll_until

__all__ = ["ReleaseLedger", "TrioSocket", "tracker_spin"]

_TRACKER_POLL_MAX: Final = 0.005  # seconds; a 64 MiB frame takes ~40 ms on loopback
# Below this many usable cores a watched send does not spin: the spinning trio thread would
# take a core from the two libzmq I/O threads moving the bytes (measured on 2 cores, loaded:
# 16 MiB went at 0.39 x the raw socket with the spin, 0.81 without).
SPIN_MIN_CORES: Final = 4
# Plain ints: or-ing pyzmq's flag enums builds a new enum member on every call.
_NOBLOCK: Final = int(zmq.NOBLOCK)
_NOBLOCK_MORE: Final = int(zmq.NOBLOCK | zmq.SNDMORE)
_EVENTS: Final = int(zmq.EVENTS)
_POLLIN: Final = int(zmq.POLLIN)
_POLLOUT: Final = int(zmq.POLLOUT)


def tracker_spin(cores: int) -> float:
    """Seconds a watched send looks at every scheduler pass (``poll_until``'s ``spin``)."""
    return SPIN if cores >= SPIN_MIN_CORES else 0.0


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


class _Tracker(Protocol):
    @property
    def done(self) -> bool: ...


class ReleaseLedger:
    """Sans-IO: which sent messages libzmq may still read, and whether one more may go unwatched.

    Watching a zero-copy send until libzmq lets go of its buffers takes a
    poll (pyzmq tells only through a tracker), and a poll that looks often
    spins the trio thread: on a few cores that takes a core from the libzmq
    I/O threads that move the bytes, so a 1 MiB message went at ~0.3 x a raw
    socket (``tools/bench_transfer.py``). pyzmq keeps every zero-copy buffer
    alive until it is released anyway, so a small message need not be
    watched; the watched ones are those that would take the unreleased bytes
    over ``budget``, which bounds the memory that answered sends still hold.
    """

    def __init__(self, budget: int) -> None:
        if budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        self.budget = budget
        self._pending: collections.deque[tuple[_Tracker, int]] = collections.deque()
        self._bytes = 0

    @property
    def unreleased_bytes(self) -> int:
        """Bytes of unwatched messages not yet known released (released ones are forgotten)."""
        while self._pending and self._pending[0][0].done:  # libzmq frees in send order
            self._bytes -= self._pending.popleft()[1]
        return self._bytes

    def leave_unwatched(self, tracker: _Tracker, nbytes: int) -> bool:
        """True: the sender may return now (the message is counted until released)."""
        if tracker.done:
            return True
        if self.unreleased_bytes + nbytes > self.budget:
            return False
        self._pending.append((tracker, nbytes))
        self._bytes += nbytes
        return True


class TrioSocket:
    """A zmq socket whose waits are trio checkpoints.

    trio lets one task wait on an FD, so one task at a time (the watcher) sleeps
    on it and the others park on an Event the watcher sets when it wakes. Any
    zmq call may consume the edge a sleeper waits for, so whoever reads EVENTS
    and sees a state that some sleeper wants wakes them all.
    """

    def __init__(self, sock: zmq.Socket[bytes], *, release_budget: int = 0,
                 spin: float | None = None) -> None:
        self.socket = sock
        self._released = ReleaseLedger(release_budget)
        self._spin = tracker_spin(usable_cores()) if spin is None else spin
        self._fd = sock.fileno()
        self._send_lock = trio.Lock()  # FIFO among senders; a message is atomic anyway
        self._recv_lock = trio.Lock()
        self._sleeping: dict[int, int] = {_POLLIN: 0, _POLLOUT: 0}
        self._watch: trio.CancelScope | None = None
        self._changed = trio.Event()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def unreleased_bytes(self) -> int:
        """Bytes of sent messages whose buffers libzmq may still read (see ``send_multipart``)."""
        return self._released.unreleased_bytes

    async def send_multipart(self, frames: Sequence[FrameLike], *, timeout: float) -> None:
        """Send one message; return once zmq no longer reads the frames' buffers,
        or at once while this socket's unreleased messages stay within ``release_budget``.

        Frames of 64 KiB and more go zero-copy: they must never change after
        sending (pyzmq keeps them alive until libzmq releases them; see
        ``ReleaseLedger`` for why small messages are not watched).
        ``TransferTimeout`` when ``timeout`` passes first (a message already
        accepted may still be delivered later).

        A message that libzmq takes at once (room in its queue, no other
        sender waiting first) and that need not be watched costs no timeout
        scope and no lock: the common case for one image's embedding.
        """
        if not frames:
            raise ValueError("a ZMQ message has at least one frame")
        nbytes = sum(memoryview(f).nbytes for f in frames)
        await trio.lowlevel.checkpoint_if_cancelled()
        tracker = self._send_now(frames)
        if tracker is not None and self._released.leave_unwatched(tracker, nbytes):
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        with trio.move_on_after(timeout):
            if tracker is None:
                tracker = await self._send_nowait_loop(frames)
            if not self._released.leave_unwatched(tracker, nbytes):
                await poll_until(lambda: tracker.done, max_pause=_TRACKER_POLL_MAX,
                                 spin=self._spin)
            return
        raise TransferTimeout(f"ZMQ send not done within {timeout:g} s")

    async def receive_multipart(self) -> list[zmq.Frame]:
        """The next whole message; frames expose their buffers without a copy.

        One schedule point per message: the wait for it, or one at the end
        when it was already there.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        slept = await self._acquire(self._recv_lock)
        try:
            while True:
                self._check_open()
                slept = await self._wait(_POLLIN) or slept
                try:
                    frames = self.socket.recv_multipart(flags=_NOBLOCK, copy=False)
                except zmq.Again:  # EVENTS said a message was there; look again
                    continue
                self._after_io()
                break
        finally:
            self._recv_lock.release()
        if not slept:
            await trio.lowlevel.cancel_shielded_checkpoint()
        return frames

    def close(self, linger_ms: int = 0) -> None:
        """Close now; tasks waiting on this socket get ``trio.ClosedResourceError``."""
        if self._closed:
            return
        self._closed = True
        trio.lowlevel.notify_closing(self._fd)
        self._wake()
        self.socket.close(linger=linger_ms)

    async def aclose(self, linger_ms: int = 0) -> None:
        self.close(linger_ms)
        await trio.lowlevel.checkpoint()

    def _send_now(self, frames: Sequence[FrameLike]) -> zmq.MessageTracker | None:
        """Queue the message unless another sender is first or libzmq has no room (None)."""
        self._check_open()
        if self._send_lock.locked():  # FIFO: a waiting sender holds the lock
            return None
        try:
            tracker = self._send_parts(frames)
        except zmq.Again:
            return None
        self._after_io()
        return tracker

    async def _send_nowait_loop(self, frames: Sequence[FrameLike]) -> zmq.MessageTracker:
        async with self._send_lock:
            while True:
                self._check_open()
                try:
                    tracker = self._send_parts(frames)
                except zmq.Again:
                    await self._wait(_POLLOUT)
                    continue
                self._after_io()
                return tracker

    def _send_parts(self, frames: Sequence[FrameLike]) -> zmq.MessageTracker:
        """Queue all parts, tracking the last one that goes zero-copy.

        libzmq writes a message's parts to the wire in order and lets go of
        each once written (or dropped), and pyzmq reports the releases from one
        thread in that order: once the last zero-copy part is released, so are
        the others. Tracking it alone spares a ``threading.Event`` per 1 MiB
        frame and the setting of it. Parts under pyzmq's copy threshold are
        copied now and need none. Not ``send_multipart``: no ``zmq.Frame`` kept
        here (while one lives, libzmq never reports its buffer released).
        ``zmq.Again`` can only come from the first part (libzmq takes a whole
        message or none of it).
        """
        parts = [_untracked(f) for f in frames]
        threshold = self.socket.copy_threshold
        tracked = max((i for i, p in enumerate(parts)
                       if not threshold or memoryview(p).nbytes >= threshold), default=-1)
        tracker = zmq.MessageTracker()  # done: nothing zero-copy
        last = len(parts) - 1
        for i, part in enumerate(parts):
            flags = _NOBLOCK_MORE if i < last else _NOBLOCK
            if i == tracked:
                tracker = self.socket.send(part, flags, copy=False, track=True)
            else:
                self.socket.send(part, flags, copy=False)
        return tracker

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the ZMQ socket was closed")

    async def _wait(self, flag: int) -> bool:
        """Return once EVENTS has ``flag``; sleep on the FD only while it hasn't.

        True when it slept (a schedule point), False when ``flag`` was already there.
        """
        slept = False
        while True:
            self._check_open()
            if self._events() & flag:
                return slept
            self._sleeping[flag] += 1
            try:
                await self._sleep_on_fd()
            finally:
                self._sleeping[flag] -= 1
            slept = True

    @staticmethod
    async def _acquire(lock: trio.Lock) -> bool:
        """``lock.acquire()`` without its schedule point when the lock is free;
        True when it waited (a schedule point)."""
        try:
            lock.acquire_nowait()
        except trio.WouldBlock:
            await lock.acquire()
            return True
        return False

    def _events(self) -> int:
        """Read EVENTS, waking the sleepers who want what it shows.

        Any zmq call (this one included) may consume the edge they sleep on.
        """
        events = cast(int, self.socket.getsockopt(_EVENTS))
        if any(n and events & flag for flag, n in self._sleeping.items()):
            self._wake()
        return events

    def _after_io(self) -> None:
        if any(self._sleeping.values()):
            self._events()

    async def _sleep_on_fd(self) -> None:
        if self._watch is not None:  # someone else watches the FD: park
            await self._changed.wait()
            return
        with trio.CancelScope() as scope:
            self._watch = scope
            try:
                await trio.lowlevel.wait_readable(self._fd)
            finally:
                self._watch = None
                self._wake()

    def _wake(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        self._changed.set()
        self._changed = trio.Event()


def _untracked(frame: FrameLike) -> FrameLike:
    """A received ``zmq.Frame`` can't be sent tracked; its buffer (no copy) can."""
    return frame.buffer if isinstance(frame, zmq.Frame) else frame
