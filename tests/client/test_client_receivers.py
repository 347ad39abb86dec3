"""The receiver contract, checked the same way for every registered receiver; and the
guard that keeps backend names inside ``epd_trio/client/receiving/``.

Each receiver in ``RECEIVERS`` runs against real peers: two encoder servers in
this process (Hypercorn-free built-in HTTP on port 0, the tiny generated
checkpoint) that serve inline, ZMQ and, where the Mooncake extra is installed,
Mooncake writes (a real TransferEngine over TCP on both sides). For each: the
embeddings equal the encoders' own engine output bit for bit, and after a
success, a failed part, a deadline and the caller's cancellation the client's
``statistics()`` show nothing left and the encoders hold nothing. A receiver
whose encoders write in place (``staged``) keeps the request's slot until the
parts' ``/abort`` calls have ended.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import trio

import epd_trio
from conftest import docstring_ids, png_bytes
from epd_trio.client import EncoderClient, RemoteEncodeError, open_encoder_client
from epd_trio.client.calls import encoder_transport
from epd_trio.client.pool import PoolStatistics
from epd_trio.client.receiving import RECEIVERS, Receiver, build_receiver
from epd_trio.config import CLIENT_BACKENDS, ClientConfig, EncoderConfig, EngineConfig
from epd_trio.encoder.server import EncoderServer, serve_encoder
from epd_trio.errors import EncodeTimeout
from epd_trio.testing import Fault, FaultPlan, install_faults

HAVE_MOONCAKE = importlib.util.find_spec("mooncake") is not None
REQUIRE_MOONCAKE = os.environ.get("EPD_REQUIRE_MOONCAKE") == "1"  # CI: never skipped
IMAGES = [png_bytes(56, 56, seed=1), png_bytes(84, 56, seed=2), png_bytes(56, 112, seed=3)]
IN_PLACE = [name for name, cls in RECEIVERS.items() if cls.staged]


def backends(names: list[str]) -> list[Any]:
    """Each name as a parameter; Mooncake's skipped without its extra (unless required)."""
    return [pytest.param(n, marks=pytest.mark.skipif(
        RECEIVERS[n] is RECEIVERS.get("mooncake") and not HAVE_MOONCAKE and not REQUIRE_MOONCAKE,
        reason="Mooncake is an optional extra (epd-trio[mooncake-cpu])")) for n in names]


@asynccontextmanager
async def two_encoders(model_path: str) -> AsyncIterator[list[EncoderServer]]:
    """Encoders that serve every backend this machine can: Mooncake's serves inline and ZMQ too."""
    backend = "mooncake" if HAVE_MOONCAKE else EncoderConfig.transfer_backend
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(serve_encoder(EncoderConfig(
            port=0, engine=EngineConfig(model_path=model_path), transfer_backend=backend)))
            for _ in range(2)]


def client_for(backend: str, servers: list[EncoderServer], **config: Any) -> EncoderClient:
    return open_encoder_client(encoder_urls=[s.url for s in servers], transfer_backend=backend,
                               pool_bytes=1 << 20, abort_timeout=5.0, **config)


def assert_nothing_left(client: EncoderClient) -> None:
    s = client.statistics()
    assert (s.requests_live, s.parts_live, sum(s.outstanding.values())) == (0, 0, 0), s
    pool = s.pool
    assert (pool.used_bytes, pool.slots, pool.waiters, pool.leaked, pool.view_held) == \
        (0, 0, 0, 0, 0), pool
    assert s.slots_held_after_abort == 0, s
    assert client.receiver.statistics().parts_live == 0, client.receiver
    if s.mooncake is not None:  # the pool's one registration, nothing in flight
        assert (s.mooncake.registered_regions, s.mooncake.unsettled_writes) == (1, 0), s.mooncake


async def wait_encoders_idle(servers: list[EncoderServer]) -> None:
    """Nothing live on any encoder, nothing staged for a write (within 15 s: an /abort
    releases at once; a part left to its own timeouts would take 60 s)."""
    def busy() -> list[Any]:
        found = []
        for server in servers:
            stats = server.service.statistics()
            mooncake = stats["mooncake"] or {"registered_regions": 0}
            found.append((stats["live_requests"], mooncake["registered_regions"]))
        return [b for b in found if any(b)]

    with trio.fail_after(15):
        while busy():
            await trio.sleep(0.02)


