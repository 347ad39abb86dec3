"""Benchmark: how long the event loop stalls, and what that costs other requests.

1. **Building a large inline answer** (``--sections inline``). The inline ``/encode``
   answer is a safetensors file of the whole embedding. Built on the trio thread, every
   other request waits until it is done; the ``InlineDelivery`` builds bodies above
   ``OFFLOAD_BYTES`` in a worker thread. This runs both ways, taking turns ``--repeat``
   times, with one float32 embedding of ``--mib`` MiB (default 64), while a task that only
   yields records the longest gap between its turns (the loop's stall):

   * ``on loop``: ``InlineDelivery`` with the threshold set above the size;
   * ``off loop``: the same with the default threshold (a worker thread).

   The table gives the median and worst stall and the median build time. The thread still
   shares the GIL with the loop, so the stall is not zero: copies inside safetensors hold it
   while they run.

2. **A client streaming a body of tiny chunks** (``--sections http``). One client sends a
   chunked body of ``--chunks`` one-byte chunks (``1\\r\\na\\r\\n`` each) as fast as it can,
   while another sends small GETs one after the other on a keep-alive connection; each HTTP
   server (``--http-server``, both by default, taking turns ``--http-repeat`` times) serves a
   bare ASGI app in this process, the two clients run in a child process. The table gives
   the GETs' latency idle (before the stream) and during the stream, and how fast the
   stream went: h11 parses each chunk on the trio thread, so what matters is how often the
   server lets other requests in between.

    python tools/bench_loop_stall.py [--mib 64] [--repeat 7] [--chunks 300000]
    python tools/bench_loop_stall.py --quick          # ~1 min on 2 cores
    python tools/bench_loop_stall.py --sections http --http-server builtin hypercorn

Benchmarks report; they do not assert. Timings taken while other work runs on the machine
say little: compare rows of one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from typing import Any

import trio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trio.lowlevel

import bench_results  # tools/: the results file the docs are built from
from epd_trio.config import HTTP_SERVERS

# torch and the delivery load only for the inline section: the HTTP section's client process
# (this file, ``--client``) starts in a fraction of the time without them.


async def one_build(embedding: Any, offload_bytes: int) -> tuple[float, float]:
    """(longest loop stall, build time) in seconds, for one answer."""
    from epd_trio.delivery.inline import InlineDelivery
    from epd_trio.protocol.requests import EncodeMeta

    tokens, dim = embedding.shape
    meta = EncodeMeta("bench", 0, 1, "image", tokens, dim, "float32", [tokens], [[1, 2, 2 * tokens]])
    delivery = InlineDelivery(threads=trio.CapacityLimiter(1), offload_bytes=offload_bytes)
    gaps: list[float] = []
    done = trio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await trio.lowlevel.checkpoint()
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.sleep(0.01)  # the ticker is running
        started = time.perf_counter()
        await delivery.deliver(embedding, meta)
        built = time.perf_counter() - started
        done.set()
    return max(gaps), built


async def inline_section(mib: int, repeat: int) -> None:
    import torch

    from epd_trio.delivery.inline import OFFLOAD_BYTES

    embedding = torch.randn(mib * (1 << 20) // (4 * 1024), 1024)
    modes = {"on loop": embedding.numel() * 4 + 1, "off loop": OFFLOAD_BYTES}
    results: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
    await one_build(embedding, OFFLOAD_BYTES)  # warm-up: the thread pool, the allocator
    for _ in range(repeat):
        for mode, threshold in modes.items():  # taking turns: load drift hits both alike
            results[mode].append(await one_build(embedding, threshold))
    title = f"inline answer of {mib} MiB (float32 [{embedding.shape[0]}, 1024]), {repeat} runs each"
    print(title)
    print(f"{'build':<10}{'stall median ms':>17}{'stall max ms':>14}{'build median ms':>17}")
    rows = []
    for mode, runs in results.items():
        stalls, builds = [s for s, _ in runs], [b for _, b in runs]
        print(f"{mode:<10}{statistics.median(stalls) * 1e3:>17.1f}{max(stalls) * 1e3:>14.1f}"
              f"{statistics.median(builds) * 1e3:>17.1f}")
        rows.append([mode, f"{statistics.median(stalls) * 1e3:.1f}", f"{max(stalls) * 1e3:.1f}",
                     f"{statistics.median(builds) * 1e3:.1f}"])
    bench_results.record(title, ["build", "stall median ms", "stall max ms", "build median ms"], rows)


# ---- 2. a client streaming tiny chunks ----------------------------------------------------------
async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """GET: a small answer at once; POST: the body read to its end, then its size."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    size = 0
    if scope["method"] == "POST":
        while True:
            message = await receive()
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
    body = str(size).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def one_stream(server: str, chunks: int, probes: int) -> dict[str, Any]:
    """Serve ``_app`` with ``server`` while the child process's two clients run → their report."""
    from epd_trio._listen import bound_listener, start_http_server

    stop = trio.Event()
    async with bound_listener("127.0.0.1", 0) as listener, trio.open_nursery() as nursery:
        await start_http_server(nursery, _app, listener, server=server, graceful_timeout=1.0,
                                shutdown_trigger=stop.wait)
        port = listener.sock.getsockname()[1]
        command = [sys.executable, __file__, "--client", str(port), "--chunks", str(chunks), "--probes", str(probes)]
        done = await trio.run_process(command, capture_stdout=True)
        stop.set()
    return json.loads(done.stdout)


