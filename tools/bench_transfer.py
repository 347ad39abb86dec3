"""Benchmark: moving one embedding — ZMQ, Mooncake, a raw socket and memcpy, side by side.

For each size (MiB: 1, 4, 16, 64, 256, 512; ``--quick``: up to 64) one bfloat16
``[tokens, 2048]`` embedding is moved, in this process, by:

* ``memcpy``: ``dst.copy_(src)`` of the same bytes — the ceiling;
* ``fresh buffer``: not a transfer: allocating and filling a new buffer of
  that size, the page faults a receiver pays when every message gets new
  memory (ZMQ's PULL side does; the pool and Mooncake's destination do not);
* ``raw tcp``: a plain loopback TCP socket, ``sendall`` from one thread into
  ``recv_into`` a preallocated buffer in another — the reference the others
  are compared with (the ``x raw`` columns);
* ``zmq tcp`` / ``zmq ipc``: the encoder's ZMQ path: ``header_for`` +
  ``encode_zmq_message`` (1 MiB payload frames) sent by a ``PushSocketCache`` to
  a ``PullReceiver`` (trio, zero-copy frames), received as a ``Payload`` whose
  frames are still where libzmq put them;
* ``zmq tcp watched``: ``zmq tcp`` with every send watched until libzmq
  releases its buffers (``release_budget=0``: how every send waited before
  the release budget), so what the budget buys is measured side by side;
* ``zmq tcp 1 frame``: the same with the whole tensor in one frame (how every
  message was sent before payload frames): libzmq then ``malloc``s a block
  above glibc's mmap threshold per message, and pays the ``fresh buffer`` cost;
* ``zmq tcp + copy``: ``zmq tcp`` plus ``Payload.copy_into`` a preallocated
  destination — the whole client path to its pool slot, comparable with
  ``raw tcp`` and ``mooncake tcp``, which land in the destination too;
* ``mooncake tcp``: ``MooncakeTransport.write`` from a registered source to a
  second engine's registered destination (two engines, loopback TCP): the
  bytes land where the receiver wants them. The first transfer to a peer
  includes a handshake: it is done in a warm-up, as is one transfer of every
  method at every size.
* ``mooncake engine sync``: the engine's own blocking ``transfer_sync_write``
  between two bare engines, in a thread — the ceiling of the engine's TCP
  transport, which ``mooncake tcp`` (the same engine under trio) is measured
  against.

A second table gives the trio thread's own CPU per message (``time.thread_time()``
around each turn): for ZMQ the Python of both ends (header, frames, the trio
socket, the decode), for ``raw tcp`` only its hand-off to the two threads.

The methods take turns, ``--repeat`` times per size (3 times as many up to 4 MiB,
where one message takes a millisecond or less), so load drift on a shared
machine hits all alike, in an order reversed every other turn, so that no
method always follows the same one (a send that returns before libzmq lets go
of its buffers leaves work to the next method's time); the table shows the
median as GB/s (10^9 bytes/s).

**Encoder-side copies, counted.** An extra copy of the payload shows up as
resident memory: the peak RSS (``VmHWM``, reset through
``/proc/self/clear_refs``) is measured around sends of an already resident
payload, together with ``tracemalloc``'s peak (the Python heap: a ``bytes``
copy would show there). ``zmq tcp send`` sends with ``encode_zmq_message`` +
``PushSocketCache.send`` to a PULL socket in a child process (so the
receiver's frames are not counted); ``mooncake write`` writes into a
preallocated, resident destination (both engines here, so both sides are
counted). A control row adds one ``clone()`` per send: it reads 1 or more
(the allocator may keep the last clone while making the next), which shows
the method sees a copy when there is one.

Usage::

    .venv/bin/python tools/bench_transfer.py --quick          # ~30 s, up to 64 MiB
    .venv/bin/python tools/bench_transfer.py                  # ~1-2 min, up to 512 MiB
    .venv/bin/python tools/bench_transfer.py --sizes 1,16,128 --repeat 7 --plot /tmp/t.png

The plot needs matplotlib (not a dependency of epd-trio: ``pip install
matplotlib``); without it the table is still printed. Benchmarks report; they
do not assert.
"""

