"""Benchmark: how many images per second one encoder process can feed its device, and what each costs the CPU.

An ``epd-trio encoder`` subprocess (the embedded tiny model, or
``--checkpoint``) serves ``POST /encode`` with inline answers; load comes from
a *separate* process (C threads, each with its own keep-alive HTTP connection,
one image per request as a base64 data URI). For each image format and size,
against ``--preprocess-workers`` 1…N, it reports images/s and the server's CPU
milliseconds per image, split by where they were spent.

How the CPU is split (the simplest honest method; every number is CPU time,
not wall time, so other work on a shared machine does not inflate it):

* ``cpu``: the server process's utime+stime from ``/proc/<pid>/stat``, plus
  its child processes' (live ones from their own ``stat``, reaped ones from
  ``cutime``/``cstime``): everything the server spent.
* ``trio``: the main thread's (``/proc/<pid>/task/<pid>/stat``): the trio
  thread runs HTTP, JSON, base64, the service, scheduling and small deliveries.
* ``pre`` and ``fwd``: the server's own ledger (``/stats`` → ``cpu_seconds``,
  ``epd_trio/engine/cpu.py``): ``time.thread_time()`` measured inside the
  preprocessing thread (decode + processor) and the device thread (the
  forward's calling thread; torch's intra-op threads are in ``other``).
* ``zmq``: threads named ``ZMQbg/*`` (libzmq's I/O threads).
* ``other``: the rest — intra-op/OpenMP pools, large inline bodies built off
  the loop, child processes.
* ``cores`` and ``load``: CPU seconds per second of the server (``cpu`` ×
  images/s) and of the load generator's process: where they add up to the
  machine's cores, more preprocessing workers cannot raise images/s, and the
  ``x W1`` column shows where that happens.
* ``decode``, ``proc``, ``body`` (stand-alone): the image decode, the model's
  processor and building the inline answer, each timed alone in this process
  on the same image (median of 20, thread CPU): how ``pre`` splits, and what
  the delivery costs inside ``trio``.

``--null-forward`` starts the encoder with its benchmarking stand-in device
(zeros of the right shape at once), so what is measured is everything but
the model. Each figure is the median over ``--repeats`` windows; images/s is
also given as a ratio to the same case at 1 worker, side by side. The load
average is printed before and after: on a shared machine, read the CPU
columns, not images/s. ``--http-server builtin hypercorn`` runs one encoder
with each HTTP server (``--http-server``), side by side, windows taking turns.
``--tree DIR`` (repeatable) runs the same cases
against the encoder of another source tree (e.g. an older commit's worktree),
side by side: all trees' encoders are up at once (an idle one costs nothing)
and their windows take turns. ``--api http grpc`` sends the same load over
gRPC too (``--grpc-port``; ``epd_trio.v1.Encoder/Encode``, inline answers, one
channel per client thread), side by side; ``grpc`` is then grpcio's threads
(its C core's and the encoder's ``grpc-loop``). Each window costs the server one ``/stats``
call (~1 ms of trio-thread CPU), negligible beside a window's requests.

Usage::

    .venv/bin/python tools/bench_capacity.py --quick --null-forward   # ~2-3 min, 2 cores
    .venv/bin/python tools/bench_capacity.py --null-forward --workers 1 2 4 8 16 --plot cap.png
    # the trio thread's cost per small request, this tree against an older one:
    .venv/bin/python tools/bench_capacity.py --sizes 64 --formats png --workers 1 --tree . --tree ../base
    # preprocessing in child processes instead of threads:
    .venv/bin/python tools/bench_capacity.py --null-forward --preprocess-mode process --workers 1 2
    # the same requests over HTTP and over gRPC:
    .venv/bin/python tools/bench_capacity.py --quick --null-forward --api http grpc --sizes 64 1024
    # the trio thread's cost per small request with each HTTP server:
    .venv/bin/python tools/bench_capacity.py --null-forward --sizes 64 --workers 1 --http-server builtin hypercorn

Benchmarks report; they do not assert.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import http.client
import io
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import bench_results  # noqa: E402  (tools/: the results file the docs are built from)

CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---- /proc: CPU per process and per thread ---------------------------------------
def parse_stat(text: str) -> tuple[str, int, float, float]:
    """``(comm, ppid, own seconds, reaped children's seconds)`` from a ``/proc/.../stat`` line.

    ``comm`` may hold spaces and parentheses: the fields after it start at the
    last ``)``.
    """
    head, _, rest = text.rpartition(")")
    comm = head.partition("(")[2]
    fields = rest.split()
    # fields[0] is field 3 (state): utime/stime are fields 14/15, cutime/cstime 16/17.
    ppid = int(fields[1])
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return comm, ppid, (utime + stime) / CLK_TCK, (cutime + cstime) / CLK_TCK


@dataclass(frozen=True)
class CpuSample:
    """One reading of a server's CPU seconds, by where they were spent."""

    total: float  # the process, its live descendants and its reaped children
    main: float  # the main (trio) thread
    zmq: float  # libzmq's background threads
    children: float  # descendants (live and reaped)
    ledger: dict[str, float] = field(default_factory=dict)  # /stats cpu_seconds
    grpc: float = 0.0  # grpcio's threads: its asyncio loop ("grpc-loop") and its C core's


