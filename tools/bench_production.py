"""Benchmark: the embedding cache (hit vs miss) and data parallel (1 vs 2 workers).

Kept apart from ``tools/bench_service.py`` (the service path against the
engine) so each runs in minutes on 2 cores; they share its report helpers and
``tools/bench_engine.py``'s random-weight checkpoints.

1. **Cache hit vs miss** (``--cache-mb``): N distinct images, each encoded
   twice in a row, sequentially, through the engine in process and through
   ``POST /encode`` (inline delivery) on a real server: the first time is a
   miss (fetch, preprocess, forward), the second a hit (a digest and a copy).
   Reports p50/p90 of both and their ratio.
2. **One worker vs two** (``device="cpu"`` vs ``"cpu,cpu"``, or
   ``cuda:0`` vs ``cuda:0,cuda:1`` / ``cuda:0,cuda:0``): C concurrent callers
   encode single images from a shared list through the engine; images/s per
   configuration, with the torch intra-op thread count given per row. On CPU
   the question is how to spend the cores: one forward using all of them, or
   two forwards with one thread each (on 2 cores, that is all there is to
   share; it reports what happened, it does not assert a win).

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python tools/bench_production.py --quick     # ~2-3 min, 2 cores
    HF_HUB_OFFLINE=1 .venv/bin/python tools/bench_production.py --device cuda --full-size

Random weights: timings are real, embeddings mean nothing. Benchmarks report;
they do not assert.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import bench_engine  # noqa: E402  (tools/: checkpoint builder and images)
import bench_results  # noqa: E402  (tools/: the results file the docs are built from)
from bench_service import load, percentile, print_table  # noqa: E402  (the same report helpers)


# ---- 1: cache hit vs miss ------------------------------------------------------
async def cache_latencies(model_dir: Path, items: list[bytes], args: argparse.Namespace) -> dict:
    import base64

    import httpx

    from epd_trio.config import EncoderConfig, EngineConfig
    from epd_trio.encoder.server import serve_encoder

    engine_config = EngineConfig(model_path=str(model_dir), device=args.device.split(",")[0],
                                 dtype=args.dtype, cache_mb=args.cache_mb)
    out: dict[str, list[float]] = {k: [] for k in ("engine miss", "engine hit", "http miss", "http hit")}
    async with serve_encoder(EncoderConfig(port=0, engine=engine_config)) as server, \
            httpx.AsyncClient(base_url=server.url, timeout=300) as http:
        engine = server.service.engine
        await engine.encode([bench_engine.make_images(1, [224], 999, "jpeg")[0]])  # warm-up
        for item in items:
            for kind in ("miss", "hit"):
                t0 = time.perf_counter()
                await engine.encode([item])
                out[f"engine {kind}"].append(time.perf_counter() - t0)
        # Other images for HTTP, so its misses are misses too.
        uris = ["data:image/jpeg;base64," + base64.b64encode(i).decode()
                for i in bench_engine.make_images(len(items), args.sizes, args.seed + 1, "jpeg")]
        for n, uri in enumerate(uris):
            for kind in ("miss", "hit"):
                t0 = time.perf_counter()
                r = await http.post("/encode", json={"req_id": f"{kind}{n}", "modality": "image",
                                                     "mm_items": [uri]})
                out[f"http {kind}"].append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text
        cache = engine.statistics().cache
    print(f"   cache after: {cache}")
    return out


def cache_part(args: argparse.Namespace, model_dir: Path) -> None:
    import trio

    items = bench_engine.make_images(args.cache_images, args.sizes, args.seed, "jpeg")
    print(f"\n== 1. cache hit vs miss: {args.cache_images} jpeg images, sides from {args.sizes}, "
          f"each encoded twice in a row, sequentially; device {args.device.split(',')[0]}; {load()}",
          flush=True)
    out = trio.run(cache_latencies, model_dir, items, args)
    rows = []
    for path in ("engine", "http"):
        miss, hit = out[f"{path} miss"], out[f"{path} hit"]
        rows.append((path, f"{percentile(miss, 50) * 1e3:.2f}", f"{percentile(miss, 90) * 1e3:.2f}",
                     f"{percentile(hit, 50) * 1e3:.3f}", f"{percentile(hit, 90) * 1e3:.3f}",
                     f"{statistics.median(miss) / statistics.median(hit):.0f}x"))
    header = ("path", "miss p50 ms", "miss p90 ms", "hit p50 ms", "hit p90 ms", "miss/hit p50")
    print()
    print_table(header, rows)
    bench_results.record("embedding cache: hit against miss, sequential requests", header, rows,
                         f"{args.cache_images} JPEG images, each encoded twice in a row")


# ---- 2: one worker vs two --------------------------------------------------------
async def closed_loop(model_dir: Path, items: list[bytes], device: str, args: argparse.Namespace
                      ) -> tuple[float, list[int], int]:
    import trio

    from epd_trio.engine import open_engine

    async with open_engine(model_path=str(model_dir), device=device, dtype=args.dtype,
                           max_batch_size=args.max_batch_size) as engine:
        warm = bench_engine.make_images(2 * len(engine.workers), [224], 999, "jpeg")
        async with trio.open_nursery() as nursery:  # every worker's first forward
            for item in warm:
                nursery.start_soon(engine.encode, [item])
        before = [w.forwards for w in engine.worker_states()]
        pending = iter(range(len(items)))

        async def caller() -> None:
            for i in pending:
                await engine.encode([items[i]])

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(args.concurrency):
                nursery.start_soon(caller)
        seconds = time.perf_counter() - t0
        forwards = [w.forwards - b for w, b in zip(engine.worker_states(), before)]
        return seconds, forwards, engine.statistics().requests_done


def worker_configs(args: argparse.Namespace) -> list[tuple[str, str, int | None]]:
    """(label, device, torch threads or None = leave as is)."""
    import torch

    cores = torch.get_num_threads()
    if args.device.startswith("cuda"):
        second = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
        return [("1 worker", "cuda:0", None), (f"2 workers ({second})", f"cuda:0,{second}", None)]
    return [(f"1 worker x {cores} threads", "cpu", cores), ("1 worker x 1 thread", "cpu", 1),
            ("2 workers x 1 thread", "cpu,cpu", 1), (f"2 workers x {cores} threads", "cpu,cpu", cores)]


def workers_part(args: argparse.Namespace, model_dir: Path) -> None:
    import torch
    import trio

    items = bench_engine.make_images(args.images, args.sizes, args.seed + 2, "jpeg")
    configs = worker_configs(args)
    print(f"\n== 2. one worker vs two: {args.images} jpeg images, sides from {args.sizes}, "
          f"C={args.concurrency}, max_batch_size {args.max_batch_size}, best of {args.repeat} "
          f"(configurations take turns); {load()}", flush=True)
    best: dict[str, tuple[float, list[int]]] = {}
    threads = torch.get_num_threads()
    for rep in range(args.repeat):
        for label, device, n in configs:
            torch.set_num_threads(n or threads)
            seconds, forwards, _ = trio.run(closed_loop, model_dir, items, device, args)
            print(f"   rep {rep}: {label}: {seconds:.2f}s, forwards per worker {forwards}; {load()}",
                  flush=True)
            if label not in best or seconds < best[label][0]:
                best[label] = (seconds, forwards)
    torch.set_num_threads(threads)
    base = best[configs[0][0]][0]
    rows = [(label, f"{args.images / s:.2f}", f"{base / s:.2f}", "/".join(map(str, f)))
            for label, (s, f) in best.items()]
    header = ("configuration", "img/s", f"vs {configs[0][0]}", "forwards per worker")
    print()
    print_table(header, rows)
    bench_results.record("one device worker against two", header, rows,
                         f"{args.images} JPEG images, C = {args.concurrency}, best of {args.repeat}")


# ---- main ---------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer images (minutes on 2 cores)")
    p.add_argument("--full-size", action="store_true",
                   help="Qwen2.5-VL-7B's vision tower (default: bench_engine's --quick one)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (part 2 compares 1 and 2 workers)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    p.add_argument("--parts", nargs="+", default=["cache", "workers"], choices=("cache", "workers"))
    p.add_argument("--cache-mb", type=int, default=512)
    p.add_argument("--cache-images", type=int, default=None, help="images for part 1")
    p.add_argument("--images", type=int, default=None, help="images per run in part 2")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-batch-size", type=int, default=4)
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument("--sizes", type=int, nargs="+", default=None)
    p.add_argument("--checkpoint-dir", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    bench_results.add_argument(p)
    args = p.parse_args(argv)
    args.cache_images = args.cache_images or (12 if args.quick else 32)
    args.images = args.images or (24 if args.quick else 64)
    args.repeat = args.repeat or (2 if args.quick else 3)
    args.sizes = args.sizes or list(range(224, 449, 56))
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    with bench_results.recording("bench_production", args.results, argv):
        measure_and_report(args)


def measure_and_report(args: argparse.Namespace) -> None:
    import torch

    spec = bench_engine.QWEN25_VL_7B if args.full_size else bench_engine.QUICK
    started = time.perf_counter()
    print(f"bench_production: {spec}\ntorch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"dtype {args.dtype}, device {args.device}; {load()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-production-") as tmp:
        model_dir = bench_engine.prepare_checkpoint(args, spec, tmp)
        if "cache" in args.parts:
            cache_part(args, model_dir)
        if "workers" in args.parts:
            workers_part(args, model_dir)
    print(f"\ndone in {time.perf_counter() - started:.0f}s; {load()}")


if __name__ == "__main__":
    main()
