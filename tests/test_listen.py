"""Binding a server's port (epd_trio._listen): every way it fails is a ValueError naming it."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import trio
import trio.testing

from epd_trio._listen import RESOLVE_TIMEOUT, bound_listener


class _HangingResolver(trio.abc.HostnameResolver):
    async def getaddrinfo(self, *args: Any) -> Any:
        await trio.sleep_forever()

    async def getnameinfo(self, *args: Any) -> Any:  # pragma: no cover - never asked
        raise NotImplementedError


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


async def test_a_host_that_never_resolves_is_refused_after_the_timeout(clock: trio.testing.MockClock) -> None:
    trio.socket.set_custom_hostname_resolver(_HangingResolver())
    try:
        with pytest.raises(ValueError, match=f"cannot listen on encoder.internal:0 .*within {RESOLVE_TIMEOUT:g} s"):
            async with bound_listener("encoder.internal", 0):
                pass  # pragma: no cover
    finally:
        trio.socket.set_custom_hostname_resolver(None)
    assert trio.current_time() == RESOLVE_TIMEOUT


async def test_the_socket_is_closed_when_the_block_ends() -> None:
    async with bound_listener("127.0.0.1", 0) as listener:
        assert listener.sock.getsockname()[1] > 0
    assert listener.sock.fileno() == -1


async def test_a_port_in_use_is_refused_and_nothing_is_left_open() -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(ValueError, match=rf"cannot listen on 127.0.0.1:{port} \(--host, --port\)"):
            async with bound_listener("127.0.0.1", port):
                pass  # pragma: no cover