from __future__ import annotations

import argparse
import gc
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # the Mooncake engine's glog noise
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402
import trio  # noqa: E402

import bench_results  # noqa: E402  (tools/: the results file the docs are built from)
from epd_trio.errors import TransportError  # noqa: E402
from epd_trio.protocol.codec import encode_zmq_message, header_for  # noqa: E402
from epd_trio.protocol.payload import PAYLOAD_FRAME_BYTES  # noqa: E402
from epd_trio.transport.mooncake import MooncakeTransport, open_mooncake  # noqa: E402
from epd_trio.transport.zmq import RELEASE_BUDGET, PullReceiver, PushSocketCache  # noqa: E402

MiB = 1 << 20
DIM = 2048  # bfloat16 [tokens, 2048]: every MiB size is a whole number of rows
FULL_SIZES = (1, 4, 16, 64, 256, 512)
QUICK_SIZES = (1, 4, 16, 64)
REFERENCE = "raw tcp"
ZMQ_ONE_FRAME = "zmq tcp 1 frame"  # protocol v1 before payload frames: the old way, side by side
ZMQ_WATCHED = "zmq tcp watched"  # every send waits for libzmq to release it (release_budget=0)
ZMQ_TO_DST = "zmq tcp + copy"  # what the client does: receive, then copy into its pool slot
MOONCAKE_BARE = "mooncake engine sync"  # the engine's own blocking write: its ceiling
INTO_DST = frozenset({"memcpy", REFERENCE, "mooncake tcp", ZMQ_TO_DST, MOONCAKE_BARE})  # others stay in frames
NOT_TRANSFERS = frozenset({"memcpy", "fresh buffer", REFERENCE})  # no "x raw" ratio

SMALL_MIB, SMALL_REPEAT_FACTOR = 4, 3  # sizes up to 4 MiB: 3 x the turns
Once = Callable[[int], Awaitable[None]]  # one timed run on n bytes (most move src[:n] to dst)


def embedding(buffer: torch.Tensor, nbytes: int) -> torch.Tensor:
    return buffer[:nbytes].view(torch.bfloat16).view(-1, DIM)


def zmq_frames(tensor: torch.Tensor, frame_bytes: int = PAYLOAD_FRAME_BYTES) -> list:
    header = header_for(tensor, req_id="bench", part_idx=0, num_parts=1, modality="image",
                        token_counts=[tensor.shape[0]])
    return encode_zmq_message(header, tensor, frame_bytes=frame_bytes)


# ---- the methods ------------------------------------------------------------------
def memcpy_method(src: torch.Tensor, dst: torch.Tensor) -> Once:
    async def once(n: int) -> None:
        dst[:n].copy_(src[:n])
    return once


async def fresh_buffer(n: int) -> None:
    torch.empty(n, dtype=torch.uint8).fill_(1)


