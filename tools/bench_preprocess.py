"""Benchmark: preprocessing images/s against workers, threads side by side with processes.

What the engine runs before a request joins a batch (decode + the checkpoint's
image processor), nothing else: no forward, no HTTP. For each format (JPEG,
PNG) and size (224, 448, 1024 px square), ``2 × workers`` concurrent trio
callers each preprocess one image at a time from a shared list:

* thread: ``EncoderPreprocessor.preprocess`` in ``trio.to_thread`` under a
  ``CapacityLimiter(workers)`` (the engine's ``--preprocess-mode thread``);
* process: the same through ``PreprocessPool`` (``--preprocess-mode
  process``: spawned children, one torch thread each, tensors back through
  shared memory, copied out in the parent);
* with ``--device cuda``: also the thread path with the processor on the
  device (``--preprocess-device``), JPEG decoded there too.

Also: decode alone, PIL against torchvision (ms per image). A mode that fails
(say the device path on a broken driver) is dropped and named at the end, with
exit status 1; the other modes' tables are still printed. Every pool is
started first; then the configurations take turns, case by case, ``--repeat``
rounds, and each point is the median of its rounds, so a load that drifts hits
all of them alike. The load average is printed before and after: on a shared
machine the other tenants move the numbers.

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python tools/bench_preprocess.py --quick      # ~2 min, 2 cores
    HF_HUB_OFFLINE=1 .venv/bin/python tools/bench_preprocess.py --workers 1 2 4 8 16 --device cuda
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import numpy as np  # noqa: E402
import trio  # noqa: E402
from PIL import Image  # noqa: E402

import bench_results  # noqa: E402  (tools/: the results file the docs are built from)

FORMATS = ("JPEG", "PNG")


def make_images(fmt: str, size: int, count: int) -> list[bytes]:
    """Photo-like content (smooth gradients plus mild noise): JPEG/PNG sizes like real ones."""
    rng = np.random.default_rng(size)
    out = []
    for i in range(count):
        x = np.linspace(0, 255, size)[None, :, None]
        y = np.linspace(0, 255, size)[:, None, None]
        base = np.concatenate([x + 0 * y, y + 0 * x, (x + y + 40 * i) / 2 % 256], axis=2)
        noisy = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(noisy).save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        out.append(buf.getvalue())
    return out


def cpu_seconds() -> float:
    """CPU time of this process and its live children (the pool's), from /proc: load-independent."""
    tick = os.sysconf("SC_CLK_TCK")
    total, me = 0.0, str(os.getpid())
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if stat.parent.name == me or fields[1] == me:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


async def rate(step: Callable[[list[Any]], Awaitable[Any]], images: Sequence[bytes],
               concurrency: int) -> tuple[float, float]:
    """(images per second, CPU ms per image): ``concurrency`` callers take the images one by one."""
    queue = iter(images)

    async def caller() -> None:
        for image in queue:
            await step([image])

    cpu, started = cpu_seconds(), time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(caller)
    wall, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    return len(images) / wall, cpu / len(images) * 1e3


def decode_ms(images: Sequence[bytes]) -> tuple[float, float]:
    """ms per image: PIL's decode + convert("RGB") against ours (torchvision's operators)."""
    from epd_trio.model.image_decode import decode_image_tensor
    from epd_trio.model.media import MediaLimits, decode_image

    limits = MediaLimits()

    def pil(data: bytes) -> object:
        return decode_image(data, 0, limits)

    def tv(data: bytes) -> object:
        return decode_image_tensor(data, 0, limits)

    runs: dict[Any, list[float]] = {pil: [], tv: []}
    for _ in range(5):  # taking turns
        for fn, times in runs.items():
            t0 = time.perf_counter()
            for data in images:
                fn(data)
            times.append((time.perf_counter() - t0) / len(images) * 1e3)
    return statistics.median(runs[pil]), statistics.median(runs[tv])


async def main(args: argparse.Namespace) -> None:
    import torch

    from epd_trio.model.loader import load_encoder
    from epd_trio.model.media import MediaLimits
    from epd_trio.model.tiny import ensure_default_model

    model = args.model_path or str(ensure_default_model(Path(tempfile.gettempdir()) / "epd-bench-preprocess"))
    encoder = load_encoder(model, dtype="float32")
    limits = MediaLimits()
    counts = {224: args.images, 448: args.images, 1024: max(4, args.images // 3)}
    cases = [(fmt, size) for fmt in FORMATS for size in args.sizes]
    images = {(fmt, size): make_images(fmt, size, counts.get(size, args.images)) for fmt, size in cases}
    print(f"model {model}; torch threads {torch.get_num_threads()} (thread mode), 1 per child "
          f"(process mode); cpus {os.cpu_count()}; load average before {os.getloadavg()[0]:.2f}")
    print(f"images per point: {', '.join(f'{s}px {counts.get(s, args.images)}' for s in args.sizes)}; "
          f"median of {args.repeat}; concurrency 2 x workers", flush=True)

    modes = list(args.modes) + ([f"device:{args.device}"] if args.device else [])
    failed: dict[str, str] = {}  # mode -> why: one mode's failure must not lose the others' tables
    async with contextlib.AsyncExitStack() as stack:
        steps = {}
        for mode in modes:
            for workers in args.workers:
                if mode not in failed:
                    with record_failure(failed, mode):
                        steps[(mode, workers)] = await make_step(stack, mode, workers, model, encoder, limits)
        print(f"  pools started; load average {os.getloadavg()[0]:.2f}", flush=True)
        runs: dict[tuple[str, str, int, int], list[tuple[float, float]]] = {}
        for rep in range(args.repeat):  # configurations take turns, so drifting load hits all alike
            for (fmt, size), batch in images.items():
                for (mode, workers), step in steps.items():
                    if mode in failed:
                        continue
                    with record_failure(failed, mode):
                        if rep == 0:
                            await rate(step, batch[: 2 * workers], 2 * workers)  # warm-up
                        runs.setdefault((mode, fmt, size, workers), []).append(
                            await rate(step, batch, 2 * workers))
            print(f"  round {rep + 1}/{args.repeat} done", flush=True)
    kept = [m for m in modes if m not in failed]
    if kept:
        results = {key: statistics.median(r for r, _ in values) for key, values in runs.items()}
        cpu = {key: statistics.median(c for _, c in values) for key, values in runs.items()}
        report(results, kept, args.workers, cases, images)
        report_cpu(cpu, kept, args.workers, cases)
    for mode, why in failed.items():
        print(f"\nmode {mode} FAILED, left out of the tables: {why}")
    if failed:
        raise SystemExit(1)


@contextlib.contextmanager
def record_failure(failed: dict[str, str], mode: str) -> Iterator[None]:
    """An error in ``mode`` drops that mode (noted in ``failed``) instead of the whole run."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - a benchmark reports any failure and goes on
        while isinstance(exc, BaseExceptionGroup) and exc.exceptions:  # the callers' nursery's
            exc = exc.exceptions[0]
        failed[mode] = f"{type(exc).__name__}: {exc}"
        print(f"  mode {mode} failed: {failed[mode]}", flush=True)


async def make_step(stack: contextlib.AsyncExitStack, mode: str, workers: int, model: str,
                    encoder: Any, limits: Any) -> Callable[[list[Any]], Awaitable[Any]]:
    from epd_trio.engine.preprocess_pool import PoolSpec, open_preprocess_pool
    from epd_trio.model.preprocess import EncoderPreprocessor

    if mode == "process":
        pool = await stack.enter_async_context(open_preprocess_pool(PoolSpec(model, limits), workers))
        return lambda items: pool.preprocess(items, "image")
    device = mode.split(":", 1)[1] if mode.startswith("device:") else None
    pre = EncoderPreprocessor(encoder.adapter, encoder.processors, limits, device=device)
    limiter = trio.CapacityLimiter(workers)
    return lambda items: trio.to_thread.run_sync(pre.preprocess, items, "image", None, limiter=limiter)


def report(results: dict, modes: list[str], workers: list[int], cases: list, images: dict) -> None:
    first, last = workers[0], workers[-1]
    cols = [f"{m.split(':')[0]} x{w}" for m in modes for w in workers]
    ratio_cols = [f"{m.split(':')[0]} {last}/{first}" for m in modes]
    header = ["case", *cols, *ratio_cols, "decode ms PIL", "decode ms torchvision"]
    rows = []
    for fmt, size in cases:
        row = [f"{results[(m, fmt, size, w)]:.1f}" for m in modes for w in workers]
        ratios = [f"{results[(m, fmt, size, last)] / results[(m, fmt, size, first)]:.2f}" for m in modes]
        pil, tv = decode_ms(images[(fmt, size)][:8])
        rows.append([f"{fmt} {size}", *row, *ratios, f"{pil:.2f}", f"{tv:.2f}"])
    print(f"\nimages/s, median (load average after {os.getloadavg()[0]:.2f})")
    print_markdown(header, rows)
    bench_results.record("images/s, median", header, rows,
                         f"{2 * last} concurrent callers at x{last}; decode: one image alone")


def report_cpu(cpu: dict, modes: list[str], workers: list[int], cases: list) -> None:
    """CPU ms per image (this process + the pool's children): what the cores pay, whatever the load."""
    cols = [f"{m.split(':')[0]} x{w}" for m in modes for w in workers]
    header = ["case", *cols]
    rows = [[f"{fmt} {size}", *(f"{cpu[(m, fmt, size, w)]:.2f}" for m in modes for w in workers)]
            for fmt, size in cases]
    title = "CPU ms per image, median (encoder process + pool children; the trio caller included)"
    print(f"\n{title}")
    print_markdown(header, rows)
    bench_results.record(title, header, rows)


def print_markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|---" * len(header) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="~2 min on 2 cores: 24 images per point")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--sizes", type=int, nargs="+", default=[224, 448, 1024])
    parser.add_argument("--images", type=int, default=48, help="images per point (1024 px: a third)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=["thread", "process"], default=["thread", "process"],
                        help="the CPU paths to measure (default: both)")
    parser.add_argument("--device", default=None, help="also the --preprocess-device path, e.g. cuda")
    parser.add_argument("--model-path", default=None, help="default: the embedded tiny model")
    bench_results.add_argument(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.images = min(args.images, 24)
    return args


if __name__ == "__main__":
    _args = parse_args()
    with bench_results.recording("bench_preprocess", _args.results):
        trio.run(main, _args)
