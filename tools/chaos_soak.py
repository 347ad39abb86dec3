"""Chaos soak: the real-clock chaos scenarios at scale, against servers in subprocesses.

Starts a bootstrap registry (``epd-trio bootstrap``), N chaos encoders that
register with it (``--register-url``, send timeout 1 s) and one clean encoder
that does not; a chaos client discovers the encoders from the registry
(``bootstrap_url``), a clean client talks to the clean encoder only. Then:

1. **baseline**: clean requests alone, for their latency without chaos;
2. **chaos**: seeded scenarios (``tests/chaos/real_scenarios.py``: client
   timeouts, connection drops, ``/abort`` at random times, an encoder SIGKILLed
   mid-batch and restarted on the same port, a receiver that stops reading),
   ``--parallel`` at a time (a kill runs alone), for ``--duration`` seconds or
   ``--count`` scenarios, while the clean requests go on. After each batch every
   encoder's ``/stats`` must return to idle, the chaos client must be quiescent
   and each encoder must still encode correctly.

With ``--endings N``, N more seeds then run on each stage of the endings chaos
(``tests/chaos/endings_scenarios.py``: Mooncake delivery through the client,
the SGLang face with each of its three backends, process-mode preprocessing),
each stage an encoder in this process.

A progress line goes to stderr; the final table to stdout. Exit status 1 when
any request hung (past its deadline + slack), anything leaked, an encoder
answered 5xx to a request whose only fault was on the client's side
(timeout, disconnect, abort), or any other check failed. Every violation is
printed with its scenario seed; ``--replay SEED,...`` runs those scripts again.

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python tools/chaos_soak.py --duration 60
    HF_HUB_OFFLINE=1 .venv/bin/python tools/chaos_soak.py --duration 600 --encoders 2 --parallel 2
    HF_HUB_OFFLINE=1 .venv/bin/python tools/chaos_soak.py --replay 1234,1240 --parallel 1
    HF_HUB_OFFLINE=1 .venv/bin/python tools/chaos_soak.py --duration 60 --endings 20
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "chaos"), str(ROOT / "tools")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # the Mooncake engine's glog noise

import httpx  # noqa: E402
import trio  # noqa: E402

import bench_results  # noqa: E402  (tools/: the results file the docs are built from)
from epd_trio.client import open_encoder_client  # noqa: E402
from real_calls import ScenarioReport  # noqa: E402
from real_scenarios import LONG, kind_of, run_scenario, settle_world  # noqa: E402
from real_world import Media, References, ServerProcess, World, settle  # noqa: E402

SEND_TIMEOUT = 1.0
CLIENT_OPTIONS = dict(timeout=LONG, abort_timeout=0.5, pool_bytes=64 << 20)
EXIT_ON = ("hang", "leak", "client_5xx")  # the three; every other violation fails too


class Tally:
    """Everything the final table reports."""

    def __init__(self) -> None:
        self.scenarios: Counter[str] = Counter()
        self.seeds: list[int] = []
        self.calls = 0
        self.outcomes: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.violations: Counter[str] = Counter()
        self.details: list[str] = []
        self.baseline: list[float] = []
        self.during: list[float] = []
        self.clean_failures = 0

    def add(self, report: ScenarioReport) -> None:
        if report.kind != "after-batch":
            self.scenarios[report.kind] += 1
            self.seeds.append(report.seed)
        for call in report.calls:
            self.calls += 1
            self.outcomes[call.outcome] += 1
            if call.outcome == "error" and call.error:
                self.errors[call.error] += 1
        for category, message in report.violations:
            self.violations[category] += 1
            self.details.append(f"seed {report.seed} ({report.kind}) {category}: {message}")


# ---- servers ------------------------------------------------------------------------------------------
async def start_servers(stack: AsyncExitStack, args: argparse.Namespace, logs: Path
                        ) -> tuple[ServerProcess, list[ServerProcess], ServerProcess]:
    model = ["--model-path", args.model_path] if args.model_path else []
    boot = ServerProcess("bootstrap", ["--health-interval", "1", "--health-timeout", "2"],
                         logs / "bootstrap.log", name="bootstrap")
    await boot.start()
    stack.push_async_callback(boot.stop)
    encoders = [ServerProcess("encoder", [*model, "--send-timeout", str(SEND_TIMEOUT),
                                          "--register-url", boot.url, "--heartbeat-interval", "2"],
                              logs / f"encoder-{i}.log", name=f"encoder {i}")
                for i in range(args.encoders)]
    clean = ServerProcess("encoder", model, logs / "clean-encoder.log", name="clean encoder")
    for proc in [*encoders, clean]:
        proc.launch(0)
        stack.push_async_callback(proc.stop)
    for proc in [*encoders, clean]:
        await proc.ready()
    async with httpx.AsyncClient(timeout=5.0) as http:  # every chaos encoder registered
        with trio.fail_after(30):
            while len((await http.get(f"{boot.url}/list_encoder_urls")).json()["encoder_urls"]) < len(encoders):
                await trio.sleep(0.2)
    return boot, encoders, clean


def ensure_model(args: argparse.Namespace) -> None:
    """Generate the embedded tiny model once, before N encoders would each look for it."""
    if not args.model_path:
        from epd_trio.config import EngineConfig
        from epd_trio.model.tiny import ensure_default_model

        args.model_path = str(ensure_default_model(EngineConfig().resolved_cache_dir()))


# ---- clean traffic and progress ------------------------------------------------------------------------------
async def clean_loop(world: World, client: Any, sink: list[float], tally: Tally, stop: trio.Event) -> None:
    rng = random.Random("clean")
    while not stop.is_set():
        indices = rng.sample(world.media.small, rng.randint(1, 2))
        t0 = trio.current_time()
        try:
            async with await client.encode({"image": world.media.items(indices)}, timeout=LONG) as result:
                problem = world.refs.check_result(indices, result)
        except Exception as exc:  # noqa: BLE001 - any failure of a clean request is counted and shown
            problem = f"{type(exc).__name__}: {exc}"
        if problem:
            tally.clean_failures += 1
            tally.violations["clean"] += 1
            tally.details.append(f"clean request (items {indices}): {problem}")
        sink.append(trio.current_time() - t0)
        await trio.sleep(rng.uniform(0.01, 0.05))


class Progress:
    """The carriage-return progress line on stderr."""

    def __init__(self, tally: Tally, args: argparse.Namespace) -> None:
        self.tally, self.args = tally, args
        self.phase = "start"
        self.started = time.monotonic()

    def enter(self, phase: str) -> None:
        self.phase, self.started = phase, time.monotonic()

    async def run(self) -> None:
        width = 30
        while True:
            t, elapsed = self.tally, time.monotonic() - self.started
            if self.phase != "chaos":
                done = 0.0
            elif self.args.count:
                done = sum(t.scenarios.values()) / self.args.count
            else:
                done = elapsed / self.args.duration
            filled = min(width, int(done * width))
            print(f"\r{self.phase:<8} [{'#' * filled}{'.' * (width - filled)}] {elapsed:5.0f}s"
                  f"  scenarios {sum(t.scenarios.values()):4d}  requests {t.calls:5d}"
                  f"  healthy {len(t.baseline) + len(t.during):5d}  violations {sum(t.violations.values())}  ",
                  end="", file=sys.stderr, flush=True)
            await trio.sleep(0.5)


# ---- the chaos phase ------------------------------------------------------------------------------------------
def batches(seeds: Iterator[int], parallel: int) -> Iterator[list[int]]:
    """Up to ``parallel`` seeds at a time; a kill runs alone (others would see its outage)."""
    batch: list[int] = []
    for seed in seeds:
        if kind_of(seed) == "encoder_killed":
            if batch:
                yield batch
                batch = []
            yield [seed]
            continue
        batch.append(seed)
        if len(batch) == parallel:
            yield batch
            batch = []
    if batch:
        yield batch


async def run_chaos(world: World, tally: Tally, seeds: Iterator[int], args: argparse.Namespace) -> None:
    deadline = trio.current_time() + args.duration if not args.count else math.inf
    for batch in batches(seeds, args.parallel):
        if trio.current_time() >= deadline:
            return
        world.exclusive = len(batch) == 1
        reports: list[ScenarioReport] = []

        async def one(seed: int) -> None:
            try:
                reports.append(await run_scenario(  # noqa: B023 - run to its end in this iteration's nursery
                    world, seed, clean=False, settle_after=False))
            except Exception as exc:  # noqa: BLE001 - a crash of the harness is a violation too, with its seed
                crashed = ScenarioReport(seed, kind_of(seed))
                crashed.violate("unexpected", f"the scenario crashed: {exc!r}")
                reports.append(crashed)  # noqa: B023 - ditto

        async with trio.open_nursery() as nursery:
            for seed in batch:
                nursery.start_soon(one, seed)
        after = ScenarioReport(batch[0], "after-batch")
        await settle_world(world, after, random.Random(f"check-{batch[0]}"))
        for report in [*reports, after]:
            tally.add(report)


async def run_endings(tally: Tally, args: argparse.Namespace) -> None:
    """``--endings`` seeds on every stage of the endings chaos (encoders in this process)."""
    from endings_scenarios import run_endings_scenario
    from endings_stages import STAGES, stage_for

    media = Media()
    for name in STAGES:
        async with stage_for(name, args.model_path, media) as stage:
            for seed in range(args.seed, args.seed + args.endings):
                tally.add(await run_endings_scenario(stage, seed))


# ---- the table ---------------------------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def table(tally: Tally, args: argparse.Namespace, wall: float) -> str:
    rows = table_rows(tally, args, wall)
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'':<{width}} | chaos soak |", f"|{'-' * (width + 2)}|{'-' * 12}|"]
    lines += [f"| {k:<{width}} | {v} |" for k, v in rows]
    bench_results.record("chaos soak", ["", "chaos soak"], rows)
    return "\n".join(lines)


def table_rows(tally: Tally, args: argparse.Namespace, wall: float) -> list[tuple[str, str]]:
    ms = lambda v: f"{v * 1000:.0f} ms"  # noqa: E731
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(tally.scenarios.items()))
    errors = ", ".join(f"{k} {n}" for k, n in tally.errors.most_common()) or "none"
    other = {k: n for k, n in tally.violations.items() if k not in EXIT_ON}
    b, d = tally.baseline, tally.during
    rows = [
        ("run", f"{args.encoders} encoders + bootstrap + clean encoder (subprocesses), parallel "
                f"{args.parallel}, chaos {f'{args.count:d} scenarios' if args.count else f'{args.duration:g} s'},"
                f"{f', then {args.endings} seeds on each endings stage (in process)' if args.endings else ''},"
                f" wall {wall:.0f} s"),
        ("scenarios run", f"{sum(tally.scenarios.values())} ({kinds})"),
        ("seeds", f"{min(tally.seeds, default=0)}..{max(tally.seeds, default=0)}"),
        ("requests (chaos)", str(tally.calls)),
        ("successes", str(tally.outcomes["ok"])),
        ("typed errors", f"{tally.outcomes['error']} ({errors})"),
        ("gone by their own client", f"{tally.outcomes['dropped']} disconnected, "
                                     f"{tally.outcomes['cancelled']} cancelled"),
        ("hangs", str(tally.violations["hang"])),
        ("leaks", str(tally.violations["leak"])),
        ("5xx caused by client faults", str(tally.violations["client_5xx"])),
        ("other violations", ", ".join(f"{k} {n}" for k, n in other.items()) or "0"),
        ("healthy requests (baseline / chaos)", f"{len(b)} / {len(d)}, failed {tally.clean_failures}"),
        ("healthy p50 (baseline / chaos)", f"{ms(percentile(b, 0.5))} / {ms(percentile(d, 0.5))}"),
        ("healthy p99 (baseline / chaos)", f"{ms(percentile(b, 0.99))} / {ms(percentile(d, 0.99))}"),
    ]
    return rows


# ---- main ------------------------------------------------------------------------------------------------------------
async def soak(args: argparse.Namespace) -> int:
    tally = Tally()
    progress = Progress(tally, args)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="chaos-soak-") as tmp:
        logs = Path(args.logs or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        async with trio.open_nursery() as outer:
            outer.start_soon(progress.run)
            async with AsyncExitStack() as stack:
                await soak_with_servers(stack, args, logs, tally, progress)
            if args.endings:
                progress.enter("endings")
                await run_endings(tally, args)
            outer.cancel_scope.cancel()
        print(file=sys.stderr)
    print(table(tally, args, time.monotonic() - t0))
    for line in tally.details[:50]:
        print("  " + line, file=sys.stderr)
    return 1 if any(tally.violations.values()) else 0


async def soak_with_servers(stack: AsyncExitStack, args: argparse.Namespace, logs: Path, tally: Tally,
                            progress: Progress) -> None:
    boot, encoders, clean = await start_servers(stack, args, logs)
    http = await stack.enter_async_context(httpx.AsyncClient(timeout=10.0))
    chaos_client = await stack.enter_async_context(open_encoder_client(
        bootstrap_url=boot.url, refresh_interval=1.0, **CLIENT_OPTIONS))
    clean_client = await stack.enter_async_context(
        open_encoder_client(encoder_urls=[clean.url], **CLIENT_OPTIONS))
    media = Media()
    refs = References(media)
    await refs.from_client(clean_client)
    world = World(http=http, media=media, refs=refs, chaos_urls=[e.url for e in encoders],
                  chaos_client=chaos_client, killables=encoders, clean_client=None, clean_urls=[],
                  client_options=CLIENT_OPTIONS)
    stack.callback(world.close_stuck)

    progress.enter("baseline")
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(clean_loop, world, clean_client, tally.baseline, tally, stop)
        await trio.sleep(args.baseline)
        stop.set()

    progress.enter("chaos")
    seeds = iter(args.replay) if args.replay else (args.seed + i for i in range(args.count or 1 << 62))
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(clean_loop, world, clean_client, tally.during, tally, stop)
        await run_chaos(world, tally, seeds, args)
        stop.set()

    progress.enter("finish")
    world.close_stuck()
    final = ScenarioReport(-1, "after-batch")
    for problem in await settle(http, [*world.all_urls(), clean.url],
                                {"chaos client": chaos_client, "clean client": clean_client}):
        final.violate("leak", f"at the end: {problem}")
    for proc in [*encoders, clean]:  # SIGTERM: each drains and exits 0
        if (code := await proc.stop()) != 0:
            final.violate("broken", f"{proc.name} exited {code} on SIGTERM; log:\n{proc.log_tail(10)}")
    tally.add(final)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of chaos (default 60)")
    parser.add_argument("--count", type=int, default=0, help="run this many scenarios instead")
    parser.add_argument("--encoders", type=int, default=2, help="chaos encoders (default 2)")
    parser.add_argument("--parallel", type=int, default=2, help="scenarios at a time (default 2)")
    parser.add_argument("--baseline", type=float, default=None,
                        help="seconds of clean requests alone first (default: min(15, duration / 4))")
    parser.add_argument("--seed", type=int, default=None, help="first scenario seed (default: random)")
    parser.add_argument("--replay", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="run exactly these seeds (comma-separated)")
    parser.add_argument("--model-path", default=None, help="checkpoint (default: the embedded tiny model)")
    parser.add_argument("--logs", default=None, help="keep the servers' logs in this directory")
    parser.add_argument("--endings", type=int, default=0,
                        help="then this many seeds on each stage of the endings chaos (Mooncake, "
                             "the SGLang face's three backends, process mode; default 0)")
    bench_results.add_argument(parser)
    args = parser.parse_args(argv)
    if args.encoders < 1 or args.parallel < 1:
        parser.error("--encoders and --parallel must be at least 1")
    if args.replay:
        args.count = len(args.replay)
    if args.baseline is None:
        args.baseline = min(15.0, (args.duration if not args.count else 60.0) / 4)
    if args.seed is None:
        args.seed = random.randrange(1 << 20)
    if args.replay:
        print(f"chaos soak: replaying seeds {args.replay}", file=sys.stderr)
    else:
        print(f"chaos soak: first seed {args.seed} (replay one with --replay SEED --parallel 1)",
              file=sys.stderr)
    ensure_model(args)
    with bench_results.recording("chaos_soak", args.results, argv):
        return trio.run(soak, args)


if __name__ == "__main__":
    sys.exit(main())
