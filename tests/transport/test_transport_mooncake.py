"""The Mooncake transport's bounds and its quiet default, with real engines over TCP.

A peer that accepts TCP but never answers the handshake makes the engine's
submit block (about a minute, the engine's own limit): that is the real
stuck call the write's deadline must cover.
"""

from __future__ import annotations

import math
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import trio
import trio.testing

if os.environ.get("EPD_REQUIRE_MOONCAKE") != "1":
    pytest.importorskip("mooncake.engine", reason="Mooncake is an optional extra (epd-trio[mooncake-cpu])")

from epd_trio.errors import TransferTimeout, TransportError
from epd_trio.transport import mooncake as mooncake_module
from epd_trio.transport.mooncake import _SETTLE_LIMIT, open_mooncake

GLOG_INFO = re.compile(r"^I\d{4} ", re.MULTILINE)
OPEN_ONE = """
import trio
from epd_trio.transport.mooncake import open_mooncake

async def main():
    async with open_mooncake("127.0.0.1") as mc:
        print(mc.session)

trio.run(main)
"""


@pytest.mark.parametrize(("given", "info_lines"), [(None, False), ("INFO", True)])
def test_the_engine_is_quiet_in_a_users_process_unless_asked(given: str | None, info_lines: bool) -> None:
    """The library sets no level over the user's; without one the engine's INFO lines stay out."""
    env = {k: v for k, v in os.environ.items() if k != "MC_LOG_LEVEL"}
    if given is not None:
        env["MC_LOG_LEVEL"] = given
    run = subprocess.run([sys.executable, "-c", OPEN_ONE], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert bool(GLOG_INFO.search(run.stderr)) is info_lines, run.stderr


@pytest.fixture
def silent_peer() -> Iterator[tuple[str, socket.socket]]:
    """A Mooncake peer name whose port accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}", listener
    finally:
        listener.close()  # resets the pending handshakes: a submit still blocked there returns


def real_time(clock: trio.testing.MockClock) -> None:
    """The engine's start (its own deadline) and our waits for real threads run in real time."""
    clock.autojump_threshold, clock.rate = math.inf, 1.0


def virtual_time(clock: trio.testing.MockClock) -> None:
    clock.rate, clock.autojump_threshold = 0.0, 0.0


async def test_a_submit_stuck_on_a_silent_peer_is_under_the_deadline(
        autojump_clock: trio.testing.MockClock, silent_peer: tuple[str, socket.socket]) -> None:
    peer, listener = silent_peer
    source = torch.arange(4096, dtype=torch.uint8)
    real_time(autojump_clock)
    async with open_mooncake("127.0.0.1") as mc:
        async with mc.registered(source.data_ptr(), source.numel()) as region:
            assert not mc.in_use(region)
            virtual_time(autojump_clock)
            start = trio.current_time()
            with pytest.raises(TransferTimeout, match=r"took over 2.0 s"):
                await mc.write(peer, source.data_ptr(), 1 << 20, source.numel(), timeout=2.0,
                               keepalive=source)
            # The deadline, then the bounded wait for the engine to stop; not the engine's minute.
            assert trio.current_time() - start == 2.0 + _SETTLE_LIMIT
            s = mc.statistics()
            assert (s.timeouts, s.reaping, s.writes) == (1, 1, 0)
            assert mc.in_use(region)  # the stuck write may still land: its owner is told
        # Still registered after its owner let go: the stuck submit may yet read it.
        assert mc.statistics().registered_regions == 1
        listener.close()  # the handshake fails now: the write's task ends and lets the region go
        real_time(autojump_clock)
        with trio.fail_after(60):
            while mc.statistics().reaping:
                await trio.sleep(0.01)
        s = mc.statistics()
        assert (s.reaping, s.registered_regions, s.registered_bytes) == (0, 0, 0)
        assert not mc.in_use(region)


async def test_the_transport_closes_without_waiting_for_a_stuck_submit(
        autojump_clock: trio.testing.MockClock, silent_peer: tuple[str, socket.socket]) -> None:
    """A caller cancelled at once, then the close: neither waits for the engine's minute."""
    peer, listener = silent_peer
    source = torch.arange(4096, dtype=torch.uint8)
    real_time(autojump_clock)
    async with open_mooncake("127.0.0.1") as mc:
        async with mc.registered(source.data_ptr(), source.numel()):
            virtual_time(autojump_clock)
            start = trio.current_time()
            with trio.move_on_after(1.0) as scope:
                await mc.write(peer, source.data_ptr(), 1 << 20, source.numel(), timeout=30.0,
                               keepalive=source)
            assert scope.cancelled_caught
    assert trio.current_time() - start == 1.0 + _SETTLE_LIMIT
    # Closed while the engine's handshake still waits: the close did not wait for it.
    assert await trio.to_thread.run_sync(handshake_still_waiting, listener)


def handshake_still_waiting(listener: socket.socket) -> bool:
    """The engine's connection to the silent peer is open (a finished submit closes it)."""
    listener.settimeout(60)  # the abandoned submit connects in its own time
    conn, _ = listener.accept()
    with conn:
        conn.setblocking(False)
        try:
            while conn.recv(1 << 16):  # its handshake request
                pass
        except BlockingIOError:
            return True
        return False  # end of stream: the engine gave up and closed


class StuckEngine:
    """An engine whose ``initialize`` blocks, as one can while probing RDMA devices.

    Released by the test; the 30 s fallback only turns a missing bound into a
    failure instead of a hang.
    """

    def __init__(self) -> None:
        self.release = threading.Event()

    def initialize(self, *args: Any) -> int:
        self.release.wait(30)
        return 0

    def get_rpc_port(self) -> int:
        return 1


@pytest.fixture
def stuck_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[StuckEngine]:
    engine = StuckEngine()
    monkeypatch.setattr(mooncake_module, "_load_engine_class", lambda: lambda: engine)
    try:
        yield engine
    finally:
        engine.release.set()


async def test_initialize_has_a_deadline(autojump_clock: trio.testing.MockClock,
                                         stuck_engine: StuckEngine) -> None:
    start = trio.current_time()
    with pytest.raises(TransportError, match=r"did not start on 127.0.0.1 over tcp within 5 s"):
        async with open_mooncake("127.0.0.1", start_timeout=5.0):
            pytest.fail("a stuck engine started")
    assert trio.current_time() - start == 5.0


async def test_a_cancelled_start_abandons_initialize(autojump_clock: trio.testing.MockClock,
                                                      stuck_engine: StuckEngine) -> None:
    """Ctrl-C while the engine starts: the block is left at once, the thread ends alone."""
    start = trio.current_time()
    with trio.move_on_after(1.0) as scope:
        async with open_mooncake("127.0.0.1"):
            pytest.fail("a stuck engine started")
    assert scope.cancelled_caught and trio.current_time() - start == 1.0


class UnregisterHangs:
    """The real engine, except that ``unregister_memory`` blocks until released."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def unregister_memory(self, address: int) -> int:
        self.release.wait(30)
        return int(self.inner.unregister_memory(address))


async def test_an_unregister_that_hangs_is_cut_at_its_bound(autojump_clock: trio.testing.MockClock) -> None:
    """A release waits for the engine's unregister at most its bound, then goes on: the
    region is counted as still registered and stuck, the thread left to end alone."""
    source = torch.arange(4096, dtype=torch.uint8)
    real_time(autojump_clock)
    async with open_mooncake("127.0.0.1") as mc:
        hanging = UnregisterHangs(mc.engine)
        mc.engine = hanging
        try:
            async with mc.registered(source.data_ptr(), source.numel()):
                virtual_time(autojump_clock)
                start = trio.current_time()
            assert trio.current_time() - start == mooncake_module._UNREGISTER_LIMIT
            s = mc.statistics()
            assert (s.stuck_unregisters, s.registered_regions) == (1, 1), s
        finally:
            hanging.release.set()
            mc.engine = hanging.inner
