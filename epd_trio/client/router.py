"""The router: where each part goes, where it goes when its encoder is unreachable,
and how many parts each encoder has out.

It applies the pure tables of ``routing`` to the live state: ``plan`` places a
request's parts and counts them out, ``settle`` counts one back, ``post`` sends
one part (``/encode``, or what ``path`` names) and moves it to the least-loaded
encoder not yet tried on a connect error, ``abort`` tells encoders to drop the
parts of a request that ended early. A part that may be sent twice
(``retry_status``: the vLLM face's, whose answer only says its items are
stored) also moves when its connection breaks mid-call or its encoder answers
a status ``retry_status`` accepts (5xx: the encoder's failure, not the
request's); a native part never does, since a second encoder could deliver it
twice. The encoder list is replaced whole (``set_encoders``), so a
request keeps the snapshot it was planned on; an encoder that leaves keeps its
count while parts are still out there.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import httpx
import trio

from epd_trio.client.answers import Answer, EncoderUnreachable, json_of
from epd_trio.client.calls import EncoderCalls
from epd_trio.client.routing import Part, pick_fallback, plan_parts
from epd_trio.client.state import LiveRequest, PartState
from epd_trio.errors import EPDError, PeerUnavailable

__all__ = ["Router", "RouterStatistics"]

log = logging.getLogger(__name__)


def _released(response: Answer) -> bool:
    """Whether an /abort's 200 says its parts have let go (``"released": true``)."""
    try:
        body = json_of(response)
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("released") is True


class EncoderDraining(EncoderUnreachable):
    """An encoder refused a part at admission because it drains (``DrainingError``): the part
    never reached its work, so it moves as after a refused connection."""


def _refused_while_draining(answer: Answer) -> bool:
    if answer.status_code != 503:
        return False
    try:
        return bool(json_of(answer)["error"]["type"] == "DrainingError")
    except (ValueError, KeyError, TypeError):
        return False


@dataclass(frozen=True)
class RouterStatistics:
    encoders: tuple[str, ...]
    outstanding: Mapping[str, int]  # parts in flight per encoder
    retries: int  # parts moved to another encoder: a connect error, a draining refusal (see ``post``)
    aborts_sent: int  # /abort answered 200, or 404 (the encoder was already done)
    aborts_failed: int  # /abort unreachable or answered anything else
    aborts_unreleased: int = 0  # /abort answered 200 before its parts had let go


