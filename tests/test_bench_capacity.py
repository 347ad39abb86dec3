"""``tools/bench_capacity.py``'s bookkeeping: /proc parsing and the CPU split (no timings asserted)."""

from __future__ import annotations

import os
import threading
import time
from types import ModuleType

import pytest

from conftest import load_tool


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_tool("bench_capacity")


def test_stat_lines_with_awkward_thread_names(bench: ModuleType) -> None:
    tck = bench.CLK_TCK
    # comm may hold spaces and parentheses; fields count from the last ')'.
    line = (f"4242 (a) b (c)) S 17 4242 4242 0 -1 4194560 100 0 0 0 {3 * tck} {tck} "
            f"{2 * tck} {tck // 2} 20 0 5 0 100 0 0\n")
    comm, ppid, own, reaped = bench.parse_stat(line)
    assert (comm, ppid) == ("a) b (c)", 17)
    assert own == pytest.approx(4.0) and reaped == pytest.approx(2.5)


def test_split_is_per_image_and_other_is_the_rest(bench: ModuleType) -> None:
    before = bench.CpuSample(total=10.0, main=4.0, zmq=0.5, children=0.0,
                             ledger={"preprocess": 1.0, "forward": 2.0})
    after = bench.CpuSample(total=12.0, main=4.5, zmq=0.6, children=0.0,
                            ledger={"preprocess": 1.8, "forward": 2.4, "other": 9.0})
    ms = bench.split_cpu(before, after, images=100)
    assert ms == pytest.approx({"cpu": 20.0, "trio": 5.0, "pre": 8.0, "fwd": 4.0, "zmq": 1.0,
                                "grpc": 0.0, "other": 2.0})
    # grpcio's threads are their own place, out of ``other``.
    with_grpc = bench.split_cpu(bench.CpuSample(10.0, 4.0, 0.5, 0.0, grpc=1.0),
                                bench.CpuSample(12.0, 4.5, 0.6, 0.0, grpc=1.5), images=100)
    assert with_grpc["grpc"] == pytest.approx(5.0) and with_grpc["other"] == pytest.approx(9.0)
    # A ledger the server lacks (an older encoder) counts as nothing, never as negative.
    bare = bench.split_cpu(bench.CpuSample(1.0, 0.5, 0.0, 0.0), bench.CpuSample(2.0, 1.0, 0.0, 0.0), 10)
    assert bare["pre"] == bare["fwd"] == 0.0 and bare["other"] == pytest.approx(50.0)


def test_reading_this_process(bench: ModuleType) -> None:
    """A thread that has burnt CPU of its own is in ``total`` and not in ``main``."""
    spun, done = threading.Event(), threading.Event()

    def spin() -> None:
        while not done.is_set():
            sum(range(1000))
            if time.thread_time() >= 0.2:  # this thread's own CPU seconds
                spun.set()

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        assert spun.wait(60)
        sample = bench.read_cpu(os.getpid())
    finally:
        done.set()
        thread.join()
    assert sample.main > 0.0  # this (the main) thread has imported and run pytest
    assert sample.total - sample.main >= 0.1  # the spinner's 0.2 s, less clock-tick slack
    assert sample.zmq >= 0.0 and sample.children >= 0.0


def test_scaling_is_against_the_fewest_workers(bench: ModuleType) -> None:
    rows = [bench.Row("t", "http", "png", 64, w, rate, {}, 0) for w, rate in ((2, 30.0), (1, 20.0), (4, 50.0))]
    bench.add_scaling(rows)
    assert [r.scaling for r in rows] == pytest.approx([1.5, 1.0, 2.5])


def test_the_preprocess_mode_reaches_the_encoder(bench: ModuleType) -> None:
    args = bench.parse_args(["--preprocess-mode", "process"])
    command = bench.encoder_args(bench.ROOT, "builtin", args, dict(os.environ))
    assert command[command.index("--preprocess-mode") + 1] == "process"
    assert "--preprocess-mode" not in bench.encoder_args(bench.ROOT, "builtin", bench.parse_args([]),
                                                         dict(os.environ))


def test_a_window_says_how_many_cores_the_server_used(bench: ModuleType) -> None:
    window = bench.Window(rate=500.0, ms={"cpu": 2.5}, failed=0, load_cores=0.7)
    assert window.cores == pytest.approx(1.25)  # 500 images/s × 2.5 ms of CPU each


async def test_both_load_generators_reach_a_real_encoder(bench: ModuleType, encoder) -> None:
    """HTTP and gRPC load, one short window each, against one encoder: answers, no failures."""
    import trio

    body = bench.encode_body(bench.make_image(32, "png"), "png", "smoke-")
    async with encoder(grpc_port=0) as (server, http):
        target = server.grpc.url.removeprefix("grpc://")
        for load, where in ((bench.run_load, server.url), (bench.run_grpc_load, target)):
            done, wall, failed, cpu = await trio.to_thread.run_sync(
                bench.load_with_cpu, load, where, body, 2, 0.5)
            assert done > 0 and failed == 0 and wall > 0
            assert cpu > 0  # the load's own CPU (this process here), the table's "load" column
        assert (await http.get("/stats")).json()["live_requests"] == 0
