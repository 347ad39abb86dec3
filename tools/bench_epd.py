"""Benchmark: time to first token, vLLM alone against vLLM + epd_trio encoders through the proxy.

Time to first token (TTFT) is what disaggregated encoding exists for: the
language server stops encoding images on its own path. One run starts

* a vLLM 0.32 server (its CPU build, from the vLLM venv: ``tools/vllm_env.sh``)
  as an EC consumer of a shared directory. Sent a request directly, it finds
  no stored item and encodes the images itself: that is **vLLM alone**;
* ``max(--encoders)`` epd_trio encoders (``epd-trio encoder --api vllm``,
  EC producers of that directory), each a process of its own;
* for each count N in ``--encoders``, an ``epd-trio proxy`` over the first N
  encoders and that vLLM server: **EPD, N encoders**.

Each request is a streamed chat request with ``--images`` images, every image
new (random pixels: no cache of vLLM's or ours can answer), ``--max-tokens``
greedy tokens. TTFT runs from sending the request to the first streamed event
that carries a generated token. Per image count, the setups take turns round by
round (``--concurrency`` requests at once each turn), so a drift of the machine
hits them all alike. The table gives TTFT p50 and p99 per setup, and each EPD
setup's as a ratio to vLLM alone with the same images (below 1: EPD is faster).

The model is a tiny random-weight Qwen2.5-VL (``--vision-depth``,
``--vision-hidden`` size its vision tower) unless ``--model-path`` names a
checkpoint; its answers mean nothing, its timings are real. On a machine whose
cores the encoders share with vLLM, EPD can only add its hops; its gain needs
cores (or devices) of its own for the encoders.

Usage::

    export EPD_VLLM_DIR=/path/to/vllm-venv      # default: .vllm (tools/vllm_env.sh)
    python tools/bench_epd.py --quick            # 1 and 4 images, 1 and 2 encoders, 3 requests
    python tools/bench_epd.py                    # 1, 4, 8 images; 1, 2, 4 encoders; 20 requests
    python tools/bench_all.py --only bench_epd   # the full run, into docs/benchmarks.md

Benchmarks report; they do not assert.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tools"), str(ROOT / "tests" / "vllm"), str(ROOT)]

import bench_results  # noqa: E402  (tools/: the results file the docs are built from)
from bench_service import load, percentile, print_table  # noqa: E402  (tools/: shared report helpers)

START_TIMEOUT = 600.0  # seconds an encoder or a proxy may take to start on a busy machine
REQUEST_TIMEOUT = 600.0


@dataclass(frozen=True)
class Cell:
    """One table row: a setup's TTFTs for requests with ``images`` images."""

    images: int
    setup: str  # "vLLM alone" or "EPD, N encoders"
    ttft: tuple[float, ...]  # seconds

    @property
    def p50(self) -> float:
        return percentile(self.ttft, 50)

    @property
    def p99(self) -> float:
        return percentile(self.ttft, 99)


ALONE = "vLLM alone"


def setup_name(encoders: int) -> str:
    return f"EPD, {encoders} encoder{'s' if encoders != 1 else ''}"


# ---- what a stream says ------------------------------------------------------
def first_token(line: str) -> bool:
    """Whether one line of a chat completion stream carries a generated token."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return False
    try:
        event = json.loads(line.removeprefix("data: "))
    except ValueError:
        return False
    if not isinstance(event, dict):
        return False
    if "error" in event:
        raise RuntimeError(f"the stream failed: {event['error']}")
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or choice.get("token_ids") or delta.get("token_ids"):
            return True
    return False


async def ttft(http: httpx.AsyncClient, url: str, body: bytes) -> float:
    """Seconds from sending ``body`` to ``url``'s chat route to its first token."""
    started = trio.current_time()
    first: float | None = None
    async with http.stream("POST", f"{url}/v1/chat/completions", content=body,
                           headers={"content-type": "application/json"}) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {answer.status_code}: {(await answer.aread())[:500]!r}")
        async for line in answer.aiter_lines():  # read to the end: the connection is reused
            if first is None and first_token(line):
                first = trio.current_time() - started
    if first is None:
        raise RuntimeError(f"{url}: the stream carried no token")
    return first


