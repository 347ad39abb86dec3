"""The Mooncake delivery backend: writes straight into a peer's registered memory.

``MooncakeTransport`` owns one ``mooncake.engine.TransferEngine`` started in
P2P-handshake mode (no metadata server). Its calls block but release the GIL,
so they run in worker threads under a limiter. A write is submitted, then
polled from trio, so a deadline can fire; a write still in flight when its
deadline passes keeps its source memory registered and alive until the engine
reports it finished (a peer must never read freed memory), tracked by a
reaper task in the transport's own nursery.

Both packages, ``mooncake-transfer-engine`` (CUDA hosts) and
``mooncake-transfer-engine-non-cuda`` (with Debian's ``libibverbs1``), install
the same ``mooncake`` module. Without either, opening the transport raises
``TransportError`` saying what to install. The engine logs through glog to
stderr; ``MC_LOG_LEVEL=ERROR`` (or ``WARNING``), set before ``mooncake`` is first
imported, keeps only its errors (``GLOG_minloglevel`` is not read; ``epd-trio``
sets ``WARNING`` unless ``--log-level debug``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
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
# byte can still land); after that the reaper keeps its source alive, up to
# _REAP_LIMIT, before giving up on the engine and logging the leak.
_SETTLE_LIMIT = 10.0
_REAP_LIMIT = 600.0


def _load_engine_class() -> Any:
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


class MooncakeTransport:
    """One transfer engine; open it with ``open_mooncake``."""

    def __init__(self, engine: Any, host: str, nursery: trio.Nursery, max_threads: int) -> None:
        self._engine = engine
        self.session = f"{host}:{engine.get_rpc_port()}"
        self._nursery = nursery
        self._limiter = trio.CapacityLimiter(max_threads)
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
        if registration.address in self._held:  # the reaper unregisters it when the write ends
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

        ``keepalive`` (e.g. the source tensor) is held past a timeout until the
        engine has finished with the source memory.
        """
        batch = await trio.to_thread.run_sync(
            self._engine.transfer_submit_write, peer, local, remote, nbytes, limiter=self._limiter)
        if batch <= 0:  # the handshake failed: checking such an id would crash the engine
            self._failures += 1
            raise PeerUnavailable(f"mooncake peer {peer} is unreachable")
        try:
            with trio.fail_after(timeout):
                status = await self._poll(batch)
        except BaseException as exc:  # timed out or cancelled: the engine may still be writing
            await self._settle(batch, local, keepalive)
            if isinstance(exc, trio.TooSlowError):
                self._timeouts += 1
                raise TransferTimeout(
                    f"mooncake write of {nbytes} bytes to {peer} took over {timeout} s") from None
            raise
        if status != _DONE:
            self._failures += 1
            raise TransportError(f"mooncake write of {nbytes} bytes to {peer} failed ({status}); "
                                 "is the destination buffer registered and large enough?")
        self._writes += 1
        self._bytes += nbytes

    async def _poll(self, batch: int) -> int:
        status = _PENDING

        def done() -> bool:
            nonlocal status
            status = self._engine.transfer_check_status(batch)
            return bool(status != _PENDING)

        await poll_until(done, max_pause=_POLL_MAX)
        return int(status)

    async def _settle(self, batch: int, local: int, keepalive: object) -> None:
        """Wait (shielded, bounded) until an abandoned write has stopped.

        Until it has, the engine may still read our source *and write into the
        peer's buffer*: answering before that would let the receiver reuse
        memory a late write then lands in. Past ``_SETTLE_LIMIT`` the source is
        handed to the reaper and kept alive for as long as the engine needs it.
        """
        with trio.CancelScope(shield=True):
            with trio.move_on_after(_SETTLE_LIMIT):
                await self._poll(batch)
                return
        self._hold(local)  # before our caller's finally can unregister it
        self._nursery.start_soon(self._reap, batch, local, keepalive)

    def _hold(self, local: int) -> None:
        region = self._region_of(local)
        self._held[region] = self._held.get(region, 0) + 1
        self._reaping += 1

    async def _reap(self, batch: int, local: int, keepalive: object) -> None:
        """Keep a timed-out write's source registered and alive until the engine lets go."""
        region = self._region_of(local)
        with trio.move_on_after(_REAP_LIMIT) as scope:
            await self._poll(batch)
        self._reaping -= 1
        if scope.cancelled_caught:
            log.error("mooncake batch %d never finished; its source stays registered", batch)
            return
        self._held[region] -= 1
        if not self._held[region]:
            del self._held[region]
            if region in self._deferred:
                self._deferred.discard(region)
                await self._unregister(region)
        del keepalive

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
                        *, max_threads: int = 4) -> AsyncIterator[MooncakeTransport]:
    """A started transfer engine for the duration of the block."""
    engine_class = _load_engine_class()
    engine = engine_class()
    rc = await trio.to_thread.run_sync(engine.initialize, host, "P2PHANDSHAKE", protocol, device)
    if rc != 0:
        raise TransportError(f"mooncake transfer engine failed to start on {host} over {protocol} ({rc})")
    async with trio.open_nursery() as nursery:
        transport = MooncakeTransport(engine, host, nursery, max_threads)
        try:
            yield transport
        finally:
            nursery.cancel_scope.cancel()
