"""The Mooncake delivery backend: writes straight into a peer's registered memory.

``MooncakeTransport`` owns one ``mooncake.engine.TransferEngine`` started in
P2P-handshake mode (no metadata server). Its calls block but release the GIL,
so they run in worker threads under limiters. A write is submitted, then polled
from trio, both in a task of the transport's own nursery, so the caller's
deadline covers the whole write (the submit makes the first handshake with a
peer: up to a minute against a silent one). A write still in flight when its
deadline passes keeps its source memory registered and alive until the engine
reports it finished (a peer must never read freed memory).

Every blocking call has a bound: ``initialize`` runs under ``start_timeout`` in
a thread a cancellation abandons (it holds nothing of ours); a write's caller
waits at most its ``timeout`` plus ``_SETTLE_LIMIT``; a submit still running
when the transport closes is abandoned, and its thread waits for its own write
(at most ``_REAP_LIMIT``) holding the source alive.

Both packages, ``mooncake-transfer-engine`` (CUDA hosts) and
``mooncake-transfer-engine-non-cuda`` (with Debian's ``libibverbs1``), install
the same ``mooncake`` module. Without either, opening the transport raises
``TransportError`` saying what to install. The engine logs through glog to
stderr at the level ``MC_LOG_LEVEL`` names when ``mooncake`` is first imported
(``GLOG_minloglevel`` is not read). A library must be quiet in its user's
process: unless it is set, the first import here sets ``WARNING`` (``epd-trio``
sets it before, from ``--log-level``: ``INFO`` only at debug).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from epd_trio.errors import PeerUnavailable, TransferTimeout, TransportError
from epd_trio.transport._poll import poll_until

__all__ = ["MooncakeStatistics", "MooncakeTransport", "Registration", "open_mooncake"]

log = logging.getLogger(__name__)

INSTALL_HINT = ("the Mooncake transfer engine is not installed: pip install 'epd-trio[mooncake]' "
                "on CUDA hosts, or 'epd-trio[mooncake-cpu]' (plus Debian's libibverbs1) elsewhere")

_PENDING, _DONE = 0, 1
_POLL_MAX = 0.02  # seconds between looks at a long write
# An abandoned write is waited for this long (so its caller answers only once no
# byte can still land); after that its task keeps the source alive, up to
# _REAP_LIMIT more, before giving up on the engine and logging the leak.
_SETTLE_LIMIT = 10.0
_REAP_LIMIT = 600.0
START_TIMEOUT = 60.0  # seconds ``initialize`` may take (RDMA discovery is the slow part)
LIBRARY_LOG_LEVEL = "WARNING"  # the engine's glog level unless MC_LOG_LEVEL says otherwise


def _load_engine_class() -> Any:
    # glog reads MC_LOG_LEVEL once, at this first import; a value already set wins.
    os.environ.setdefault("MC_LOG_LEVEL", LIBRARY_LOG_LEVEL)
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise TransportError(f"{INSTALL_HINT} ({exc})") from None
    return TransferEngine


@dataclass(frozen=True)
class MooncakeStatistics:
    session: str
    registered_regions: int
    registered_bytes: int
    writes: int
    bytes_written: int
    failures: int
    timeouts: int
    reaping: int


@dataclass(frozen=True)
class Registration:
    address: int
    nbytes: int


@dataclass(eq=False)
class _Write:
    """One write's state, shared by its caller, its task and its submit thread."""

    peer: str
    local: int
    remote: int
    nbytes: int
    keepalive: object  # alive as long as this: the source the engine reads
    limit: float  # the task's own bound, past the caller's
    finished: trio.Event = field(default_factory=trio.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)  # batch and abandoned
    batch: int | None = None  # the engine's id, once submitted
    status: int = _PENDING
    error: TransportError | None = None
    abandoned: bool = False  # the submit thread was left: it waits for its write itself
    orphaned: bool = False  # the caller left: the task releases the held region
    region: int = 0


