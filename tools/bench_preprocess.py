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

Also: decode alone, PIL against torchvision (ms per image). Each point is the
median of ``--repeat`` runs; the load average is printed before and after,
because on a shared machine the other tenants move the numbers.

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python tools/bench_preprocess.py --quick      # ~2 min, 2 cores
    HF_HUB_OFFLINE=1 .venv/bin/python tools/bench_preprocess.py --workers 1 2 4 8 16 --device cuda
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import trio  # noqa: E402
from PIL import Image  # noqa: E402

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


async def rate(step: Callable[[list[Any]], Awaitable[Any]], images: Sequence[bytes],
               concurrency: int) -> float:
    """Images per second: ``concurrency`` callers take the images one by one."""
    queue = iter(images)

    async def caller() -> None:
        for image in queue:
            await step([image])

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(caller)
    return len(images) / (time.perf_counter() - started)


async def measure(step: Callable[[list[Any]], Awaitable[Any]], images: Sequence[bytes],
                  workers: int, repeat: int) -> float:
    await rate(step, images[: 2 * workers], 2 * workers)  # warm-up
    return statistics.median([await rate(step, images, 2 * workers) for _ in range(repeat)])


def decode_ms(images: Sequence[bytes]) -> tuple[float, float]:
    import torch
    from torchvision.io import ImageReadMode, decode_image

    def pil(data: bytes) -> object:
        return Image.open(io.BytesIO(data)).convert("RGB")

    def tv(data: bytes) -> object:
        return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)

    times = []
    for fn in (pil, tv):
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            for data in images:
                fn(data)
            runs.append((time.perf_counter() - t0) / len(images) * 1e3)
        times.append(statistics.median(runs))
    return times[0], times[1]


async def main(args: argparse.Namespace) -> None:
    import torch

    from epd_trio.engine.preprocess_pool import PoolSpec, open_preprocess_pool
    from epd_trio.model.loader import load_encoder
    from epd_trio.model.media import MediaLimits
    from epd_trio.model.preprocess import EncoderPreprocessor
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

    results: dict[tuple[str, str, int, int], float] = {}
    modes = ["thread", "process"] + ([f"device:{args.device}"] if args.device else [])
    for mode in modes:
        for workers in args.workers:
            async def run_all(step: Callable[[list[Any]], Awaitable[Any]]) -> None:
                for fmt, size in cases:
                    results[(mode, fmt, size, workers)] = await measure(
                        step, images[(fmt, size)], workers, args.repeat)

            if mode == "process":
                async with open_preprocess_pool(PoolSpec(model, limits), workers) as pool:
                    await run_all(lambda items, p=pool: p.preprocess(items, "image"))
            else:
                device = mode.split(":", 1)[1] if mode.startswith("device:") else None
                pre = EncoderPreprocessor(encoder.adapter, encoder.processors, limits, device=device)
                limiter = trio.CapacityLimiter(workers)
                await run_all(lambda items, pre=pre, lim=limiter: trio.to_thread.run_sync(
                    pre.preprocess, items, "image", None, limiter=lim))
            print(f"  done: {mode} x {workers}", flush=True)

    first = args.workers[0]
    head = " ".join(f"{m[:7]}x{w:<3}" for m in modes for w in args.workers)
    scale = " ".join(f"{m[:7]}/{first}" for m in modes)
    print(f"\nimages/s (load average after {os.getloadavg()[0]:.2f})")
    print(f"{'case':<11} {head}  scaling({args.workers[-1]} vs {first} workers): {scale}   "
          f"decode ms PIL / torchvision")
    for fmt, size in cases:
        row = " ".join(f"{results[(m, fmt, size, w)]:>10.1f}" for m in modes for w in args.workers)
        ratios = " ".join(f"{results[(m, fmt, size, args.workers[-1])] / results[(m, fmt, size, first)]:>9.2f}"
                          for m in modes)
        pil, tv = decode_ms(images[(fmt, size)][:8])
        print(f"{fmt:<5}{size:>5}  {row}  {'':>10}{ratios}   {pil:6.2f} / {tv:6.2f}")


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="~2 min on 2 cores: 24 images per point")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--sizes", type=int, nargs="+", default=[224, 448, 1024])
    parser.add_argument("--images", type=int, default=48, help="images per point (1024 px: a third)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default=None, help="also the --preprocess-device path, e.g. cuda")
    parser.add_argument("--model-path", default=None, help="default: the embedded tiny model")
    args = parser.parse_args(argv)
    if args.quick:
        args.images = min(args.images, 24)
    return args


if __name__ == "__main__":
    trio.run(main, parse())