class RawSocket:
    """A connected loopback pair; a thread receives into ``dst`` on request."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        self.tx = socket.create_connection(listener.getsockname())
        self.rx, _ = listener.accept()
        listener.close()
        self.src, self.dst = memoryview(src.numpy()), memoryview(dst.numpy())
        self.jobs: queue.Queue[int | None] = queue.Queue()
        self.done: queue.Queue[int] = queue.Queue()
        self.thread = threading.Thread(target=self._receive, daemon=True)
        self.thread.start()

    def _receive(self) -> None:
        while (n := self.jobs.get()) is not None:
            got = 0
            while got < n:
                got += self.rx.recv_into(self.dst[got:n])
            self.done.put(got)

    def transfer(self, n: int) -> None:
        self.jobs.put(n)
        self.tx.sendall(self.src[:n])
        self.done.get()

    async def once(self, n: int) -> None:
        await trio.to_thread.run_sync(self.transfer, n)

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()
        self.tx.close()
        self.rx.close()


async def zmq_method(stack: AsyncExitStack, bind: str, src: torch.Tensor, *,
                     dst: torch.Tensor | None = None, one_frame: bool = False,
                     release_budget: int = RELEASE_BUDGET) -> Once:
    """Send an embedding and receive it; with ``dst``, also copy it there (the pool copy)."""
    pull = await stack.enter_async_context(PullReceiver(bind))
    push = await stack.enter_async_context(PushSocketCache(release_budget=release_budget))
    endpoint = pull.last_endpoint

    tensors: dict[int, torch.Tensor] = {}  # the encoder has its embedding before it sends

    async def once(n: int) -> None:
        tensor = tensors.get(n)
        if tensor is None:
            tensor = tensors[n] = embedding(src, n)
        frames = zmq_frames(tensor, frame_bytes=n if one_frame else PAYLOAD_FRAME_BYTES)
        # One after the other, as the two ends run in service (the encoder's scope sends, the
        # client's demux task receives): libzmq's I/O threads move the bytes meanwhile, and a
        # watched send waits only for libzmq's own sending. A nursery per message here cost
        # ~100 us of CPU and ~0.2-0.4 ms of wall time that neither end pays.
        await push.send(endpoint, frames, 60.0)
        _, payload = await pull.receive()
        assert payload is not None and payload.nbytes == n
        if dst is not None:
            payload.copy_into(embedding(dst, n))
    return once


async def mooncake_pair(stack: AsyncExitStack, src: torch.Tensor, dst: torch.Tensor
                        ) -> tuple[MooncakeTransport, MooncakeTransport]:
    sender = await stack.enter_async_context(open_mooncake("127.0.0.1"))
    receiver = await stack.enter_async_context(open_mooncake("127.0.0.1"))
    await stack.enter_async_context(sender.registered(src.data_ptr(), src.numel()))
    await stack.enter_async_context(receiver.registered(dst.data_ptr(), dst.numel()))
    await sender.write(receiver.session, src.data_ptr(), dst.data_ptr(), 4096, timeout=30)  # handshake
    return sender, receiver


def mooncake_method(pair: tuple[MooncakeTransport, MooncakeTransport], src: torch.Tensor,
                    dst: torch.Tensor) -> Once:
    sender, receiver = pair

    async def once(n: int) -> None:
        await sender.write(receiver.session, src.data_ptr(), dst.data_ptr(), n,
                           timeout=30 + n / 1e8)
    return once


class EngineSyncWrite:
    """Mooncake's own blocking ``transfer_sync_write`` between two bare engines, in a
    thread: what the engine itself does, without ``MooncakeTransport`` around it."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        from mooncake.engine import TransferEngine

        self.engines = [TransferEngine(), TransferEngine()]
        for engine in self.engines:
            if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
                raise TransportError("cannot start a bare mooncake engine")
        self.sender, receiver = self.engines
        self.src, self.dst = src.data_ptr(), dst.data_ptr()
        self.sender.register_memory(self.src, src.numel())
        receiver.register_memory(self.dst, dst.numel())
        self.peer = f"127.0.0.1:{receiver.get_rpc_port()}"
        self.write(4096)  # handshake

    def write(self, n: int) -> None:
        if self.sender.transfer_sync_write(self.peer, self.src, self.dst, n) != 0:
            raise TransportError("mooncake transfer_sync_write failed")

    async def once(self, n: int) -> None:
        await trio.to_thread.run_sync(self.write, n)

    def close(self) -> None:
        self.sender.unregister_memory(self.src)
        self.engines[1].unregister_memory(self.dst)