class MooncakeTransport:
    """One transfer engine; open it with ``open_mooncake``."""

    def __init__(self, engine: Any, host: str, nursery: trio.Nursery, max_threads: int) -> None:
        self._engine = engine
        self.session = f"{host}:{engine.get_rpc_port()}"
        self._nursery = nursery
        self._limiter = trio.CapacityLimiter(max_threads)  # register, unregister
        # Submits apart: one stuck on a silent peer must not hold up a release.
        self._submit_limiter = trio.CapacityLimiter(max_threads)
        self._regions: dict[int, int] = {}
        self._held: dict[int, int] = {}  # region → timed-out writes still reading it
        self._deferred: set[int] = set()  # released by their owner while still held
        self._writes = self._bytes = self._failures = self._timeouts = self._reaping = 0

    # ---- memory -------------------------------------------------------------
    async def register(self, address: int, nbytes: int) -> Registration:
        rc = await trio.to_thread.run_sync(self._engine.register_memory, address, nbytes,
                                           limiter=self._limiter)
        if rc != 0:
            raise TransportError(f"mooncake could not register {nbytes} bytes at {address:#x} ({rc})")
        self._regions[address] = nbytes
        return Registration(address, nbytes)

    async def unregister(self, registration: Registration) -> None:
        if registration.address in self._held:  # the write's task unregisters it when it ends
            self._deferred.add(registration.address)
            return
        await self._unregister(registration.address)

    async def _unregister(self, address: int) -> None:
        if self._regions.pop(address, None) is None:
            return
        with trio.CancelScope(shield=True):  # a release must complete
            await trio.to_thread.run_sync(self._engine.unregister_memory, address,
                                          limiter=self._limiter)

    @asynccontextmanager
    async def registered(self, address: int, nbytes: int) -> AsyncIterator[Registration]:
        registration = await self.register(address, nbytes)
        try:
            yield registration
        finally:
            await self.unregister(registration)

    # ---- writes -------------------------------------------------------------
    async def write(self, peer: str, local: int, remote: int, nbytes: int, *, timeout: float,
                    keepalive: object = None) -> None:
        """Write ``nbytes`` from our registered ``local`` to ``peer``'s ``remote``.

        ``timeout`` covers the submit (and so the first handshake) and the
        transfer; past it, or cancelled, the caller still waits (shielded) up to
        ``_SETTLE_LIMIT`` for the engine to stop, so no byte lands after we
        answered. ``keepalive`` (e.g. the source tensor) is held past that until
        the engine has finished with the source memory.
        """
        job = _Write(peer, local, remote, nbytes, keepalive, limit=timeout + _REAP_LIMIT)
        self._nursery.start_soon(self._run, job)
        try:
            with trio.fail_after(timeout):
                await job.finished.wait()
        except BaseException as exc:  # timed out or cancelled: the engine may still be writing
            await self._settle(job)
            if isinstance(exc, trio.TooSlowError):
                self._timeouts += 1
                raise TransferTimeout(
                    f"mooncake write of {nbytes} bytes to {peer} took over {timeout} s") from None
            raise
        self._check(job)

    def _check(self, job: _Write) -> None:
        if job.error is not None:
            self._failures += 1
            raise job.error
        if job.batch is None or job.batch <= 0:  # the handshake failed
            self._failures += 1
            raise PeerUnavailable(f"mooncake peer {job.peer} is unreachable")
        if job.status != _DONE:
            self._failures += 1
            raise TransportError(f"mooncake write of {job.nbytes} bytes to {job.peer} failed "
                                 f"({job.status}); is the destination buffer registered and large enough?")
        self._writes += 1
        self._bytes += job.nbytes

    async def _run(self, job: _Write) -> None:
        """Submit and poll one write, in the transport's nursery: it outlives a caller who left."""
        try:
            with trio.move_on_after(job.limit):
                batch = await self._submit(job)
                if batch > 0:  # <= 0: no handshake; checking such an id would crash the engine
                    job.status = await self._poll(batch)
        except TransportError as exc:
            job.error = exc
        finally:
            job.finished.set()
        if job.orphaned:  # no checkpoint since finished.set(): _settle saw it unset
            await self._release(job)

    async def _submit(self, job: _Write) -> int:
        try:
            return await trio.to_thread.run_sync(self._submit_in_thread, job, abandon_on_cancel=True,
                                                 limiter=self._submit_limiter)
        except trio.Cancelled:  # the transport closes (or the job's limit): the thread is left
            with job.lock:
                job.abandoned = True
                batch = job.batch
            if batch is not None and batch > 0:  # submitted as we gave up: the thread won't wait
                with trio.CancelScope(shield=True), trio.move_on_after(_SETTLE_LIMIT):
                    job.status = await self._poll(batch)
            raise

    def _submit_in_thread(self, job: _Write) -> int:
        """The blocking submit; abandoned meanwhile, wait here for the write (``job`` keeps the source alive)."""
        try:
            batch = int(self._engine.transfer_submit_write(job.peer, job.local, job.remote, job.nbytes))
        except Exception as exc:  # the binding's own error: typed, for the caller
            raise TransportError(f"mooncake could not submit a write to {job.peer}: {exc}") from exc
        with job.lock:
            job.batch = batch
            abandoned = job.abandoned
        if abandoned and batch > 0:
            deadline = time.monotonic() + _REAP_LIMIT  # a worker thread: trio's clock is not ours here
            while time.monotonic() < deadline and self._engine.transfer_check_status(batch) == _PENDING:
                time.sleep(_POLL_MAX)
        return batch

    async def _poll(self, batch: int) -> int:
        status = _PENDING

        def done() -> bool:
            nonlocal status
            status = self._engine.transfer_check_status(batch)
            return bool(status != _PENDING)

        await poll_until(done, max_pause=_POLL_MAX)
        return int(status)

    async def _settle(self, job: _Write) -> None:
        """Wait (shielded, bounded) until an abandoned write has stopped.

        Until it has, the engine may still read our source *and write into the
        peer's buffer*: answering before that would let the receiver reuse
        memory a late write then lands in. Past ``_SETTLE_LIMIT`` the write's
        own task keeps the source registered and alive for as long as the
        engine needs it (up to ``_REAP_LIMIT``).
        """
        with trio.CancelScope(shield=True):
            with trio.move_on_after(_SETTLE_LIMIT):
                await job.finished.wait()
        if job.finished.is_set():
            return
        job.orphaned = True
        job.region = self._region_of(job.local)  # held before our caller's finally can unregister it
        self._held[job.region] = self._held.get(job.region, 0) + 1
        self._reaping += 1

    async def _release(self, job: _Write) -> None:
        """An orphaned write's task has ended: let its source region go, unless the engine still may read it."""
        self._reaping -= 1
        if job.abandoned or (job.batch is not None and job.batch > 0 and job.status == _PENDING):
            log.error("mooncake write to %s never finished; its source stays registered", job.peer)
            return
        self._held[job.region] -= 1
        if not self._held[job.region]:
            del self._held[job.region]
            if job.region in self._deferred:
                self._deferred.discard(job.region)
                await self._unregister(job.region)

    def in_use(self, registration: Registration) -> bool:
        """Whether a write that outlived its caller still reads this region.

        Its bytes may then still land in the peer's buffer: a caller must not
        tell that peer to reuse the buffer.
        """
        return registration.address in self._held

    def _region_of(self, address: int) -> int:
        for start, size in self._regions.items():
            if start <= address < start + size:
                return start
        return address

    def statistics(self) -> MooncakeStatistics:
        return MooncakeStatistics(self.session, len(self._regions), sum(self._regions.values()),
                                  self._writes, self._bytes, self._failures, self._timeouts,
                                  self._reaping)

    def __repr__(self) -> str:
        s = self.statistics()
        return f"<MooncakeTransport {s.session}: {s.registered_regions} regions, {s.writes} writes>"


@asynccontextmanager
async def open_mooncake(host: str = "127.0.0.1", protocol: str = "tcp", device: str = "",
                        *, max_threads: int = 4,
                        start_timeout: float = START_TIMEOUT) -> AsyncIterator[MooncakeTransport]:
    """A started transfer engine for the duration of the block.

    ``initialize`` gets ``start_timeout`` seconds; it holds nothing of ours, so
    a cancellation (Ctrl-C) or that deadline leaves its thread to end alone.
    """
    engine = _load_engine_class()()
    with trio.move_on_after(start_timeout) as starting:
        rc = await trio.to_thread.run_sync(engine.initialize, host, "P2PHANDSHAKE", protocol, device,
                                           abandon_on_cancel=True)
    if starting.cancelled_caught:
        raise TransportError(f"mooncake transfer engine did not start on {host} over {protocol} "
                             f"within {start_timeout:g} s")
    if rc != 0:
        raise TransportError(f"mooncake transfer engine failed to start on {host} over {protocol} ({rc})")
    async with trio.open_nursery() as nursery:
        transport = MooncakeTransport(engine, host, nursery, max_threads)
        try:
            yield transport
        finally:
            nursery.cancel_scope.cancel()