# grpcio's own thread names (the C core's) and the encoder's gRPC loop thread.
GRPC_THREADS = ("grpc", "event_engine", "lifeguard")


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # a thread or process that just ended
        return None


def _descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (text := _read(f"/proc/{entry}/stat")) is not None:
            parents.setdefault(parse_stat(text)[1], []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def read_cpu(pid: int) -> CpuSample:
    """The server's CPU now, from ``/proc`` (Linux)."""
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        raise RuntimeError(f"the encoder (pid {pid}) is gone")
    _, _, own, reaped = parse_stat(text)
    main = zmq = grpc = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        if (stat := _read(f"/proc/{pid}/task/{tid}/stat")) is None:
            continue
        comm, _, seconds, _ = parse_stat(stat)
        if int(tid) == pid:
            main = seconds
        elif comm.startswith("ZMQbg"):
            zmq += seconds
        elif comm.startswith(GRPC_THREADS):
            grpc += seconds
    live = sum(parse_stat(t)[2] for c in _descendants(pid) if (t := _read(f"/proc/{c}/stat")))
    return CpuSample(own + reaped + live, main, zmq, reaped + live, grpc=grpc)


def split_cpu(before: CpuSample, after: CpuSample, images: int) -> dict[str, float]:
    """Milliseconds per image in each place between two readings (``other`` is the rest)."""
    per = 1e3 / max(images, 1)
    ledger = {k: after.ledger.get(k, 0.0) - before.ledger.get(k, 0.0) for k in ("preprocess", "forward")}
    out = {
        "cpu": (after.total - before.total) * per,
        "trio": (after.main - before.main) * per,
        "pre": ledger["preprocess"] * per,
        "fwd": ledger["forward"] * per,
        "zmq": (after.zmq - before.zmq) * per,
        "grpc": (after.grpc - before.grpc) * per,
    }
    out["other"] = max(0.0, out["cpu"] - sum(out[k] for k in ("trio", "pre", "fwd", "zmq", "grpc")))
    return out


# ---- the encoder subprocess ------------------------------------------------------
class Encoder:
    """``epd-trio encoder`` from a source tree, on a free port, until closed."""

    def __init__(self, tree: Path, args: Sequence[str], env: dict[str, str]) -> None:
        self.tree = tree
        cmd = [sys.executable, "-m", "epd_trio.cli", "encoder", "--port", "0",
               "--log-level", "WARNING", *args]
        self.proc = subprocess.Popen(cmd, cwd=tree, env={**env, "PYTHONPATH": str(tree)},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.url = self._wait_listening()
        self.grpc_target = self._wait_grpc() if "--grpc-port" in args else None
        self.lines: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()

    def _wait_listening(self) -> str:
        seen = []
        for line in self.proc.stdout:  # type: ignore[union-attr]
            seen.append(line)
            if "listening on " in line:
                return line.rsplit("listening on ", 1)[1].strip()
        raise RuntimeError("the encoder exited before listening:\n" + "".join(seen[-30:]))

    def _wait_grpc(self) -> str:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            if "serving gRPC on " in line:
                return line.rsplit("serving gRPC on ", 1)[1].strip().removeprefix("grpc://")
        raise RuntimeError("the encoder exited before serving gRPC")

    def _drain(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.append(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def get(self, path: str) -> Any:
        parts = urlsplit(self.url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, json.loads(response.read() or b"null")
        finally:
            conn.close()

    def wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.get("/health")[0] == 200:
                return
            time.sleep(0.2)
        raise RuntimeError("the encoder did not become healthy")

    def sample(self) -> CpuSample:
        _status, stats = self.get("/stats")
        ledger = {k: v["seconds"] for k, v in ((stats or {}).get("cpu_seconds") or {}).items()}
        cpu = read_cpu(self.pid)
        return CpuSample(cpu.total, cpu.main, cpu.zmq, cpu.children, ledger, cpu.grpc)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def supports(tree: Path, flag: str, env: dict[str, str]) -> bool:
    out = subprocess.run([sys.executable, "-m", "epd_trio.cli", "encoder", "--help"], cwd=tree,
                         env={**env, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
    return flag in out.stdout


# ---- the load generator (a separate process) -------------------------------------
def run_load(url: str, body: tuple[bytes, bytes], concurrency: int, seconds: float) -> tuple[int, float, int]:
    """``(answers, wall seconds, failures)``: ``concurrency`` threads post for ``seconds``.

    ``body`` is the JSON around the req_id, which each request fills in (live
    req_ids must be unique).
    """
    prefix, suffix = body
    parts = urlsplit(url)
    stop = time.monotonic() + seconds
    counts = [0] * concurrency
    failures = [0] * concurrency
    headers = {"Content-Type": "application/json"}

    def client(i: int) -> None:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
        try:
            n = 0
            while time.monotonic() < stop:
                n += 1
                conn.request("POST", "/encode", b"%s%d-%d%s" % (prefix, i, n, suffix), headers)
                response = conn.getresponse()
                response.read()
                if response.status == 200:
                    counts[i] += 1
                else:
                    failures[i] += 1
        finally:
            conn.close()

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(client, range(concurrency)))
    return sum(counts), time.monotonic() - started, sum(failures)


def run_grpc_load(target: str, body: tuple[bytes, bytes], concurrency: int,
                  seconds: float) -> tuple[int, float, int]:
    """``run_load`` over gRPC: ``epd_trio.v1.Encoder/Encode`` with the same item, inline
    answers, one channel (one HTTP/2 connection) per client thread as HTTP has."""
    import grpc

    sys.path.insert(0, str(ROOT))
    from epd_trio.protocol.proto import encoder_pb2 as pb, encoder_pb2_grpc as pb_grpc

    prefix, suffix = body
    fields = json.loads(prefix + b"x" + suffix)
    stop = time.monotonic() + seconds
    counts, failures = [0] * concurrency, [0] * concurrency

    def client(i: int) -> None:
        template = pb.EncodeRequest(modality=fields["modality"],
                                    mm_items=[pb.Item(url=u) for u in fields["mm_items"]])
        with grpc.insecure_channel(target) as channel:
            encode = pb_grpc.EncoderStub(channel).Encode
            n = 0
            while time.monotonic() < stop:
                n += 1
                template.req_id = f"{fields['req_id'][:-1]}{i}-{n}"
                try:
                    encode(template, timeout=120)
                    counts[i] += 1
                except grpc.RpcError:
                    failures[i] += 1

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(client, range(concurrency)))
    return sum(counts), time.monotonic() - started, sum(failures)


# ---- inputs and stand-alone stage costs ------------------------------------------
def make_image(size: int, fmt: str, seed: int = 0) -> bytes:
    """A photo-like image (gradients plus mild noise), encoded as a client sends it."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / max(size - 1, 1)
    base = np.stack([x * 200, y * 180, (x + y) * 90], axis=-1)
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format=fmt.upper(), **({"quality": 90} if fmt == "jpeg" else {}))
    return buffer.getvalue()


def encode_body(image: bytes, fmt: str, req_id: str) -> tuple[bytes, bytes]:
    """The request's JSON split where each request's own req_id suffix goes."""
    uri = f"data:image/{fmt};base64," + base64.b64encode(image).decode()
    text = json.dumps({"req_id": req_id + "@@", "modality": "image", "mm_items": [uri],
                       "deliver": {"backend": "inline"}})
    prefix, suffix = text.split("@@")
    return prefix.encode(), suffix.encode()


def _median_cpu_ms(fn: Any, repeats: int = 20) -> float:
    fn()  # warm
    samples = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        samples.append((time.thread_time() - t0) * 1e3)
    return statistics.median(samples)


def standalone_costs(model_dir: Path, image: bytes) -> dict[str, float]:
    """Decode, processor and inline-body CPU ms for one image, each alone in this thread."""
    import torch
    from transformers import AutoConfig

    from epd_trio.model.adapters import adapter_for
    from epd_trio.model.loader import load_processors
    from epd_trio.model.media import MediaLimits, decode_image
    from epd_trio.protocol.codec import encode_safetensors

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    adapter = adapter_for(config)
    processor = load_processors(adapter, model_dir)["image"]
    limits = MediaLimits()
    decoded = decode_image(image, 0, limits)
    processed = dict(processor(images=[decoded], return_tensors="pt"))
    tokens = adapter.item_result(processed, "image").tokens
    embedding = torch.zeros(tokens, adapter.embedding_dim, dtype=torch.float32)
    meta = {"req_id": "x", "part_idx": 0, "num_parts": 1, "modality": "image",
            "token_counts": [tokens], "grid_thw": [[1, 1, 1]], "extras": {}}
    return {
        "decode": _median_cpu_ms(lambda: decode_image(image, 0, limits)),
        "proc": _median_cpu_ms(lambda: processor(images=[decoded], return_tensors="pt")),
        "body": _median_cpu_ms(lambda: encode_safetensors(embedding, meta)),
    }


# ---- one run ---------------------------------------------------------------------
@dataclass
class Row:
    tree: str
    api: str  # http or grpc
    fmt: str
    size: int
    workers: int
    rate: float  # images/s, median over repeats
    ms: dict[str, float]  # CPU ms per image by place, medians
    failures: int
    scaling: float = float("nan")  # rate / rate at the fewest workers
    cores: float = float("nan")  # the server's CPU seconds per second, median over repeats
    load_cores: float = float("nan")  # the load generator's, the same way


def load_with_cpu(load: Callable[..., tuple[int, float, int]], *args: Any) -> tuple[int, float, int, float]:
    """``load(*args)`` and the CPU seconds the load process spent meanwhile (all its threads)."""
    started = time.process_time()
    done, wall, failed = load(*args)
    return done, wall, failed, time.process_time() - started


@dataclass
class Window:
    """One window of load against one case: what the server and the load generator spent."""

    rate: float  # images/s
    ms: dict[str, float]  # the server's CPU ms per image by place
    failed: int
    load_cores: float  # the load generator's CPU seconds per second

    @property
    def cores(self) -> float:
        """The server's CPU seconds per second: with ``load_cores``, how far the cores are used."""
        return self.rate * self.ms["cpu"] / 1000


def measure_case(encoder: Encoder, pool: concurrent.futures.Executor, body: tuple[bytes, bytes],
                 concurrency: int, seconds: float, api: str = "http") -> Window:
    before = encoder.sample()
    load, target = (run_grpc_load, encoder.grpc_target) if api == "grpc" else (run_load, encoder.url)
    done, wall, failed, cpu = pool.submit(load_with_cpu, load, target, body, concurrency, seconds).result()
    after = encoder.sample()
    return Window(done / wall, split_cpu(before, after, done), failed, cpu / wall)


def medians(samples: Sequence[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def bodies(formats: Sequence[str], sizes: Sequence[int]) -> dict[tuple[str, int], tuple[bytes, bytes]]:
    return {(f, s): encode_body(make_image(s, f), f, f"cap-{f}-{s}-") for f in formats for s in sizes}


def encoder_args(tree: Path, server: str, args: argparse.Namespace, env: dict[str, str]) -> list[str]:
    extra = ["--model-path", str(args.checkpoint)] if args.checkpoint else []
    if supports(tree, "--http-server", env):
        extra += ["--http-server", server]
    elif server != "builtin":
        raise SystemExit(f"{tree}: its encoder has no --http-server (it always serves with Hypercorn)")
    if args.null_forward:
        if supports(tree, "--null-forward", env):
            extra.append("--null-forward")
        else:
            print(f"# {tree}: its encoder has no --null-forward: the model's forward runs")
    if "grpc" in args.api:
        extra += ["--grpc-port", "0"]
    if args.preprocess_mode:
        extra += ["--preprocess-mode", args.preprocess_mode]
    return [*extra, "--max-pending", str(max(256, 4 * args.concurrency))]


def run_workers(workers: int, args: argparse.Namespace, pool: concurrent.futures.Executor,
                cases: dict[tuple[str, int], tuple[bytes, bytes]], env: dict[str, str]) -> Iterator[Row]:
    """Every tree's encoder at once (an idle one costs nothing); windows take turns between them."""
    encoders: dict[str, Encoder] = {}
    try:
        for label, tree, server in args.targets:
            encoders[label] = Encoder(tree, [*args.encoder_args[(tree, server)], "--preprocess-workers",
                                             str(workers)], env)
        for encoder in encoders.values():
            encoder.wait_healthy()
            for body in cases.values():  # warm every shape (processor caches, allocator)
                pool.submit(run_load, encoder.url, body, 2, args.warmup).result()
                if encoder.grpc_target:
                    pool.submit(run_grpc_load, encoder.grpc_target, body, 2, args.warmup).result()
        samples: dict[tuple[str, str, str, int], list[Window]] = {}
        for _ in range(args.repeats):  # cases, trees and APIs take turns, so drift hits them alike
            for key, body in cases.items():
                for tree, encoder in encoders.items():
                    for api in args.api:
                        samples.setdefault((tree, api, *key), []).append(
                            measure_case(encoder, pool, body, args.concurrency, args.seconds, api))
        for (label, api, fmt, size), runs in samples.items():
            yield Row(label, api, fmt, size, workers,
                      statistics.median(r.rate for r in runs), medians([r.ms for r in runs]),
                      sum(r.failed for r in runs), cores=statistics.median(r.cores for r in runs),
                      load_cores=statistics.median(r.load_cores for r in runs))
    finally:
        for encoder in encoders.values():
            encoder.close()


# ---- report --------------------------------------------------------------------------
COLUMNS = ("cpu", "trio", "pre", "fwd", "zmq", "grpc", "other")


def print_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [list(header), *[[str(x) for x in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for n, r in enumerate(cells):
        print("  ".join(x.rjust(w) for x, w in zip(r, widths)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def add_scaling(rows: list[Row]) -> None:
    base: dict[tuple[str, str, str, int], float] = {}
    for row in sorted(rows, key=lambda r: r.workers):
        base.setdefault((row.tree, row.api, row.fmt, row.size), row.rate)
        row.scaling = row.rate / base[(row.tree, row.api, row.fmt, row.size)]


def report(rows: list[Row], alone: dict[tuple[str, int], dict[str, float]]) -> None:
    add_scaling(rows)
    trees = len({r.tree for r in rows}) > 1
    apis = len({r.api for r in rows}) > 1
    header = [*(["encoder"] if trees else []), *(["api"] if apis else []), "fmt", "size", "W", "img/s", "x W1",
              "cores", "load", *(f"{c} ms" for c in COLUMNS), "decode*", "proc*", "body*", "fail"]
    table = []
    for r in sorted(rows, key=lambda r: (r.fmt, r.size, r.workers, r.tree, r.api)):
        a = alone.get((r.fmt, r.size), {})
        table.append([*([r.tree] if trees else []), *([r.api] if apis else []), r.fmt, r.size, r.workers,
                      f"{r.rate:.1f}", f"{r.scaling:.2f}", f"{r.cores:.2f}", f"{r.load_cores:.2f}",
                      *(f"{r.ms[c]:.2f}" for c in COLUMNS),
                      *(f"{a.get(k, float('nan')):.2f}" for k in ("decode", "proc", "body")), r.failures])
    note = ("CPU ms per image, server side, medians; cores / load: CPU seconds per second of the "
            f"server / the load generator, of {os.cpu_count()} here; * stand-alone in the benchmark process")
    print_table(header, table)
    print(f"({note})")
    bench_results.record("images/s and server CPU per image", header, table, note)


def plot(rows: list[Row], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib is not installed: no plot")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for key in sorted({(r.tree, r.api, r.fmt, r.size) for r in rows}):
        line = sorted((r for r in rows if (r.tree, r.api, r.fmt, r.size) == key), key=lambda r: r.workers)
        label = " ".join(str(k) for k in key if k)
        left.plot([r.workers for r in line], [r.rate for r in line], marker="o", label=label)
        right.plot([r.workers for r in line], [r.ms["cpu"] for r in line], marker="o", label=label)
    left.set(xlabel="--preprocess-workers", ylabel="images/s", title="throughput")
    right.set(xlabel="--preprocess-workers", ylabel="server CPU ms / image", title="CPU cost")
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    print(f"# plot: {path}")


def load_line() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.2f} (5 min {five:.2f}) on {os.cpu_count()} cores"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer sizes, shorter windows (~2-3 min on 2 cores)")
    p.add_argument("--checkpoint", type=Path, help="model checkpoint (default: the embedded tiny model)")
    p.add_argument("--null-forward", action="store_true", help="the encoder's stand-in device: no model forward")
    p.add_argument("--formats", nargs="+", default=["jpeg", "png"], choices=["jpeg", "png"])
    p.add_argument("--sizes", nargs="+", type=int, default=None, help="square image sizes (64 224 448 1024)")
    p.add_argument("--workers", nargs="+", type=int, default=None, help="--preprocess-workers values (1 2)")
    p.add_argument("--concurrency", type=int, default=None, help="concurrent clients (32; quick 16)")
    p.add_argument("--seconds", type=float, default=None, help="length of one window (4; quick 1.5)")
    p.add_argument("--repeats", type=int, default=None, help="windows per case, median taken (3; quick 2)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of warm-up per case")
    p.add_argument("--tree", type=Path, action="append", help="source tree whose encoder runs "
                   "(repeatable, side by side; default: this one)")
    p.add_argument("--api", nargs="+", default=["http"], choices=["http", "grpc"],
                   help="how the load reaches the encoder: HTTP POST /encode and/or gRPC "
                   "epd_trio.v1.Encoder/Encode (--grpc-port), side by side")
    p.add_argument("--http-server", nargs="+", default=["builtin"], choices=["builtin", "hypercorn"],
                   help="the encoder's --http-server, side by side (one encoder each): the trio "
                   "thread's cost of each HTTP server, in one run")
    p.add_argument("--preprocess-mode", choices=["thread", "process"], default=None,
                   help="the encoder's --preprocess-mode (default: the encoder's own, thread)")
    p.add_argument("--plot", type=Path, help="PNG of images/s and CPU per image (needs matplotlib)")
    bench_results.add_argument(p)
    args = p.parse_args(argv)
    quick = args.quick
    args.sizes = args.sizes or ([64, 224, 448] if quick else [64, 224, 448, 1024])
    args.workers = args.workers or [1, 2]
    args.concurrency = args.concurrency or (16 if quick else 32)
    args.seconds = args.seconds or (1.5 if quick else 4.0)
    args.repeats = args.repeats or (2 if quick else 3)
    args.tree = [t.resolve() for t in (args.tree or [ROOT])]
    args.targets = targets(args.tree, args.http_server)
    return args


def targets(trees: Sequence[Path], servers: Sequence[str]) -> list[tuple[str, Path, str]]:
    """``(label, tree, http server)`` for every encoder a run starts; the label names what varies."""
    out = []
    for tree in trees:
        for server in servers:
            parts = [tree.name or str(tree)] if len(trees) > 1 else []
            parts += [server] if len(servers) > 1 else []
            out.append(("/".join(parts) or tree.name or str(tree), tree, server))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    with bench_results.recording("bench_capacity", args.results, argv):
        measure_and_report(args)


def measure_and_report(args: argparse.Namespace) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    print(f"# bench_capacity: {'null forward' if args.null_forward else 'model forward'}, "
          f"{args.checkpoint or 'embedded tiny model'}, C={args.concurrency}, "
          f"{args.seconds:g} s x {args.repeats} windows per case; {load_line()}")
    cases = bodies(args.formats, args.sizes)
    sys.path.insert(0, str(ROOT))
    from epd_trio.config import EngineConfig
    from epd_trio.model.tiny import ensure_default_model

    model_dir = args.checkpoint or ensure_default_model(EngineConfig().resolved_cache_dir())
    alone = {(f, s): standalone_costs(model_dir, make_image(s, f)) for f, s in cases}
    rows: list[Row] = []
    spawn = multiprocessing.get_context("spawn")
    args.encoder_args = {(tree, server): encoder_args(tree, server, args, env)
                         for _, tree, server in args.targets}
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        for workers in args.workers:
            rows.extend(run_workers(workers, args, pool, cases, env))
    print(f"# done; {load_line()}")
    report(rows, alone)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