# ---- throughput -------------------------------------------------------------------
async def measure(methods: dict[str, Once], sizes: list[int], repeat: int, dst: torch.Tensor,
                  src: torch.Tensor) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, float]]]:
    """Median GB/s, and median trio-thread CPU seconds, per method and size; every method's
    copy is checked once per size."""
    gbps: dict[str, dict[int, float]] = {name: {} for name in methods}
    cpu: dict[str, dict[int, float]] = {name: {} for name in methods}
    for size in sizes:
        n = size * MiB
        times: dict[str, list[float]] = {name: [] for name in methods}
        spent: dict[str, list[float]] = {name: [] for name in methods}
        for name, once in methods.items():  # warm-up, and proof the bytes arrived
            dst[:n].zero_()
            await once(n)
            if name in INTO_DST:
                assert torch.equal(dst[:n], src[:n]), f"{name} moved the wrong bytes"
        names = list(methods)
        # A small message takes a millisecond or less, and on a shared machine one turn's
        # wake-ups swing it by +-25 %: small sizes take more turns (cheaply) for a steadier median.
        for r in range(repeat * SMALL_REPEAT_FACTOR if size <= SMALL_MIB else repeat):
            for name in names if r % 2 == 0 else names[::-1]:  # no method always follows the same one
                start, start_cpu = time.perf_counter(), time.thread_time()
                await methods[name](n)
                times[name].append(time.perf_counter() - start)
                spent[name].append(time.thread_time() - start_cpu)
        for name in methods:
            gbps[name][size] = n / statistics.median(times[name]) / 1e9
            cpu[name][size] = statistics.median(spent[name])
        print(f"  {size:>4} MiB (load {os.getloadavg()[0]:.1f}): "
              + ", ".join(f"{k} {v[size]:.2f}" for k, v in gbps.items()), flush=True)
    return gbps, cpu


def cpu_table(cpu: dict[str, dict[int, float]], sizes: list[int]) -> str:
    """The trio thread's CPU per message: the Python a method runs (both ends, for ZMQ)."""
    head, rows = cpu_rows(cpu, sizes)
    bench_results.record("trio-thread CPU per message (median)", head, rows)
    return _aligned(head, rows)


def cpu_rows(cpu: dict[str, dict[int, float]], sizes: list[int]) -> tuple[list[str], list[list[str]]]:
    names = [m for m in cpu if m.startswith("zmq") or m == REFERENCE]
    head = ["size MiB"] + [f"{m} us" for m in names]
    return head, [[str(size)] + [f"{cpu[m][size] * 1e6:.0f}" for m in names] for size in sizes]