async def encoders_have_live_parts(servers: list[EncoderServer], count: int) -> None:
    with trio.fail_after(15):
        while sum(s.service.registry.statistics().live_requests for s in servers) < count:
            await trio.sleep(0.01)


def stall_preprocessing(servers: list[EncoderServer]) -> None:
    for server in servers:  # never in time: only an /abort ends these parts early
        install_faults(FaultPlan(0, [Fault("preprocess", delay=60.0)]), server.service.engine)


def test_every_backend_the_config_accepts_has_one_registered_receiver() -> None:
    assert set(RECEIVERS) == set(CLIENT_BACKENDS)
    for name, cls in RECEIVERS.items():
        assert issubclass(cls, Receiver) and not inspect.isabstract(cls), name
        receiver = build_receiver(ClientConfig(transfer_backend=name), None, lambda _: None)  # type: ignore[arg-type]
        assert type(receiver) is cls  # built, nothing acquired: no open, nothing to close
    assert IN_PLACE, "no receiver writes in place: the slot-ordering check below would test nothing"


@pytest.mark.parametrize("backend", backends(list(RECEIVERS)))
async def test_parts_arrive_bit_exact_and_leave_nothing(qwen25_path: str, backend: str) -> None:
    async with two_encoders(qwen25_path) as servers, client_for(backend, servers) as client:
        async with await client.encode({"image": IMAGES}) as result:
            got = result.embeddings["image"].clone()
            counts = result.token_counts["image"]
            grouping = [(p.encoder_url, [IMAGES[i] for i in p.item_indices]) for p in result.parts]
        assert {url for url, _ in grouping} == {s.url for s in servers}  # two parts, two encoders
        by_url = {s.url: s for s in servers}
        own = [await by_url[url].service.engine.encode(items, "image") for url, items in grouping]
        assert torch.equal(got, torch.cat([o.embedding for o in own]))
        assert counts == [c for o in own for c in o.token_counts]
        assert_nothing_left(client)
        assert client.statistics().messages_dropped == 0
        await wait_encoders_idle(servers)


@pytest.mark.parametrize("backend", backends(list(RECEIVERS)))
async def test_a_failed_part_leaves_nothing(qwen25_path: str, backend: str) -> None:
    async with two_encoders(qwen25_path) as servers, client_for(backend, servers) as client:
        with pytest.raises(RemoteEncodeError) as info:
            await client.encode({"image": [IMAGES[0], b"not an image"]})
        assert (info.value.status_code, info.value.part_idx) == (400, 1)
        assert_nothing_left(client)
        await wait_encoders_idle(servers)
        async with await client.encode({"image": IMAGES[:2]}) as result:  # still serves
            assert result.embeddings["image"].shape[0] == sum(result.token_counts["image"])
        assert_nothing_left(client)


@pytest.mark.parametrize("backend", backends(list(RECEIVERS)))
async def test_a_deadline_aborts_the_parts_and_leaves_nothing(qwen25_path: str, backend: str) -> None:
    async with two_encoders(qwen25_path) as servers, client_for(backend, servers) as client:
        stall_preprocessing(servers)
        with pytest.raises(EncodeTimeout):
            await client.encode({"image": IMAGES[:2]}, timeout=1.0)
        s = client.statistics()
        assert (s.requests_failed, s.aborts_sent, s.aborts_failed) == (1, 2, 0), s
        assert_nothing_left(client)
        await wait_encoders_idle(servers)


@pytest.mark.parametrize("backend", backends(list(RECEIVERS)))
async def test_the_callers_cancellation_aborts_the_parts_and_leaves_nothing(
        qwen25_path: str, backend: str) -> None:
    async with two_encoders(qwen25_path) as servers, client_for(backend, servers) as client:
        stall_preprocessing(servers)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.encode, {"image": IMAGES[:2]})
            await encoders_have_live_parts(servers, 2)
            nursery.cancel_scope.cancel()
        s = client.statistics()
        assert (s.requests_failed, s.aborts_sent, s.aborts_failed) == (1, 2, 0), s
        assert_nothing_left(client)
        await wait_encoders_idle(servers)