class _Prober:
    """Small GETs one after the other on a keep-alive connection (a new one when the server
    closes it: Hypercorn's protocol does after 1000 requests)."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._sock = self._connect()

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self._port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def get(self) -> float:
        """One GET → its latency in seconds."""
        started = time.perf_counter()
        self._sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while not data.endswith(b"\r\n\r\n0"):
            chunk = self._sock.recv(4096)
            if not chunk:
                raise ConnectionError("the server closed the probe's connection mid-answer")
            data += chunk
        took = time.perf_counter() - started
        if b"connection: close" in data.lower():
            self._sock.close()
            self._sock = self._connect()
        return took


def client(port: int, chunks: int, probes: int) -> None:
    """The child process: idle GETs, then GETs while a thread streams tiny chunks; JSON out."""
    probe = _Prober(port)
    idle = [probe.get() for _ in range(probes)]
    finished = threading.Event()
    seconds: list[float] = []

    def stream() -> None:
        body = b"1\r\na\r\n" * chunks + b"0\r\n\r\n"
        with socket.create_connection(("127.0.0.1", port)) as sock:
            started = time.perf_counter()
            sock.sendall(b"POST /sink HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
            answer = b""
            while not answer.endswith(str(chunks).encode()):
                answer += sock.recv(4096)
            seconds.append(time.perf_counter() - started)
        finished.set()

    streamer = threading.Thread(target=stream)
    streamer.start()
    loaded = [probe.get()]  # at least one, however short the stream
    while not finished.is_set():
        loaded.append(probe.get())
    streamer.join()
    print(json.dumps({"idle": idle, "loaded": loaded, "stream_seconds": seconds[0]}))


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3


async def http_section(servers: list[str], chunks: int, probes: int, repeat: int) -> None:
    runs: dict[str, list[dict[str, Any]]] = {server: [] for server in servers}
    for _ in range(repeat):
        for server in servers:  # taking turns: load drift hits both alike
            runs[server].append(await one_stream(server, chunks, probes))
    title = (f"other requests while one client streams {chunks} one-byte chunks "
             f"(GET latency in ms; {repeat} run(s) per server, taking turns)")
    header = ["server", "idle p50", "idle p99", "stream p50", "stream p99", "stream max", "GETs", "chunks/s"]
    print(f"\n{title}")
    print(f"{header[0]:<11}{header[1]:>9}{header[2]:>9}" + "".join(f"{h:>11}" for h in header[3:6])
          + f"{header[6]:>6}{header[7]:>10}")
    rows = []
    for server, results in runs.items():
        idle = [t for r in results for t in r["idle"]]
        loaded = [t for r in results for t in r["loaded"]]
        rate = statistics.median(chunks / r["stream_seconds"] for r in results)
        row = [server, *(f"{v:.2f}" for v in (_ms(idle, 0.5), _ms(idle, 0.99), _ms(loaded, 0.5),
                                             _ms(loaded, 0.99), max(loaded) * 1e3)), str(len(loaded)), f"{rate:.0f}"]
        print(f"{row[0]:<11}{row[1]:>9}{row[2]:>9}{row[3]:>11}{row[4]:>11}{row[5]:>11}{row[6]:>6}{row[7]:>10}")
        rows.append(row)
    bench_results.record(title, header, rows)


async def main(args: argparse.Namespace) -> None:
    if "inline" in args.sections:
        await inline_section(args.mib, args.repeat)
    if "http" in args.sections:
        await http_section(args.http_server, args.chunks, args.probes, args.http_repeat)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sections", nargs="+", choices=["inline", "http"], default=["inline", "http"])
    parser.add_argument("--mib", type=int, default=64, help="inline: the embedding's size")
    parser.add_argument("--repeat", type=int, default=7, help="inline: builds of each kind")
    parser.add_argument("--http-server", nargs="+", choices=HTTP_SERVERS, default=list(HTTP_SERVERS))
    parser.add_argument("--chunks", type=int, default=300_000, help="http: one-byte chunks in the stream")
    parser.add_argument("--probes", type=int, default=200, help="http: idle GETs before the stream")
    parser.add_argument("--http-repeat", type=int, default=3, help="http: streams per server")
    parser.add_argument("--quick", action="store_true", help="~1 min on 2 cores: smaller everything")
    parser.add_argument("--client", type=int, help=argparse.SUPPRESS)  # the child process: its port
    bench_results.add_argument(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.mib, args.repeat, args.chunks, args.probes, args.http_repeat = 16, 3, 50_000, 50, 1
    return args


if __name__ == "__main__":
    options = parse_args()
    if options.client is not None:
        client(options.client, options.chunks, options.probes)
    else:
        with bench_results.recording("bench_loop_stall", options.results):
            trio.run(main, options)
