"""Seeded real-clock chaos scenarios over real Hypercorn + ZMQ.

One seed draws a kind and its whole script (callers, items, timeouts, fault
times) before anything runs, so the same seed replays the same script. Kinds:

``client_timeout``   client callers with tiny per-call timeouts or cancelled by
                     ``move_on_after``: they get their embedding or ``EncodeTimeout``.
``connection_drop``  direct ``/encode`` posts whose HTTP client gives up (a tiny
                     read timeout) mid-request, inline or to a ZMQ receiver that
                     reads: a started request still delivers (embedding or error).
``abort``            ``/abort`` at a random time for live requests, of the client
                     library or of direct inline posts: 200 or 499, never 5xx.
``encoder_killed``   an encoder subprocess SIGKILLed mid-batch: the client fails
                     fast and typed, falls back to a peer while it is down, and
                     succeeds again once it is restarted on the same port.
``stuck_receiver``   a ZMQ receiver that never reads: the encoder's send times
                     out (504 ``TransferTimeout``) and the request is released;
                     other receivers of the same encoder are unaffected.

For every caller: its correct embedding (allclose to the reference, rtol 1e-4)
or a typed error (``EPDError``; for raw HTTP the JSON error shape) within its
deadline + ``SLACK``; a clean client on a clean encoder, running meanwhile, must
notice nothing; afterwards every ``/stats`` is idle (``quiescence_problems``),
the clients are quiescent and each encoder still encodes correctly.
Violations are collected, not raised, so the soak can count them; the test
asserts there are none, with the seed in the message.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import trio

from epd_trio.client import RemoteEncodeError, open_encoder_client
from epd_trio.errors import EncodeTimeout, EPDError, PeerUnavailable
from epd_trio.testing import quiescence_problems
from epd_trio.transport.zmq import RELEASE_BUDGET
from real_calls import ScenarioReport, client_call, http_encode, req_id_for
from real_world import SLACK, MessageSink, StuckReceiver, World, check_inline, encoder_stats, settle

__all__ = ["CLIENT_FAULTS", "KINDS", "LONG", "SCENARIOS", "draw_kind", "kind_of", "run_scenario", "settle_world"]

KINDS = ("client_timeout", "connection_drop", "abort", "encoder_killed", "stuck_receiver")
CLIENT_FAULTS = frozenset({"client_timeout", "connection_drop", "abort"})  # nothing else goes wrong
# Kills (a restart: seconds) and stuck receivers (filling buffers: seconds) cost more.
_WEIGHTS = (3.0, 3.0, 3.0, 1.2, 1.5)
FAIL_FAST = 5.0  # seconds from SIGKILL to the caller's typed error
SCENARIO_LIMIT = 120.0  # a scenario still running after this is hung
LONG = 30.0  # the deadline of callers that are not meant to time out


def draw_kind(rng: random.Random) -> str:
    return rng.choices(KINDS, weights=_WEIGHTS)[0]


def kind_of(seed: int) -> str:
    return draw_kind(random.Random(seed))


# ---- client_timeout ---------------------------------------------------------------------------------
async def client_timeout(world: World, rng: random.Random, report: ScenarioReport) -> None:
    callers = []
    for i in range(rng.randint(1, 4)):
        indices = rng.sample(world.media.small, rng.randint(1, 3))
        if rng.random() < 0.3:
            indices.append(rng.choice(world.media.large))
        band = rng.choice(["instant", "short", "medium"])
        limit = {"instant": rng.uniform(0.001, 0.02), "short": rng.uniform(0.02, 0.2),
                 "medium": rng.uniform(0.2, 1.0)}[band]
        mode = rng.choice(["timeout", "cancel"])
        callers.append((f"c{i}", indices, mode, limit, rng.uniform(0, 0.3)))
        report.script.append(f"c{i}: items {indices} {mode} {limit:.3f}s after {callers[-1][4]:.2f}s")

    async def caller(label: str, indices: list[int], mode: str, limit: float, delay: float) -> None:
        await trio.sleep(delay)
        if mode == "timeout":
            await client_call(world, report, world.chaos_client, label, indices, timeout=limit,
                              expect=lambda e: isinstance(e, EncodeTimeout))
        else:
            await client_call(world, report, world.chaos_client, label, indices, timeout=LONG,
                              cancel_after=limit)

    async with trio.open_nursery() as nursery:
        for args in callers:
            nursery.start_soon(caller, *args)


# ---- connection_drop --------------------------------------------------------------------------------
async def connection_drop(world: World, rng: random.Random, report: ScenarioReport) -> None:
    url = rng.choice(world.chaos_urls)
    backend = rng.choice(["inline", "zmq"])
    callers = []
    for i in range(rng.randint(1, 4)):
        indices = rng.sample(world.media.small, rng.randint(1, 3))
        if rng.random() < 0.4:
            indices.append(rng.choice(world.media.large))
        # Small items take ~20 ms, a large one ~100-300 ms: drops land at every stage.
        read_timeout = rng.choice([rng.uniform(0.001, 0.02), rng.uniform(0.02, 0.1), rng.uniform(0.1, 0.4)])
        callers.append((f"d{i}", indices, read_timeout, rng.uniform(0, 0.2)))
        report.script.append(f"d{i}: items {indices} read timeout {read_timeout:.3f}s after {callers[-1][3]:.2f}s")
    report.script.insert(0, f"{backend} to {url}")
    before = await encoder_stats(world.http, url) if world.exclusive else None
    answered: dict[str, tuple[list[int], bool]] = {}  # req_id → (items, answered 200)

    async with trio.open_nursery() as nursery:
        sink = await nursery.start(MessageSink().run) if backend == "zmq" else None
        deliver = {"backend": "inline"} if sink is None else {"backend": "zmq", "endpoint": sink.endpoint}

        async def caller(label: str, indices: list[int], read_timeout: float, delay: float) -> None:
            await trio.sleep(delay)
            req_id = req_id_for(report.seed, label)
            call, _ = await http_encode(world, report, url, label, req_id, indices, deliver=deliver,
                                        deadline=LONG, read_timeout=read_timeout)
            answered[req_id] = (indices, call.outcome == "ok")

        async with trio.open_nursery() as callers_nursery:
            for args in callers:
                callers_nursery.start_soon(caller, *args)
        if sink is not None:
            # Every request the encoder started tells the receiver how it ended.
            await settle(world.http, [url], {})
            await _check_deliveries(world, report, url, sink, answered, before)
        nursery.cancel_scope.cancel()


async def _check_deliveries(world: World, report: ScenarioReport, url: str, sink: MessageSink,
                            answered: dict[str, tuple[list[int], bool]], before: dict[str, Any] | None) -> None:
    with trio.move_on_after(2.0):  # loopback: they are in flight for milliseconds
        while not all(sink.messages.get(r) for r, (_, ok) in answered.items() if ok):
            await trio.sleep(0.02)
        if before is not None:
            after = await encoder_stats(world.http, url)
            started = after["registry"]["started"] - before["registry"]["started"]
            while len([r for r in answered if sink.messages.get(r)]) < started:
                await trio.sleep(0.02)
    for req_id, (indices, ok) in answered.items():
        messages = sink.messages.get(req_id, [])
        if ok and not any(h.kind == "embedding" for h, _ in messages):
            report.violate("wrong", f"{req_id}: answered 200 but no embedding arrived")
        for header, tensor in messages:
            if header.kind == "embedding":
                assert tensor is not None
                if problem := world.refs.check(indices, tensor, header.token_counts):
                    report.violate("wrong", f"{req_id} over ZMQ: {problem}")
            elif header.error is not None and header.error.status >= 500:
                report.violate("client_5xx", f"{req_id}: error message {header.error}")
            elif header.error is not None and header.error.type != "AbortedError":
                report.violate("unexpected", f"{req_id}: error message {header.error}")
    if before is not None:
        after = await encoder_stats(world.http, url)
        started = after["registry"]["started"] - before["registry"]["started"]
        heard = len([r for r in answered if sink.messages.get(r)])
        if heard != started:
            report.violate("wrong", f"{url} started {started} requests but the receiver heard of {heard}")


# ---- abort ----------------------------------------------------------------------------------------------
async def abort(world: World, rng: random.Random, report: ScenarioReport) -> None:
    via = rng.choice(["client", "http"])
    callers = []
    for i in range(rng.randint(1, 3)):
        indices = rng.sample(world.media.small, rng.randint(1, 3))
        if rng.random() < 0.5:
            indices.append(rng.choice(world.media.large))
        url = rng.choice(world.chaos_urls)
        at = rng.choice([rng.uniform(0, 0.02), rng.uniform(0.02, 0.1), rng.uniform(0.1, 0.5)])
        callers.append((f"a{i}", indices, url, rng.uniform(0, 0.2), at))
        report.script.append(f"a{i}: {via} items {indices} to {url} after {callers[-1][3]:.2f}s,"
                             f" /abort at +{callers[-1][4]:.3f}s")

    async def aborter(label: str, req_id: str, urls: list[str], at: float, aborted: list[float]) -> None:
        await trio.sleep(at)
        aborted.append(trio.current_time())
        for url in urls:
            try:
                response = await world.http.post(f"{url}/abort", json={"req_id": req_id}, timeout=LONG)
            except httpx.HTTPError as exc:
                report.violate("unexpected", f"{label} /abort: {type(exc).__name__}: {exc}")
                continue
            if response.status_code >= 500:
                report.violate("client_5xx", f"{label} /abort: {response.status_code} {response.text[:200]}")
            elif response.status_code not in (200, 404):
                report.violate("unexpected", f"{label} /abort: {response.status_code} {response.text[:200]}")

    async def caller(label: str, indices: list[int], url: str, delay: float, at: float) -> None:
        await trio.sleep(delay)
        req_id = req_id_for(report.seed, label)
        aborted: list[float] = []
        async with trio.open_nursery() as nursery:
            urls = world.chaos_urls if via == "client" else [url]
            nursery.start_soon(aborter, label, req_id, urls, at, aborted)
            if via == "client":
                call = await client_call(world, report, world.chaos_client, label, indices, timeout=LONG,
                                         req_id=req_id, expect=_is_aborted)
            else:
                call, _ = await http_encode(world, report, url, label, req_id, indices,
                                            deliver={"backend": "inline"}, deadline=LONG,
                                            expect_status=frozenset({200, 499}),
                                            expect_types=frozenset({"AbortedError"}))
            ended = trio.current_time()  # before the aborter's last /abort answers
        if call.outcome == "error" and aborted and ended - aborted[0] > SLACK:
            report.violate("hang", f"{label}: failed {ended - aborted[0]:.2f} s after its /abort")

    async with trio.open_nursery() as nursery:
        for args in callers:
            nursery.start_soon(caller, *args)


def _is_aborted(exc: EPDError) -> bool:
    return isinstance(exc, RemoteEncodeError) and exc.error_type == "AbortedError" and exc.status_code == 499


# ---- encoder_killed -----------------------------------------------------------------------------------
async def encoder_killed(world: World, rng: random.Random, report: ScenarioReport) -> None:
    target = rng.choice(world.killables)
    peers = [u for u in world.chaos_urls if u != target.url]
    peer = rng.choice(peers) if peers and rng.random() < 0.5 else None
    indices = rng.sample(world.media.large, 3) + rng.sample(world.media.small, rng.randint(0, 2))
    trigger = rng.choice(["mid_batch", "random"])
    delay = rng.uniform(0, 0.05) if trigger == "mid_batch" else rng.uniform(0, 0.4)
    small = [rng.choice(world.media.small)]  # for the request while it is down
    report.script.append(f"kill {target.name} {trigger} +{delay:.3f}s during items {indices}, peer {peer}")
    urls = [target.url] + ([peer] if peer else [])
    async with open_encoder_client(encoder_urls=urls, **world.client_options) as client:
        killed_at: list[float] = []
        done = trio.Event()

        async def killer() -> None:
            t0 = trio.current_time()
            if trigger == "mid_batch":  # once a forward runs on the target
                with trio.move_on_after(10.0):
                    while not done.is_set() and (await encoder_stats(world.http, target.url))["engine"]["running"] == 0:
                        await trio.sleep(0.005)
            await trio.sleep(delay)
            target.kill()
            killed_at.append(trio.current_time())
            caller = "done" if done.is_set() else "live"
            report.script.append(f"killed at +{killed_at[0] - t0:.3f}s, the caller {caller}")

        async def caller() -> None:
            try:
                call = await client_call(world, report, client, "k0", indices, timeout=LONG,
                                         expect=_is_peer_failure, client_fault_only=False)
            finally:
                done.set()
            if call.outcome == "error" and killed_at and trio.current_time() - killed_at[0] > FAIL_FAST:
                report.violate("hang", f"k0: failed {trio.current_time() - killed_at[0]:.2f} s after the SIGKILL")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(killer)
            nursery.start_soon(caller)
        # While it is down: a peer takes the whole request, or it fails fast.
        outage = await client_call(world, report, client, "k1-down", small, timeout=FAIL_FAST,
                                   expect=(lambda e: False) if peer else _is_peer_failure,
                                   client_fault_only=False)
        if peer is None and outage.outcome != "error":
            report.violate("unexpected", f"k1-down: {outage.outcome} with its only encoder dead")
        await target.restart()
        await client_call(world, report, client, "k2-restarted", indices, timeout=LONG,
                          client_fault_only=False)
        for problem in quiescence_problems({"kill client": client}):
            report.violate("leak", problem)


def _is_peer_failure(exc: EPDError) -> bool:
    return isinstance(exc, PeerUnavailable)


# ---- stuck_receiver ------------------------------------------------------------------------------------
# ~10 MB of embeddings, far past what loopback buffers hold, plus the sends the encoder's ZMQ
# cache leaves unwatched to one socket (RELEASE_BUDGET; a post is at least ~200 KB).
_STUCK_MAX_POSTS = 60 + RELEASE_BUDGET // (200 << 10)


async def stuck_receiver(world: World, rng: random.Random, report: ScenarioReport) -> None:
    url = rng.choice(world.chaos_urls)
    reuse = rng.random() < 0.5
    wave = rng.randint(2, 4)
    per_post = rng.randint(2, 3)
    keep = rng.random() < 0.5
    bystanders = [rng.sample(world.media.small, rng.randint(1, 2)) for _ in range(rng.randint(1, 3))]
    # Once it is blocked, one more request whose send waits on it: aborted, or its client leaves.
    finale, finale_at = rng.choice(["none", "abort", "drop"]), rng.uniform(0.05, 0.6)
    report.script.append(f"to {url}: {'reuse' if reuse else 'fresh'} receiver, waves of {wave} posts"
                         f" of {per_post} large items, keep {keep}, bystanders {bystanders},"
                         f" then {finale} at +{finale_at:.2f}s")
    stuck = world.stuck.pop() if reuse and world.stuck else StuckReceiver()
    timed_out = trio.Event()
    posts = 0

    async def post(i: int) -> None:
        label = f"s{i}"
        indices = [world.media.large[(i + j) % len(world.media.large)] for j in range(per_post)]
        call, _ = await http_encode(
            world, report, url, label, req_id_for(report.seed, label), indices,
            deliver={"backend": "zmq", "endpoint": stuck.endpoint}, deadline=LONG,
            expect_status=frozenset({200, 504}), expect_types=frozenset({"TransferTimeout"}),
            client_fault_only=False)
        if call.status == 504:
            timed_out.set()

    async def bystander(i: int, indices: list[int]) -> None:
        await client_call(world, report, world.chaos_client, f"b{i}", indices, timeout=LONG)

    try:
        async with trio.open_nursery() as nursery:
            for i, indices in enumerate(bystanders):
                nursery.start_soon(bystander, i, indices)
            while not timed_out.is_set() and posts < _STUCK_MAX_POSTS:
                async with trio.open_nursery() as wave_nursery:
                    for _ in range(wave):
                        wave_nursery.start_soon(post, posts)
                        posts += 1
        if not timed_out.is_set():
            report.violate("ineffective", f"{posts} posts to a receiver that never reads: no send timed out")
        elif finale != "none":
            await _blocked_finale(world, report, url, stuck, finale, finale_at)
    finally:
        if keep:
            world.stuck.append(stuck)
        else:
            stuck.close()


async def _blocked_finale(world: World, report: ScenarioReport, url: str, stuck: StuckReceiver,
                          finale: str, at: float) -> None:
    """A request whose send waits on a full receiver is aborted, or its HTTP client leaves."""
    label = f"s-{finale}"
    req_id = req_id_for(report.seed, label)
    deliver = {"backend": "zmq", "endpoint": stuck.endpoint}
    # Two large items: over 64 KiB, so ZMQ sends them zero-copy and the send is done only
    # once they have left (a small message is copied into the full queue at once).
    indices = world.media.large[:2]
    if finale == "drop":
        await http_encode(world, report, url, label, req_id, indices, deliver=deliver, deadline=LONG,
                          read_timeout=at, expect_status=frozenset({504}),
                          expect_types=frozenset({"TransferTimeout"}), client_fault_only=False)
        return

    async def abort_later() -> None:
        await trio.sleep(at)
        response = await world.http.post(f"{url}/abort", json={"req_id": req_id}, timeout=LONG)
        if response.status_code not in (200, 404):
            report.violate("client_5xx" if response.status_code >= 500 else "unexpected",
                           f"{label} /abort: {response.status_code} {response.text[:200]}")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(abort_later)
        await http_encode(world, report, url, label, req_id, indices, deliver=deliver, deadline=LONG,
                          expect_status=frozenset({499, 504}),
                          expect_types=frozenset({"AbortedError", "TransferTimeout"}), client_fault_only=False)


SCENARIOS: dict[str, Callable[[World, random.Random, ScenarioReport], Awaitable[None]]] = {
    "client_timeout": client_timeout, "connection_drop": connection_drop, "abort": abort,
    "encoder_killed": encoder_killed, "stuck_receiver": stuck_receiver,
}


# ---- clean traffic, the runner and the checks after ------------------------------------------------------
async def clean_traffic(world: World, rng: random.Random, stop: trio.Event, report: ScenarioReport) -> None:
    """Requests on the clean client/encoder until ``stop`` (at least one): all must succeed."""
    assert world.clean_client is not None
    n = 0
    while True:
        indices = rng.sample(world.media.small, rng.randint(1, 2))
        t0 = trio.current_time()
        try:
            async with await world.clean_client.encode({"image": world.media.items(indices)},
                                                       timeout=LONG) as result:
                problem = world.refs.check_result(indices, result)
        except Exception as exc:  # noqa: BLE001 - any failure of a clean request is the violation reported
            problem = f"{type(exc).__name__}: {exc}"
        if problem:
            report.violate("clean", f"clean request {n} (items {indices}): {problem}")
        report.clean_latencies.append(trio.current_time() - t0)
        n += 1
        if stop.is_set():
            return
        await trio.sleep(rng.uniform(0.01, 0.05))  # steady traffic, not a CPU hog


async def run_scenario(world: World, seed: int, *, clean: bool = True, settle_after: bool = True
                       ) -> ScenarioReport:
    """Draw ``seed``'s script and run it (with clean traffic beside it), then check the aftermath."""
    rng = random.Random(seed)
    report = ScenarioReport(seed, draw_kind(rng))
    t0 = trio.current_time()
    # Alone on its encoders, a scenario of client-side faults must leave no failed request there:
    # a cancelled or timed-out caller's request is aborted, never failed (an error answer).
    watched = world.chaos_urls if world.exclusive and report.kind in CLIENT_FAULTS and settle_after else []
    failed_before = {url: (await encoder_stats(world.http, url))["registry"]["failed"] for url in watched}
    with trio.move_on_after(SCENARIO_LIMIT) as limit:
        async with trio.open_nursery() as nursery:
            stop = trio.Event()
            if clean and world.clean_client is not None:
                nursery.start_soon(clean_traffic, world, random.Random(f"clean-{seed}"), stop, report)
            try:
                await SCENARIOS[report.kind](world, rng, report)
            finally:
                stop.set()
    if limit.cancelled_caught:
        report.violate("hang", f"the scenario did not finish within {SCENARIO_LIMIT} s")
    if settle_after:
        await settle_world(world, report, random.Random(f"check-{seed}"))
    for url, before in failed_before.items():
        if failed := (await encoder_stats(world.http, url))["registry"]["failed"] - before:
            report.violate("client_5xx", f"{url} counted {failed} failed requests under client-side faults only")
    report.elapsed = trio.current_time() - t0
    return report


async def settle_world(world: World, report: ScenarioReport, rng: random.Random) -> None:
    """Afterwards: everything idle (``/stats``, clients), and every encoder still encodes right."""
    clients = {"chaos client": world.chaos_client}
    if world.clean_client is not None:
        clients["clean client"] = world.clean_client
    for problem in await settle(world.http, [*world.all_urls(), *world.clean_urls], clients):
        report.violate("leak", problem)
    for url in world.all_urls():
        indices = [rng.choice(world.media.small)]
        body = {"req_id": req_id_for(report.seed, "check"), "modality": "image",
                "mm_items": world.media.items(indices)}
        try:
            response = await world.http.post(f"{url}/encode", json=body, timeout=LONG)
        except httpx.HTTPError as exc:
            report.violate("broken", f"{url}: {type(exc).__name__}: {exc}")
            continue
        if response.status_code != 200:
            report.violate("broken", f"{url}: {response.status_code} {response.text[:200]}")
        elif problem := check_inline(world.refs, indices, response.content):
            report.violate("broken", f"{url}: {problem}")