class Router:
    """The live routing state of one client; every change is synchronous (decide, then act)."""

    def __init__(self, encoders: Sequence[str]) -> None:
        self.encoders: tuple[str, ...] = tuple(encoders)
        self._outstanding = dict.fromkeys(self.encoders, 0)
        self._retries = 0
        self._aborts_sent = 0
        self._aborts_failed = 0
        self._aborts_unreleased = 0

    # ---- decisions (no I/O) -----------------------------------------------------
    def plan(self, item_counts: Mapping[str, int]) -> list[Part]:
        """The parts of one request over the current encoders, counted out."""
        parts = plan_parts(item_counts, self.encoders, self._outstanding)
        for part in parts:
            self._outstanding[part.encoder_url] += 1
        return parts

    def settle(self, state: PartState) -> None:
        """Count a part back in, once: its encoder no longer works on it for us."""
        if not state.settled:
            state.settled = True
            self._outstanding[state.encoder_url] -= 1

    def set_encoders(self, encoders: tuple[str, ...]) -> None:
        if encoders != self.encoders:
            log.info("encoders now: %s", ", ".join(encoders) or "none")
        self.encoders = encoders
        # Keep counts of encoders that left while parts are still out there.
        self._outstanding = {**{u: n for u, n in self._outstanding.items() if n},
                             **{u: self._outstanding.get(u, 0) for u in encoders}}

    def _move(self, state: PartState, tried: list[str], why: str) -> None:
        fallback = pick_fallback(self.encoders, self._outstanding, tried)
        if fallback is None:
            raise PeerUnavailable(
                f"no encoder reachable for part {state.part.part_idx}: {state.encoder_url}: {why}")
        log.warning("encoder %s failed part %d (%s); it moves to %s",
                    state.encoder_url, state.part.part_idx, why, fallback)
        self._outstanding[state.encoder_url] -= 1
        self._outstanding[fallback] += 1
        state.encoder_url = fallback
        self._retries += 1

    # ---- I/O ----------------------------------------------------------------------
    async def post(self, calls: EncoderCalls, req: LiveRequest, state: PartState,
                   body: dict[str, Any], *, path: str = "/encode",
                   headers: Mapping[str, str] | None = None,
                   deliver: Callable[[str], Awaitable[dict[str, Any]]] | None = None,
                   retry_status: Callable[[int], bool] | None = None) -> Answer:
        """One part's call (HTTP or gRPC), whatever its status. A connect error, or a 503
        ``DrainingError`` (refused at admission: not taken at all) while another encoder is
        left, moves the part; with ``retry_status``, so do a call broken mid-way and a status
        it accepts (with no other encoder left, that last answer is returned).
        ``deliver(url)`` gives the body's ``deliver`` for each encoder tried (where that one
        reaches us); it may raise ``EncoderUnreachable`` too."""
        tried: list[str] = []
        while True:
            try:
                if deliver is not None:
                    body = {**body, "deliver": await deliver(state.encoder_url)}
                state.posted = True
                answer = await calls.post(state.encoder_url, path, body, headers)
                if _refused_while_draining(answer):
                    # Not taken at all (a rolling update): as if it had never reached it.
                    if pick_fallback(self.encoders, self._outstanding, [*tried, state.encoder_url]) is None:
                        return answer
                    raise EncoderDraining(f"{state.encoder_url} is draining")
            except (httpx.ConnectError, httpx.ConnectTimeout, EncoderUnreachable) as exc:
                state.posted = False  # it never reached that encoder
                tried.append(state.encoder_url)
                self._move(state, tried, f"{type(exc).__name__}: {exc}")
                continue
            except httpx.HTTPError as exc:
                if retry_status is None:
                    raise PeerUnavailable(f"{state.encoder_url} failed part {state.part.part_idx}"
                                          f" of {req.req_id}: {type(exc).__name__}: {exc}",
                                          req_id=req.req_id) from None
                tried.append(state.encoder_url)
                self._move(state, tried, f"{type(exc).__name__}: {exc}")
                continue
            if retry_status is None or not retry_status(answer.status_code):
                return answer
            tried.append(state.encoder_url)
            if pick_fallback(self.encoders, self._outstanding, tried) is None:
                return answer
            self._move(state, tried, f"HTTP {answer.status_code}")

    async def abort(self, calls: EncoderCalls, req: LiveRequest, timeout: float) -> bool:
        """Tell encoders to drop the parts they may still work on (best effort, shielded).

        True when every such encoder confirmed (or there was none): none of them will
        touch the request's memory any more. An encoder confirms with a 404 (it holds
        nothing of the request) or a 200 that says ``released``; a 200 without it (the
        encoder's wait ran out while a part still held the memory, or an encoder that
        does not say) is not a confirmation.
        """
        targets = [s for s in req.parts if s.posted and not s.answered]
        if not targets:
            return True
        confirmed: list[PartState] = []
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + timeout
            async with trio.open_nursery() as nursery:
                for state in targets:
                    nursery.start_soon(self._abort_one, calls, req.req_id, state, confirmed)
        return len(confirmed) == len(targets)

    async def _abort_one(self, calls: EncoderCalls, req_id: str, state: PartState,
                         confirmed: list[PartState]) -> None:
        body = {"req_id": req_id, "part_idx": state.part.part_idx}
        try:
            response = await calls.post(state.encoder_url, "/abort", body)
        except (httpx.HTTPError, EPDError, RuntimeError) as exc:  # RuntimeError: the client is closed
            self._aborts_failed += 1
            log.info("could not abort %s part %d on %s: %s", req_id, state.part.part_idx,
                     state.encoder_url, exc)
            return
        if response.status_code not in (200, 404):
            self._aborts_failed += 1
            return
        self._aborts_sent += 1
        if response.status_code == 404 or _released(response):  # 404: it had finished with it
            confirmed.append(state)
        else:
            self._aborts_unreleased += 1
            log.info("%s answered the /abort of %s part %d before the part let go", state.encoder_url,
                     req_id, state.part.part_idx)

    # ---- observability ------------------------------------------------------------
    def statistics(self) -> RouterStatistics:
        return RouterStatistics(self.encoders, MappingProxyType(dict(self._outstanding)),
                                self._retries, self._aborts_sent, self._aborts_failed,
                                self._aborts_unreleased)

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<Router {len(s.encoders)} encoders, {sum(s.outstanding.values())} parts out,"
                f" {s.retries} retries, aborts {s.aborts_sent} sent / {s.aborts_failed} failed>")
