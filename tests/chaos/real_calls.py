"""One chaos caller's outcome and checks: through the client library or a direct POST.

``ScenarioReport`` collects what callers got and every violation of the
chaos rules (a hang past the deadline + ``SLACK``, a wrong embedding, an
untyped error, a 5xx caused by client-side faults only, ...); ``client_call``
and ``http_encode`` run one caller and record both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from epd_trio.client import RemoteEncodeError
from epd_trio.errors import EPDError
from real_world import SLACK, World, check_inline

__all__ = ["VIOLATIONS", "Call", "ScenarioReport", "client_call", "http_encode", "req_id_for"]

VIOLATIONS = ("hang", "leak", "client_5xx", "wrong", "untyped", "unexpected", "clean", "broken",
              "ineffective")
_run_ids = iter(range(1 << 62))


@dataclass
class Call:
    """One caller's outcome."""

    label: str
    via: str  # "client" | "http"
    deadline: float
    elapsed: float = 0.0
    outcome: str = "pending"  # ok | error | dropped | cancelled | hung
    error: str | None = None  # the error's type name (RemoteEncodeError: the remote type)
    status: int | None = None  # HTTP status, or a remote error's status
    client_fault_only: bool = True  # timeouts, disconnects and aborts only


@dataclass
class ScenarioReport:
    seed: int
    kind: str
    script: list[str] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    clean_latencies: list[float] = field(default_factory=list)
    violations: list[tuple[str, str]] = field(default_factory=list)
    elapsed: float = 0.0
    replay: str = ""  # how to run this seed again, when not test_chaos_real's way

    @property
    def tag(self) -> str:
        return f"[chaos seed={self.seed} kind={self.kind}]"

    def violate(self, category: str, message: str) -> None:
        assert category in VIOLATIONS, category
        self.violations.append((category, message))

    def summary(self) -> str:
        outcomes: dict[str, int] = {}
        for call in self.calls:
            key = call.outcome if call.error is None else f"{call.outcome}:{call.error}"
            outcomes[key] = outcomes.get(key, 0) + 1
        return (f"{self.tag} {self.elapsed:.2f}s calls {dict(sorted(outcomes.items()))}"
                f" clean {len(self.clean_latencies)} overshoot {self.overshoot() * 1000:.0f} ms")

    def overshoot(self) -> float:
        """The most any caller ended past its deadline (0 when all ended in time)."""
        return max([0.0, *(c.elapsed - c.deadline for c in self.calls)])

    def describe(self) -> str:
        lines = [self.summary(), "  script: " + "; ".join(self.script),
                 "  calls: " + ", ".join(f"{c.label} {c.outcome}{':' + c.error if c.error else ''}"
                                         f"{' ' + str(c.status) if c.status else ''} {c.elapsed:.3f}s"
                                         for c in self.calls)]
        lines += [f"  {category}: {message}" for category, message in self.violations]
        lines.append(f"  replay: {self.replay}" if self.replay else
                     f"  replay: EPD_CHAOS_SEED={self.seed} pytest tests/chaos/test_chaos_real.py"
                     f" (a soak seed: tools/chaos_soak.py --replay {self.seed} --parallel 1)")
        return "\n".join(lines)


def req_id_for(seed: int, label: str) -> str:
    return f"chaos-{seed}-{label}-{next(_run_ids)}"


def _error_name(exc: BaseException) -> str:
    return exc.error_type if isinstance(exc, RemoteEncodeError) else type(exc).__name__