# ---- the table -----------------------------------------------------------------
def rows(cells: Sequence[Cell]) -> list[tuple[str, ...]]:
    """Per image count, vLLM alone first, then each EPD setup with its ratios to it."""
    table = []
    alone = {c.images: c for c in cells if c.setup == ALONE}
    for cell in cells:
        base = alone.get(cell.images)
        ratios = ("", "") if cell.setup == ALONE or base is None else \
            (f"{cell.p50 / base.p50:.2f}", f"{cell.p99 / base.p99:.2f}")
        table.append((str(cell.images), cell.setup, str(len(cell.ttft)), f"{cell.p50 * 1e3:.0f}",
                      f"{cell.p99 * 1e3:.0f}", *ratios))
    return table


HEADER = ("images", "setup", "n", "TTFT p50 ms", "TTFT p99 ms", "p50 / alone", "p99 / alone")


def report(cells: Sequence[Cell], args: argparse.Namespace) -> None:
    title = (f"TTFT, streamed chat requests: {args.image_size} px images, {args.max_tokens} tokens, "
             f"concurrency {args.concurrency}")
    note = "ratios below 1: EPD's first token came sooner than vLLM alone's with the same images"
    print(f"\n{title} ({load()})")
    print_table(HEADER, rows(cells))
    print(note)
    bench_results.record(title, HEADER, rows(cells), note)


# ---- requests ---------------------------------------------------------------------
def new_image(size: int, rng: np.random.Generator) -> str:
    """A PNG of random pixels no cache has seen, as a data URI."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat_body(model: str, images: int, args: argparse.Namespace, rng: np.random.Generator) -> bytes:
    parts = [{"type": "image_url", "image_url": {"url": new_image(args.image_size, rng)}}
             for _ in range(images)]
    return json.dumps({"model": model, "stream": True, "temperature": 0, "ignore_eos": True,
                       "max_tokens": args.max_tokens, "return_token_ids": True,
                       "messages": [{"role": "user", "content": [
                           *parts, {"type": "text", "text": "describe the images"}]}]}).encode()


async def measure(targets: dict[str, str], model: str, args: argparse.Namespace) -> list[Cell]:
    """Every setup and image count, the setups taking turns round by round."""
    rng = np.random.default_rng(args.seed)
    cells = []
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT, limits=limits) as http:
        for images in args.images:
            seen: dict[str, list[float]] = {name: [] for name in targets}
            for round_ in range(args.warmup + args.requests):
                for name, url in targets.items():
                    bodies = [chat_body(model, images, args, rng) for _ in range(args.concurrency)]
                    times: list[float] = []

                    async def one(body: bytes, url: str = url, times: list[float] = times) -> None:
                        times.append(await ttft(http, url, body))

                    async with trio.open_nursery() as nursery:
                        for body in bodies:
                            nursery.start_soon(one, body)
                    if round_ >= args.warmup:
                        seen[name].extend(times)
                print(f"  {images} images: round {round_ + 1}/{args.warmup + args.requests}", flush=True)
            cells.extend(Cell(images, name, tuple(seen[name])) for name in targets)
    return cells


# ---- the servers --------------------------------------------------------------------
def _wait_listening(proc: subprocess.Popen[str], what: str) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the command prints one line once it serves
    if "listening on http://" not in line:
        raise RuntimeError(f"{what} did not start (exit {proc.poll()}): {line!r}")
    return line.rsplit(" ", 1)[1].strip()


@contextmanager
def epd_trio(args: list[str], log: Path, what: str) -> Iterator[str]:
    """``epd-trio ARGS`` until the block ends → the URL it listens on."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EPD_LOG_LEVEL": "WARNING"}
    with log.open("wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "epd_trio.cli", *args], stdout=subprocess.PIPE,
                                stderr=err, text=True, env=env)
    try:
        yield _wait_listening(proc, what)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def model_path(args: argparse.Namespace, tmp: Path) -> str:
    if args.model_path:
        return args.model_path
    from epd_trio.model.tiny import make_tiny_model, servable_spec

    spec = servable_spec(seed=args.seed, vision_depth=args.vision_depth, vision_hidden=args.vision_hidden)
    return str(make_tiny_model(tmp / "tiny-qwen2_5_vl", spec))


