"""The encoder side of the registry: announce this encoder to every registry.

Each registry gets its own task, so one that is down delays no other. A task
registers (``POST /register_encoder_url``; any 2xx is success, whatever the
body, so SGLang's ``EncoderBootstrapServer``, which answers the text ``OK``,
serves as a registry too), and on failure retries with capped exponential
backoff for as long as the encoder lives — it never gives up, since a
registry started after its encoders must still learn of them. Once
registered it re-announces every ``heartbeat_interval`` (the registry ignores
duplicates), so a restarted registry is refilled within one heartbeat.

``open_registration`` stops announcing on exit, waits until no announcement is
in flight, then unregisters from every registry concurrently — shielded, and
bounded by ``UNREGISTER_TIMEOUT`` so a dead registry cannot hold a shutdown.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import httpx
import trio

from epd_trio.bootstrap.backoff import backoff_delay

__all__ = [
    "LinkStatistics",
    "Registration",
    "RegistrationStatistics",
    "open_registration",
]

log = logging.getLogger(__name__)

RETRY_INITIAL = 0.5  # seconds before the first retry
RETRY_MAX = 30.0  # backoff cap (and never above the heartbeat interval)
REQUEST_TIMEOUT = 5.0  # one register / unregister call
UNREGISTER_TIMEOUT = 2.0  # all goodbyes together, on shutdown


@dataclass(frozen=True)
class LinkStatistics:
    """One registry as this encoder sees it."""

    registry_url: str
    registered: bool  # the latest attempt succeeded
    attempts: int
    failures: int  # failed attempts, in total
    streak: int  # consecutive failed attempts now
    last_ok: float | None  # trio time of the latest success
    last_error: str | None


@dataclass(frozen=True)
class RegistrationStatistics:
    advertise_url: str
    links: tuple[LinkStatistics, ...]
    unregistered: int  # registries that acknowledged the goodbye


class _Link:
    def __init__(self, registry_url: str) -> None:
        self.url = registry_url
        self.registered = False
        self.attempts = self.failures = self.streak = 0
        self.last_ok: float | None = None
        self.last_error: str | None = None

    def statistics(self) -> LinkStatistics:
        return LinkStatistics(self.url, self.registered, self.attempts, self.failures,
                              self.streak, self.last_ok, self.last_error)


class Registration:
    """Announces ``advertise_url`` to each of ``registry_urls``; ``await nursery.start(reg.run)``."""

    def __init__(self, http: httpx.AsyncClient | None, registry_urls: Sequence[str],
                 advertise_url: str, *, heartbeat_interval: float, auth_token: str | None = None,
                 retry_initial: float = RETRY_INITIAL, retry_max: float | None = None,
                 request_timeout: float = REQUEST_TIMEOUT) -> None:
        if heartbeat_interval <= 0:
            raise ValueError(f"heartbeat_interval must be > 0, got {heartbeat_interval}")
        self.advertise_url = advertise_url
        self.heartbeat_interval = heartbeat_interval
        self._http = http  # None only with no registries
        self._links = [_Link(url) for url in dict.fromkeys(registry_urls)]
        self._headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
        cap = min(RETRY_MAX, heartbeat_interval) if retry_max is None else retry_max
        self._retry = (retry_initial, cap)
        self._request_timeout = request_timeout
        self._unregistered = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Announce to every registry until cancelled. Ready at once: no registry is waited for."""
        async with trio.open_nursery() as nursery:
            for link in self._links:
                nursery.start_soon(self._announce_forever, link)
            task_status.started()

    async def _announce_forever(self, link: _Link) -> None:
        while True:
            if await self._register_once(link):
                delay = self.heartbeat_interval
            else:
                delay = backoff_delay(link.streak - 1, *self._retry)
            await trio.sleep(delay)

    async def _register_once(self, link: _Link) -> bool:
        link.attempts += 1
        try:
            response = await self._call("POST", link.url + "/register_encoder_url")
        except (httpx.HTTPError, trio.TooSlowError) as exc:
            self._failed(link, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            return False
        if not response.is_success:
            self._failed(link, f"HTTP {response.status_code}: {response.text[:200]}")
            return False
        self._succeeded(link, _newly_added(response))
        return True

    def _succeeded(self, link: _Link, added: bool) -> None:
        if link.streak or link.last_ok is None:
            log.info("registered %s with %s (attempt %d)", self.advertise_url, link.url, link.attempts)
        elif added:
            log.info("re-registered %s with %s: the registry had forgotten it",
                     self.advertise_url, link.url)
        link.registered, link.streak, link.last_ok = True, 0, trio.current_time()

    def _failed(self, link: _Link, error: str) -> None:
        link.registered, link.last_error = False, error
        link.failures += 1
        link.streak += 1
        level = logging.WARNING if link.streak == 1 else logging.DEBUG
        log.log(level, "could not register %s with %s (%s); retrying with backoff until it works",
                self.advertise_url, link.url, error)

    async def _call(self, method: str, url: str) -> httpx.Response:
        assert self._http is not None
        with trio.fail_after(self._request_timeout):
            return await self._http.request(method, url, json={"url": self.advertise_url},
                                            headers=self._headers)

    async def unregister_all(self, timeout: float | None = None) -> int:
        """Say goodbye to every registry at once; shielded, at most ``timeout`` s
        (default ``UNREGISTER_TIMEOUT``, read now). → how many acknowledged."""
        timeout = UNREGISTER_TIMEOUT if timeout is None else timeout
        before = self._unregistered
        with trio.CancelScope(shield=True), trio.move_on_after(timeout) as scope:
            async with trio.open_nursery() as nursery:
                for link in self._links:
                    nursery.start_soon(self._unregister_one, link)
        if scope.cancelled_caught:
            log.warning("unregistering %s timed out after %.3g s", self.advertise_url, timeout)
        return self._unregistered - before

    async def _unregister_one(self, link: _Link) -> None:
        try:
            response = await self._call("DELETE", link.url + "/unregister_encoder_url")
        except (httpx.HTTPError, trio.TooSlowError) as exc:
            log.info("could not unregister %s from %s: %s", self.advertise_url, link.url, exc)
            return
        link.registered = False
        if response.is_success:
            self._unregistered += 1
            log.info("unregistered %s from %s", self.advertise_url, link.url)
        else:
            log.info("unregistering %s from %s: HTTP %d", self.advertise_url, link.url,
                     response.status_code)

    def statistics(self) -> RegistrationStatistics:
        return RegistrationStatistics(self.advertise_url,
                                      tuple(link.statistics() for link in self._links),
                                      self._unregistered)

    def __repr__(self) -> str:
        links = self.statistics().links
        ok = sum(link.registered for link in links)
        return f"<Registration {self.advertise_url}: registered with {ok}/{len(links)} registries>"


def _newly_added(response: httpx.Response) -> bool:
    """Whether a 2xx answer says the registry had not known us (ours answers JSON
    ``{"registered": bool}``); any other 2xx body, such as SGLang's
    ``EncoderBootstrapServer`` answering the text ``OK``, is a success that says nothing more."""
    try:
        body = response.json()
    except ValueError:
        return False
    return isinstance(body, dict) and bool(body.get("registered"))


@asynccontextmanager
async def open_registration(registry_urls: Sequence[str], advertise_url: str, *,
                            heartbeat_interval: float, auth_token: str | None = None,
                            http: httpx.AsyncClient | None = None) -> AsyncIterator[Registration]:
    """Announce ``advertise_url`` for the duration of the block; unregister on the way out.

    With no ``registry_urls`` this does nothing (and opens no HTTP client).
    """
    async with AsyncExitStack() as stack:
        if http is None and registry_urls:
            http = await stack.enter_async_context(httpx.AsyncClient(timeout=REQUEST_TIMEOUT))
        registration = Registration(http, registry_urls, advertise_url,
                                    heartbeat_interval=heartbeat_interval, auth_token=auth_token)
        if not registry_urls:
            yield registration
            return
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(registration.run)
                try:
                    yield registration
                finally:
                    nursery.cancel_scope.cancel()  # no announcement may follow the goodbye
        finally:
            await registration.unregister_all()