# ---- one caller through the client library --------------------------------------------------
async def client_call(world: World, report: ScenarioReport, client: Any, label: str,
                       indices: Sequence[int], *, timeout: float, cancel_after: float | None = None,
                       req_id: str | None = None, expect: Callable[[EPDError], bool] = lambda e: False,
                       client_fault_only: bool = True) -> Call:
    deadline = timeout if cancel_after is None else min(timeout, cancel_after)
    call = Call(label, "client", deadline, client_fault_only=client_fault_only)
    report.calls.append(call)
    result = None
    t0 = trio.current_time()
    with trio.move_on_after(deadline + SLACK + 10.0) as hard:
        try:
            with trio.move_on_after(cancel_after if cancel_after is not None else float("inf")) as cs:
                result = await client.encode({"image": world.media.items(indices)}, timeout=timeout,
                                             req_id=req_id)
            call.outcome = "cancelled" if cs.cancelled_caught else "ok"
        except EPDError as exc:
            call.outcome, call.error = "error", _error_name(exc)
            call.status = exc.status_code if isinstance(exc, RemoteEncodeError) else None
            if not expect(exc):
                report.violate("unexpected", f"{label}: {type(exc).__name__}: {exc}")
            if client_fault_only and isinstance(exc, RemoteEncodeError) and exc.status_code >= 500:
                report.violate("client_5xx", f"{label}: {exc.status_code} {exc}")
        except Exception as exc:  # noqa: BLE001 - anything else is not a typed error: a violation
            call.outcome, call.error = "error", type(exc).__name__
            report.violate("untyped", f"{label}: {type(exc).__name__}: {exc!r}")
    call.elapsed = trio.current_time() - t0
    if hard.cancelled_caught:
        call.outcome = "hung"
    if call.elapsed > deadline + SLACK:
        report.violate("hang", f"{label}: {call.outcome} after {call.elapsed:.2f} s, deadline {deadline:.3f} s")
    if result is not None:
        async with result:
            if problem := world.refs.check_result(indices, result):
                report.violate("wrong", f"{label}: {problem}")
    return call


# ---- one direct POST /encode ---------------------------------------------------------------------
async def http_encode(world: World, report: ScenarioReport, url: str, label: str, req_id: str,
                       indices: Sequence[int], *, deliver: dict[str, Any], deadline: float,
                       read_timeout: float | None = None, expect_status: frozenset[int] = frozenset({200}),
                       expect_types: frozenset[str] = frozenset(), client_fault_only: bool = True
                       ) -> tuple[Call, httpx.Response | None]:
    """``read_timeout`` below ``deadline`` makes the HTTP client go away mid-request."""
    call = Call(label, "http", deadline, client_fault_only=client_fault_only)
    report.calls.append(call)
    body = {"req_id": req_id, "modality": "image", "mm_items": world.media.items(indices),
            "deliver": deliver}
    timeout = httpx.Timeout(deadline, read=read_timeout if read_timeout is not None else deadline)
    response = None
    t0 = trio.current_time()
    # A client of its own: a dropped connection must take no other caller's with it.
    async with httpx.AsyncClient(timeout=timeout) as http:
        try:
            response = await http.post(f"{url}/encode", json=body)
        except httpx.TimeoutException:
            call.outcome = "dropped" if read_timeout is not None and read_timeout < deadline else "hung"
        except httpx.HTTPError as exc:
            call.outcome, call.error = "error", type(exc).__name__
            report.violate("unexpected", f"{label}: {type(exc).__name__}: {exc}")
    call.elapsed = trio.current_time() - t0
    if call.outcome == "hung" or call.elapsed > deadline + SLACK:
        report.violate("hang", f"{label}: no answer after {call.elapsed:.2f} s, deadline {deadline:.3f} s")
    if response is None:
        return call, None
    call.status = response.status_code
    if response.status_code == 200:
        call.outcome = "ok"
        if 200 not in expect_status:
            report.violate("unexpected", f"{label}: 200 {response.text[:200]}")
        if deliver["backend"] == "inline" and (problem := check_inline(world.refs, indices, response.content)):
            report.violate("wrong", f"{label}: {problem}")
        return call, response
    call.outcome = "error"
    _check_error_body(report, label, req_id, response, call)
    if response.status_code >= 500 and client_fault_only:
        report.violate("client_5xx", f"{label}: {response.status_code} {response.text[:200]}")
    if response.status_code not in expect_status or (expect_types and call.error not in expect_types):
        report.violate("unexpected", f"{label}: {response.status_code} {response.text[:200]}")
    return call, response


def _check_error_body(report: ScenarioReport, label: str, req_id: str, response: httpx.Response,
                      call: Call) -> None:
    """The protocol's error shape: ``{"error": {"type", "message"}, "req_id"}``, never a 500."""
    try:
        body = response.json()
        error = body["error"]
        call.error = str(error["type"])
        shaped = isinstance(error["message"], str) and body["req_id"] in (req_id, None)
    except (ValueError, KeyError, TypeError):
        shaped = False
    if not shaped or response.status_code == 500:
        report.violate("untyped", f"{label}: {response.status_code} {response.text[:200]!r}")