def _aligned(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [head, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def table(gbps: dict[str, dict[int, float]], sizes: list[int]) -> str:
    names = list(gbps)
    head = ["size MiB"] + [f"{m} GB/s" + ("" if m in NOT_TRANSFERS else " (x raw)")
                           for m in names]
    rows = []
    for size in sizes:
        ref = gbps.get(REFERENCE, {}).get(size)
        cells = [str(size)]
        for m in names:
            value = gbps[m][size]
            ratio = f" ({value / ref:.2f})" if ref and m not in NOT_TRANSFERS else ""
            cells.append(f"{value:.2f}{ratio}")
        rows.append(cells)
    bench_results.record("GB/s (ratio to the raw socket), median", head, rows)
    return _aligned(head, rows)


def plot(gbps: dict[str, dict[int, float]], sizes: list[int], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no plot: matplotlib is not installed (pip install matplotlib; "
              f"it is not a dependency of epd-trio); {path} not written")
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, values in gbps.items():
        ax.plot(sizes, [values[s] for s in sizes], marker="o",
                linestyle="--" if name in NOT_TRANSFERS else "-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("embedding size (MiB)")
    ax.set_ylabel("throughput (GB/s, median)")
    ax.set_title(f"epd_trio transfer, loopback, {os.cpu_count()} cores")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


# ---- counting copies --------------------------------------------------------------
def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


async def count_extra(send: Callable[[], Awaitable[None]], sends: int) -> tuple[int, int]:
    """(peak RSS growth, tracemalloc peak) in bytes over ``sends`` calls of ``send``."""
    gc.collect()
    tracemalloc.start()
    try:
        if not _reset_peak_rss():
            raise RuntimeError("cannot reset the peak RSS (/proc/self/clear_refs)")
        base = _status_kib("VmRSS")
        tracemalloc.reset_peak()
        for _ in range(sends):
            await send()
        peak_rss = _status_kib("VmHWM") - base
        _, py_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return max(peak_rss, 0) * 1024, py_peak


def _sink_main(count: int) -> int:
    """Child process: a plain PULL socket that drops ``count`` messages."""
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind("tcp://127.0.0.1:*")
    print(pull.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    for _ in range(count):
        pull.recv_multipart(copy=False)
    print("done", flush=True)
    pull.close(linger=0)
    ctx.term()
    return 0


async def count_copies(size_mib: int, sends: int, mooncake: bool) -> list[tuple[str, int, int]]:
    n = size_mib * MiB
    payload = torch.empty(n, dtype=torch.uint8).random_()  # resident before counting
    tensor = embedding(payload, n)
    rows = []
    sink = subprocess.Popen(  # noqa: ASYNC220 - Popen only starts it; its output is read in a thread
        [sys.executable, __file__, "--zmq-sink", str(1 + 2 * sends)], stdout=subprocess.PIPE, text=True)
    try:
        endpoint = (await trio.to_thread.run_sync(sink.stdout.readline)).strip()  # type: ignore[union-attr]
        async with PushSocketCache() as push:
            await push.send(endpoint, zmq_frames(embedding(payload, 4096)), 30)  # connect first
            rows.append(("zmq tcp send", *await count_extra(
                lambda: push.send(endpoint, zmq_frames(tensor), 60), sends)))
            rows.append(("control: clone + zmq tcp send", *await count_extra(
                lambda: push.send(endpoint, zmq_frames(tensor.clone()), 60), sends)))
        await trio.to_thread.run_sync(sink.stdout.readline)  # type: ignore[union-attr]
    finally:
        if sink.poll() is None:
            sink.kill()
        sink.wait()
        if sink.stdout is not None:
            sink.stdout.close()
    if mooncake:
        dst = torch.empty(n, dtype=torch.uint8).fill_(1)
        async with AsyncExitStack() as stack:
            sender, receiver = await mooncake_pair(stack, payload, dst)
            rows.append(("mooncake write", *await count_extra(
                lambda: sender.write(receiver.session, payload.data_ptr(), dst.data_ptr(), n,
                                     timeout=60), sends)))
    return rows


# ---- main -------------------------------------------------------------------------
async def run(args: argparse.Namespace) -> None:
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else \
        list(QUICK_SIZES if args.quick else FULL_SIZES)
    repeat = args.repeat or (5 if args.quick else 7)
    torch.set_num_threads(args.torch_threads)  # a plain memcpy; OpenMP barriers are noise here
    top = max(sizes) * MiB
    src = torch.empty(top, dtype=torch.uint8).random_()
    dst = torch.empty(top, dtype=torch.uint8).fill_(0)
    print(f"sizes {sizes} MiB, {repeat} runs each ({repeat * SMALL_REPEAT_FACTOR} up to {SMALL_MIB} MiB;"
          f" median), {os.cpu_count()} cores, "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"load average {os.getloadavg()[0]:.1f} at start", flush=True)
    async with AsyncExitStack() as stack:
        raw = RawSocket(src, dst)
        stack.callback(raw.close)
        methods: dict[str, Once] = {"memcpy": memcpy_method(src, dst), "fresh buffer": fresh_buffer,
                                    REFERENCE: raw.once}
        methods["zmq tcp"] = await zmq_method(stack, "tcp://127.0.0.1:0", src)
        methods[ZMQ_WATCHED] = await zmq_method(stack, "tcp://127.0.0.1:0", src, release_budget=0)
        methods[ZMQ_ONE_FRAME] = await zmq_method(stack, "tcp://127.0.0.1:0", src, one_frame=True)
        methods[ZMQ_TO_DST] = await zmq_method(stack, "tcp://127.0.0.1:0", src, dst=dst)
        ipc_dir = stack.enter_context(tempfile.TemporaryDirectory())
        methods["zmq ipc"] = await zmq_method(stack, f"ipc://{ipc_dir}/bench.sock", src)
        mooncake = not args.skip_mooncake
        if mooncake:
            try:
                pair = await mooncake_pair(stack, src, dst)
                methods["mooncake tcp"] = mooncake_method(pair, src, dst)
                bare = EngineSyncWrite(src, dst)
                stack.callback(bare.close)
                methods[MOONCAKE_BARE] = bare.once
            except TransportError as exc:
                mooncake = False
                print(f"mooncake skipped: {exc}")
        gbps, cpu = await measure(methods, sizes, repeat, dst, src)
    print()
    print(table(gbps, sizes))
    print("\ntrio-thread CPU per message (median; thread_time() around each turn):")
    print(cpu_table(cpu, sizes))
    for name in ("zmq tcp", ZMQ_WATCHED, ZMQ_ONE_FRAME, ZMQ_TO_DST, "zmq ipc", "mooncake tcp",
                 MOONCAKE_BARE):
        if name in gbps:
            ratios = [gbps[name][s] / gbps[REFERENCE][s] for s in sizes]
            small = [gbps[name][s] / gbps[REFERENCE][s] for s in sizes if s <= 4]
            print(f"{name}: ratio to the raw socket min {min(ratios):.2f}, median"
                  f" {statistics.median(ratios):.2f} (target >= 0.8)"
                  + (f"; at 1-4 MiB min {min(small):.2f}" if small else ""))
    if MOONCAKE_BARE in gbps:
        ours = [gbps["mooncake tcp"][s] / gbps[MOONCAKE_BARE][s] for s in sizes]
        print(f"mooncake tcp / {MOONCAKE_BARE}: min {min(ours):.2f}, median"
              f" {statistics.median(ours):.2f} (what the trio wrapper costs)")
    if args.plot:
        plot(gbps, sizes, args.plot)
    del src, dst
    gc.collect()

    size = args.copy_check_mib or (16 if args.quick else 64)
    print(f"\nencoder-side copies: a resident {size} MiB payload, 3 sends each")
    rows = await count_copies(size, 3, mooncake)
    print(f"{'path':<32}{'peak RSS growth':>18}{'/ payload':>11}{'tracemalloc peak':>18}")
    for name, rss, py in rows:
        print(f"{name:<32}{rss / MiB:>14.2f} MiB{rss / (size * MiB):>11.3f}{py / 1024:>14.1f} KiB")
    bench_results.record(f"encoder-side copies: a resident {size} MiB payload, 3 sends each",
                         ["path", "peak RSS growth MiB", "/ payload", "tracemalloc peak KiB"],
                         [[name, f"{rss / MiB:.2f}", f"{rss / (size * MiB):.3f}", f"{py / 1024:.1f}"]
                          for name, rss, py in rows])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="sizes up to 64 MiB, 5 runs each")
    parser.add_argument("--sizes", help="comma-separated sizes in MiB (overrides --quick's)")
    parser.add_argument("--repeat", type=int, help="timed runs per size and method (default 7, --quick 5)")
    parser.add_argument("--plot", default="bench_transfer.png", help="PNG to write ('' for none)")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch threads (memcpy)")
    parser.add_argument("--skip-mooncake", action="store_true", help="leave Mooncake out")
    parser.add_argument("--copy-check-mib", type=int,
                        help="payload of the copy count (default 64, --quick 16)")
    parser.add_argument("--zmq-sink", type=int, help=argparse.SUPPRESS)  # the child process
    bench_results.add_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.zmq_sink:
        return _sink_main(args.zmq_sink)
    with bench_results.recording("bench_transfer", args.results, argv):
        trio.run(run, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