def run(args: argparse.Namespace) -> list[Cell]:
    from vllm_harness import VllmEnv, vllm_consumer, vllm_dir

    env = VllmEnv(vllm_dir())
    if not env.python.exists():
        raise SystemExit(f"no vLLM environment in {env.path}: run `bash tools/vllm_env.sh` "
                         "(or set EPD_VLLM_DIR)")
    with tempfile.TemporaryDirectory(prefix="bench-epd-") as tmp_dir, ExitStack() as stack:
        tmp = Path(tmp_dir)
        model = model_path(args, tmp)
        storage = tmp / "ec"
        storage.mkdir()
        print(f"model {model}; vLLM from {env.path}; logs in {tmp}", flush=True)
        vllm = stack.enter_context(vllm_consumer(env, model, storage, tmp / "vllm.log",
                                                 args=("--max-model-len", str(args.max_model_len),
                                                       "--max-num-seqs", str(max(4, args.concurrency)))))
        ec = json.dumps({"ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
                         "ec_connector_extra_config": {"shared_storage_path": str(storage)}})
        encoders = [stack.enter_context(epd_trio([
            "encoder", "--port", "0", "--api", "vllm", "--model-path", model, "--dtype", "float32",
            "--ec-transfer-config", ec, "--cpu-threads", str(args.encoder_cpu_threads)],
            tmp / f"encoder{k}.log", f"encoder {k}")) for k in range(max(args.encoders))]
        targets = {ALONE: vllm.url}
        for count in args.encoders:
            targets[setup_name(count)] = stack.enter_context(epd_trio([
                "proxy", "--port", "0", "--encoder-urls", ",".join(encoders[:count]),
                "--prefill-decode-urls", vllm.url], tmp / f"proxy{count}.log", f"proxy over {count}"))
        print(f"measuring {', '.join(targets)}", flush=True)
        return trio.run(measure, targets, model, args)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a short run: 1 and 4 images, 1 and 2 encoders, 3 requests, 224 px")
    p.add_argument("--images", type=int, nargs="+", default=None,
                   help="images per request, one table block each (default 1 4 8)")
    p.add_argument("--encoders", type=int, nargs="+", default=None,
                   help="epd_trio encoder counts behind the proxy (default 1 2 4)")
    p.add_argument("--requests", type=int, default=None, help="measured requests per cell "
                   "(default 20)")
    p.add_argument("--warmup", type=int, default=1, help="rounds not measured (default 1)")
    p.add_argument("--concurrency", type=int, default=1, help="requests at once per turn (default 1)")
    p.add_argument("--image-size", type=int, default=None, help="image side in pixels (default 448)")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request")
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="vLLM's --max-model-len (the tiny model's limit; 8 images of 448 px take 2048)")
    p.add_argument("--model-path", help="a Qwen2.5-VL checkpoint (default: a generated tiny one)")
    p.add_argument("--vision-depth", type=int, default=2, help="the tiny model's vision layers")
    p.add_argument("--vision-hidden", type=int, default=64, help="the tiny model's vision width")
    p.add_argument("--encoder-cpu-threads", type=int, default=0,
                   help="each encoder's --cpu-threads (0: its default)")
    p.add_argument("--seed", type=int, default=0)
    bench_results.add_argument(p)
    args = p.parse_args(argv)
    quick = {"images": [1, 4], "encoders": [1, 2], "requests": 3, "image_size": 224}
    full = {"images": [1, 4, 8], "encoders": [1, 2, 4], "requests": 20, "image_size": 448}
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if min(args.images) < 1 or min(args.encoders) < 1 or args.requests < 1 or args.concurrency < 1:
        p.error("--images, --encoders, --requests and --concurrency must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    with bench_results.recording("bench_epd", args.results, argv):
        report(run(args), args)


if __name__ == "__main__":
    main()
