"""Benchmark: how long building a large inline answer stalls the event loop.

The inline ``/encode`` answer is a safetensors file of the whole embedding.
Built on the trio thread, every other request waits until it is done; the
``InlineDelivery`` builds bodies above ``OFFLOAD_BYTES`` in a worker thread.
This runs both ways, taking turns ``--repeat`` times, with one float32
embedding of ``--mib`` MiB (default 64), while a task that only yields
records the longest gap between its turns (the loop's stall):

* ``on loop``: ``InlineDelivery`` with the threshold set above the size;
* ``off loop``: the same with the default threshold (a worker thread).

The table gives the median and worst stall and the median build time. The
thread still shares the GIL with the loop, so the stall is not zero: copies
inside safetensors hold it while they run.

    python tools/bench_loop_stall.py [--mib 64] [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import os
import sys

import torch
import trio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_results  # noqa: E402  (tools/: the results file the docs are built from)
from epd_trio.delivery.inline import OFFLOAD_BYTES, InlineDelivery  # noqa: E402
from epd_trio.protocol.requests import EncodeMeta  # noqa: E402


async def one_build(embedding: torch.Tensor, offload_bytes: int) -> tuple[float, float]:
    """(longest loop stall, build time) in seconds, for one answer."""
    tokens, dim = embedding.shape
    meta = EncodeMeta("bench", 0, 1, "image", tokens, dim, "float32", [tokens], [[1, 2, 2 * tokens]])
    delivery = InlineDelivery(threads=trio.CapacityLimiter(1), offload_bytes=offload_bytes)
    gaps: list[float] = []
    done = trio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await trio.sleep(0)
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


async def main(mib: int, repeat: int) -> None:
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=7)
    bench_results.add_argument(parser)
    args = parser.parse_args()
    with bench_results.recording("bench_loop_stall", args.results):
        trio.run(main, args.mib, args.repeat)
