"""Benchmark: what ``DecodeGuard`` (the gRPC server's interceptor) costs per call.

The guard makes bytes that are not a method's message ``INVALID_ARGUMENT``
instead of grpcio's ``UNKNOWN``; it runs on every call of every method. Two
measures, side by side in one run:

* **in process**, on one asyncio loop: the interceptor's ``intercept_service``
  against the bare continuation it wraps, the guarded request deserializer
  against grpcio's, and the guarded handler against the bare one (µs per
  call, best of ``--repeat``);
* **end to end**: a ``grpc.aio`` server process serving
  ``grpc.health.v1.Health/Check`` with and without the guard (servers taking
  turns, ``--repeat`` turns), a blocking client in this process; latency per
  call and the server process's CPU per call (from ``/proc``), medians.

    python tools/bench_grpc_guard.py [--calls 3000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_results  # tools/: the results file the docs are built from
from epd_trio.encoder.grpc_bridge import DecodeGuard

CHECK = "/grpc.health.v1.Health/Check"


class _Details:
    """What grpcio hands an interceptor: the method's name (and metadata, unused here)."""

    method = CHECK
    invocation_metadata = ()


async def _per_call(fn: Callable[[], Awaitable[Any]], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        await fn()
    return (time.perf_counter() - started) / calls * 1e6


def in_process(calls: int, repeat: int) -> list[tuple[str, float, float]]:
    """(what, bare µs, guarded µs), best of ``repeat``."""

    async def main() -> list[tuple[str, float, float]]:
        async def behaviour(request: Any, context: Any) -> Any:
            return request

        handler = grpc.unary_unary_rpc_method_handler(
            behaviour, request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString)

        async def continuation(details: Any) -> Any:
            return handler

        guard, details = DecodeGuard(), _Details()
        guarded = await guard.intercept_service(continuation, details)
        raw = health_pb2.HealthCheckRequest(service="epd").SerializeToString()

        async def plain_decode() -> Any:
            return handler.request_deserializer(raw)

        async def guarded_decode() -> Any:
            return guarded.request_deserializer(raw)

        request = health_pb2.HealthCheckRequest.FromString(raw)
        rows = [("interceptor (find the handler)", lambda: continuation(details),
                 lambda: guard.intercept_service(continuation, details)),
                ("request deserializer", plain_decode, guarded_decode),
                ("handler (checks for an undecodable request)", lambda: handler.unary_unary(request, None),
                 lambda: guarded.unary_unary(request, None))]
        out = []
        for what, bare, wrapped in rows:
            times = [(await _per_call(bare, calls), await _per_call(wrapped, calls)) for _ in range(repeat)]
            out.append((what, min(t[0] for t in times), min(t[1] for t in times)))
        return out

    return asyncio.run(main())


def serve(guarded: bool) -> None:
    """The server process: print the bound port, serve until killed."""

    async def main() -> None:
        server = grpc.aio.server(interceptors=(DecodeGuard(),) if guarded else ())
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def _cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of ``pid``."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def end_to_end(guarded: bool, calls: int) -> tuple[float, float]:
    """(latency µs, server CPU µs) per Check, one fresh server process (a new interpreter,
    not a fork: grpcio does not survive a fork once it has run in the parent)."""
    with subprocess.Popen([sys.executable, __file__, "--serve", "guarded" if guarded else "bare"],
                          stdout=subprocess.PIPE, text=True) as server:
        try:
            return _measure(server, calls)
        finally:
            server.kill()


def _measure(server: subprocess.Popen[str], calls: int) -> tuple[float, float]:
    assert server.stdout is not None
    ready, _, _ = select.select([server.stdout], [], [], 60)
    line = server.stdout.readline() if ready else ""
    if not line.strip().isdigit():  # its first line is the port; anything else, it failed
        raise RuntimeError(f"the gRPC server did not start within 60 s (exit {server.poll()})")
    port = int(line)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        request = health_pb2.HealthCheckRequest()
        for _ in range(200):  # warm: connection, handler lookups
            check(request, timeout=10)
        cpu, started = _cpu_seconds(server.pid), time.perf_counter()
        for _ in range(calls):
            check(request, timeout=10)
        wall = time.perf_counter() - started
        return wall / calls * 1e6, (_cpu_seconds(server.pid) - cpu) / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000, help="calls per end-to-end turn")
    parser.add_argument("--repeat", type=int, default=5, help="turns per server kind")
    parser.add_argument("--serve", choices=("bare", "guarded"), help=argparse.SUPPRESS)  # the server
    bench_results.add_argument(parser)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve == "guarded")
        return 0
    with bench_results.recording("bench_grpc_guard", args.results):
        measure_and_report(args.calls, args.repeat)
    return 0


def measure_and_report(calls: int, repeat: int) -> None:
    header = [f"in process (best of {repeat})", "bare µs", "guarded µs", "added µs"]
    rows = [[what, f"{bare:.2f}", f"{wrapped:.2f}", f"{wrapped - bare:+.2f}"]
            for what, bare, wrapped in in_process(100_000, repeat)]
    print_markdown(header, rows)
    bench_results.record("in process: the guard's steps against the bare ones", header, rows)
    runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for turn in range(repeat):
        for guarded in ((False, True) if turn % 2 == 0 else (True, False)):
            runs[guarded].append(end_to_end(guarded, calls))
    header = [f"Health/Check end to end ({repeat} turns × {calls} calls)",
              "latency µs, median (range)", "server CPU µs per call, median (range)"]
    rows = []
    for guarded in (False, True):
        lat, cpu = ([r[i] for r in runs[guarded]] for i in (0, 1))
        rows.append([f"{'with' if guarded else 'without'} DecodeGuard",
                     f"{statistics.median(lat):.0f} ({min(lat):.0f}–{max(lat):.0f})",
                     f"{statistics.median(cpu):.0f} ({min(cpu):.0f}–{max(cpu):.0f})"])
    print()
    print_markdown(header, rows)
    bench_results.record("end to end: a server process with and without the guard", header, rows)


def print_markdown(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|---" * len(header) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