class SendNeverArrives(httpx.AsyncBaseTransport):
    """The real network, except that ``/send`` never reaches an encoder; records the pool
    as each ``/abort`` leaves."""

    def __init__(self) -> None:
        self.inner = encoder_transport()
        self.client: EncoderClient | None = None
        self.pool_at_abort: list[PoolStatistics] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/send":
            await trio.sleep_forever()
        if request.url.path == "/abort":
            assert self.client is not None
            self.pool_at_abort.append(self.client.pool.statistics())
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.parametrize("backend", backends(IN_PLACE))
async def test_an_in_place_slot_is_released_only_after_the_abort(qwen25_path: str, backend: str) -> None:
    """The parts are staged and the slot reserved, then the deadline passes while the writes
    are ordered: the encoders may still write there, so the slot is held through the /abort
    calls, and freed once they confirm."""
    transport = SendNeverArrives()
    async with two_encoders(qwen25_path) as servers, \
            client_for(backend, servers, http_transport=transport) as client:
        transport.client = client
        with pytest.raises(EncodeTimeout):
            await client.encode({"image": IMAGES[:2]}, timeout=3.0)
        assert len(transport.pool_at_abort) == 2  # both staged parts were aborted
        for pool in transport.pool_at_abort:
            assert (pool.slots, pool.used_bytes > 0) == (1, True), pool  # still the request's
        s = client.statistics()
        assert (s.aborts_sent, s.aborts_failed) == (2, 0), s
        assert_nothing_left(client)  # confirmed: freed at once, not held
        await wait_encoders_idle(servers)


# ---- the guard: the client outside ``receiving/`` names no backend --------------------------
CLIENT = Path(epd_trio.__file__).parent / "client"
RECEIVING = CLIENT / "receiving"
BACKEND_NAMES = frozenset({*CLIENT_BACKENDS, *RECEIVERS})


def backend_leaks(source: str) -> list[str]:
    """Each place that names a transfer backend (a string literal outside docstrings) or
    reads the setting that picks one (``.transfer_backend``), as ``line: what``."""
    tree = ast.parse(source)
    prose = docstring_ids(tree)
    found = [f"{n.lineno}: {n.value!r}" for n in ast.walk(tree)
             if isinstance(n, ast.Constant) and n.value in BACKEND_NAMES and id(n) not in prose]
    found += [f"{n.lineno}: .transfer_backend" for n in ast.walk(tree)
              if isinstance(n, ast.Attribute) and n.attr == "transfer_backend"]
    found += [f"{n.lineno}: transfer_backend=" for n in ast.walk(tree)
              if isinstance(n, ast.keyword) and n.arg == "transfer_backend"]
    return sorted(found)


def test_no_module_of_the_client_outside_receiving_names_a_backend() -> None:
    """Variation lives behind the receiver contract: no ``transfer_backend == "zmq"`` in the
    client, its router, its addresses or any module added later (every module of
    ``epd_trio/client/`` but ``receiving/`` is walked)."""
    modules = [p for p in sorted(CLIENT.rglob("*.py")) if RECEIVING not in p.parents]
    assert {"client.py", "addresses.py", "demux.py", "router.py", "state.py"} <= \
        {p.name for p in modules}
    leaks = {str(p.relative_to(CLIENT)): backend_leaks(p.read_text()) for p in modules}
    assert {path: found for path, found in leaks.items() if found} == {}


def test_the_receiving_package_is_where_the_backends_are_named() -> None:
    """The guard's exemption is not idle: the registration table names every backend."""
    named = backend_leaks((RECEIVING / "__init__.py").read_text())
    assert {leak.split(": ")[1].strip("'") for leak in named} >= set(RECEIVERS)


def test_the_client_guard_sees_a_backend_named_or_read() -> None:
    leaky = '''"""A docstring may say mooncake."""
def f(self, config):
    """And so may this one: zmq."""
    if self.config.transfer_backend == "mooncake":
        return {"backend": "inline"}
    return replace(config, transfer_backend=None)
'''
    assert backend_leaks(leaky) == ["4: 'mooncake'", "4: .transfer_backend", "5: 'inline'",
                                    "6: transfer_backend="]
