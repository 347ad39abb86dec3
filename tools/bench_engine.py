"""Benchmark: the engine's image throughput against a bare transformers loop.

Builds, in a temporary directory, a random-weight bfloat16 checkpoint whose
vision tower has Qwen2.5-VL-7B's dimensions (``--quick``: a smaller one) and a
one-layer language model, so the checkpoint stays small. Then, for each
concurrency C, on the same seeded images:

* engine: C concurrent callers each ``encode`` single images from a shared
  list, ``max_batch_size`` = C (or ``--max-batch-size``). Its time includes
  preprocessing, which the engine overlaps with the forward in threads;
* bare: the same HF image processor and the vision module loaded by
  ``from_pretrained``, called the way ``get_image_features`` does
  (``visual(pixel_values, grid_thw=...)`` under ``inference_mode``), on
  consecutive images in groups of exactly the sizes the engine ran, in a
  worker thread as the engine's forwards are. Reported as forward-only and
  as preprocess + forward run one after the other;
* bare at fixed batch sizes: the same loop in batches of 1 and of the
  engine's ``max_batch_size``. The engine is held to the *best* of these
  (``engine/best bare``, target >= 0.95): on a CPU a batch of 8 can be
  slower per image than a batch of 1, and batching is the engine's choice.

The engine runs as an embedder gets it: default settings (the adaptive batch
cap on) but for the flags given, opened once per repetition, a one-image
warm-up, then two timed passes over the images: the first (``1st pass``)
includes what the cap learns, the second (``engine``, the one compared with
the bare loop on its batch sizes) runs with what it learned. ``cap tok`` is the
learned cap (most tokens per forward) after it. Beside them, an engine with
``adaptive_batch=False`` (``fixed``: batches fill to ``max_batch_size``, as
before the cap existed); ``--skip-fixed`` leaves it out.

The process is in an embedder's state too: glibc's malloc as it is by default.
``--malloc-tuned`` makes it keep freed memory (``epd_trio.engine.heap``, as
``epd-trio encoder`` applies it on a CPU device; process-wide, so both sides
run under it), which spares large batches faulting their activations' pages
in afresh.

The engine's outputs are checked against the bare loop's (``max rel diff``).
Per-run lines show the engine's batch pattern, how long its worker was busy in
forwards, and the share of the cores this process got: on a shared machine
that share, not the code, is often what moves the numbers.

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python tools/bench_engine.py --quick          # ~2 min, 2 cores
    HF_HUB_OFFLINE=1 .venv/bin/python tools/bench_engine.py                  # ~10-15 min, 2 cores
    # an embedder's case: open_engine(model_path=..., device="cpu", max_batch_size=8), the
    # mid-size (--quick) tower, 16 concurrent callers, 16 JPEG images of 448x448
    HF_HUB_OFFLINE=1 .venv/bin/python tools/bench_engine.py --quick --concurrency 16 \
        --max-batch-size 8 --images 16 --sizes 448

Random weights: timings are real, embeddings mean nothing.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import resource
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import bench_results  # noqa: E402  (tools/: the results file the docs are built from)


@dataclass(frozen=True)
class VisionSpec:
    """The vision tower's dimensions; the language model is always tiny."""

    name: str
    depth: int
    hidden: int
    heads: int
    intermediate: int
    out_hidden: int
    fullatt: tuple[int, ...]
    window_size: int = 112


QWEN25_VL_7B = VisionSpec("qwen2.5-vl-7b-vision", 32, 1280, 16, 3420, 3584, (7, 15, 23, 31))
QUICK = VisionSpec("quick", 8, 640, 8, 1280, 1024, (3, 7))


@dataclass(frozen=True)
class EngineRun:
    seconds: float
    cpu_seconds: float  # this process, all threads
    busy_seconds: float  # inside the worker's forward (collate + forward + copy out)
    requests: int
    batches: int
    batch_sizes: list[int]  # images per forward, in the order they ran
    outputs: list[Any] = field(repr=False)
    cap_tokens: int | None = None  # the adaptive cap after this pass (None: adaptation off)

    @property
    def avg_batch(self) -> float:
        return self.requests / self.batches


@dataclass(frozen=True)
class BareRun:
    batch_sizes: list[int]
    preprocess_seconds: float
    forward_seconds: float
    cpu_seconds: float
    outputs: list[Any] = field(repr=False)

    @property
    def seconds(self) -> float:
        return self.preprocess_seconds + self.forward_seconds


def cpu_time() -> float:
    """CPU seconds of this process, all threads: with wall time, shows starvation."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---- the checkpoint ---------------------------------------------------------
def _text_config(hidden: int) -> dict[str, Any]:
    """One layer, vocab 256: the language model exists only to make a full checkpoint."""
    heads = next(h for h in (28, 16, 8, 4, 2, 1) if hidden % h == 0 and (hidden // h) % 2 == 0)
    half = hidden // heads // 2
    # mrope_section (temporal, height, width) must sum to half the text head size.
    mrope = [half - 2 * (half // 3), half // 3, half // 3]
    return {
        "hidden_size": hidden, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": heads, "num_key_value_heads": 1, "vocab_size": 256,
        "max_position_embeddings": 4096, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": mrope},
    }


def _model_config(spec: VisionSpec) -> Any:
    import transformers

    vision = {
        "depth": spec.depth, "hidden_size": spec.hidden, "num_heads": spec.heads,
        "intermediate_size": spec.intermediate, "out_hidden_size": spec.out_hidden,
        "window_size": spec.window_size, "fullatt_block_indexes": list(spec.fullatt),
        "hidden_act": "silu", "patch_size": 14, "spatial_merge_size": 2,
        "temporal_patch_size": 2, "tokens_per_second": 2, "in_channels": 3,
    }
    special = {"image_token_id": 3, "video_token_id": 4, "vision_start_token_id": 5,
               "vision_end_token_id": 6}
    return transformers.Qwen2_5_VLConfig(text_config=_text_config(spec.out_hidden),
                                         vision_config=vision, **special)


def build_checkpoint(directory: Path, spec: VisionSpec, dtype: str, seed: int = 0) -> Path:
    """A random-weight checkpoint written with ``save_pretrained``, like a download."""
    import torch
    import transformers

    from epd_trio.model.tiny import TINY_MARKER

    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(
        _model_config(spec), dtype=getattr(torch, dtype))
    model.save_pretrained(directory)
    del model
    # Qwen2.5-VL's own preprocessor limits; our images are far below max_pixels.
    transformers.Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=12845056).save_pretrained(directory)
    (directory / f"{TINY_MARKER}.json").write_text(
        json.dumps({"warning": "random weights, benchmark only", "spec": asdict(spec)}))
    return directory


# ---- inputs -----------------------------------------------------------------
def make_images(count: int, sizes: Sequence[int], seed: int, fmt: str = "pil") -> list[Any]:
    """Seeded noise images; width and height each drawn from ``sizes``.

    ``pil``: decoded images (preprocessing is the processor only); ``png`` or
    ``jpeg``: encoded bytes, as a client sends them, so decoding is part of it.
    """
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    images = []
    for _ in range(count):
        w, h = (int(rng.choice(sizes)) for _ in range(2))
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")
        if fmt != "pil":
            buffer = io.BytesIO()
            image.save(buffer, format=fmt.upper(), quality=90)
            image = buffer.getvalue()
        images.append(image)
    return images


def decoded(item: Any) -> Any:
    """What the engine's ``decode_image`` does to an item, minus its checks."""
    from PIL import Image

    image = Image.open(io.BytesIO(item)) if isinstance(item, bytes) else item
    image.load()
    return image if image.mode == "RGB" else image.convert("RGB")


# ---- engine -----------------------------------------------------------------
def record_batch_sizes(engine: Any) -> list[int]:
    """Images in each forward the engine runs, read off the forward's ``grid_thw``.

    Statistics give only the count of batches; the bare loop replays the exact
    sequence (with coalesce_delay 0 it is typically 1, C-1, 1, C-1, ...), so the
    adapter instance's ``forward`` is wrapped. Benchmark instrumentation only.
    """
    sizes: list[int] = []
    adapter = engine.encoder.adapter
    inner = adapter.forward

    def forward(module: Any, inputs: dict[str, Any]) -> Any:
        sizes.append(int(inputs["grid_thw"].shape[0]))  # worker thread; append is atomic
        return inner(module, inputs)

    adapter.forward = forward
    return sizes


async def run_engine(model_dir: Path, images: list[Any], concurrency: int, max_batch: int,
                     args: argparse.Namespace, *, adaptive: bool = True, passes: int = 1
                     ) -> list[EngineRun]:
    """One engine, opened as an embedder opens it, and ``passes`` timed passes over ``images``."""
    from epd_trio.engine import open_engine

    overrides: dict[str, Any] = {"preprocess_workers": args.preprocess_workers} \
        if args.preprocess_workers else {}
    if args.torch_threads:  # the forward's threads, as the bare loop's
        overrides["cpu_threads"] = args.torch_threads
    if args.preprocess_threads:
        overrides["preprocess_threads"] = args.preprocess_threads
    if args.coalesce_delay:
        overrides["coalesce_delay"] = args.coalesce_delay
    if not adaptive:
        overrides["adaptive_batch"] = False
    async with open_engine(model_path=str(model_dir), device=args.device, dtype=args.dtype,
                           max_batch_size=max_batch, **overrides) as engine:
        sizes = record_batch_sizes(engine)
        await engine.encode([images[0]])  # warm-up
        return [await timed_pass(engine, images, concurrency, sizes) for _ in range(passes)]


async def timed_pass(engine: Any, images: list[Any], concurrency: int, sizes: list[int]) -> EngineRun:
    """``concurrency`` callers encode the images, one per call, from a shared list."""
    import trio

    sizes.clear()
    before, busy = engine.statistics(), engine.worker.statistics().busy_seconds
    pending = iter(range(len(images)))  # shared by all callers: one trio thread
    outputs: list[Any] = [None] * len(images)

    async def caller() -> None:
        for i in pending:
            outputs[i] = (await engine.encode([images[i]])).embedding

    started, cpu = time.perf_counter(), cpu_time()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(caller)
    seconds, cpu = time.perf_counter() - started, cpu_time() - cpu
    after = engine.statistics()
    busy = engine.worker.statistics().busy_seconds - busy
    caps = after.batch_token_caps[0] if engine.config.adaptive_batch else None
    return EngineRun(seconds, cpu, busy, after.requests_done - before.requests_done,
                     after.batches_run - before.batches_run, list(sizes), outputs,
                     cap_tokens=None if caps is None else caps.get("image", 0))


# ---- bare transformers ------------------------------------------------------
def load_bare(model_dir: Path, dtype: str, device: str = "cpu") -> tuple[Any, Any]:
    """The vision module and image processor, loaded the plain transformers way."""
    import torch
    import transformers

    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), local_files_only=True)
    processor = transformers.AutoImageProcessor.from_pretrained(model_dir, local_files_only=True)
    return model.model.visual.to(device).eval(), processor


def _bare_forward(visual: Any, processed: list[Any]) -> Any:
    import torch

    device = next(visual.parameters()).device
    pixel_values = torch.cat([p["pixel_values"] for p in processed]).to(device).type(visual.dtype)
    grid_thw = torch.cat([p["image_grid_thw"] for p in processed])
    embeds = visual(pixel_values, grid_thw=grid_thw.to(device)).pooler_output
    return embeds.cpu(), grid_thw  # on CUDA: waits for the device, as the engine's copy out does


def run_bare(visual: Any, processor: Any, images: list[Any], batch_sizes: list[int],
             torch_threads: int | None = None) -> BareRun:
    """Preprocess, then forward, consecutive groups of ``batch_sizes`` images in turn."""
    import torch

    if sum(batch_sizes) != len(images):
        raise ValueError(f"batch sizes {batch_sizes} do not add up to {len(images)} images")
    from epd_trio.engine.threads import available_cores

    # Explicit: a fresh thread starts with the last count set anywhere (the engine's jobs set theirs).
    torch.set_num_threads(torch_threads or available_cores())
    pre = fwd = 0.0
    cpu = cpu_time()
    outputs: list[Any] = []
    start = 0
    with torch.inference_mode():
        for size in batch_sizes:
            t0 = time.perf_counter()
            processed = [processor(images=[decoded(im)], return_tensors="pt")
                         for im in images[start:start + size]]
            start += size
            t1 = time.perf_counter()
            embeds, grid = _bare_forward(visual, processed)
            t2 = time.perf_counter()
            pre, fwd = pre + t1 - t0, fwd + t2 - t1
            merge = visual.spatial_merge_size ** 2
            outputs.extend(torch.split(embeds, (grid.prod(-1) // merge).tolist()))
    return BareRun(batch_sizes, pre, fwd, cpu_time() - cpu, outputs)


def in_worker_thread(fn: Any, *args: Any) -> Any:
    """Run ``fn`` in a fresh non-main thread, as the engine runs its forwards.

    On this 2-core box the same forwards measured ~8% faster off the main
    thread (interleaved, median of 8); running both sides off it keeps that
    out of the ratio. ``--bare-in-main-thread`` shows the other side.
    """
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="bare") as pool:
        return pool.submit(fn, *args).result()


def warm_bare(visual: Any, processor: Any, image: Any) -> None:
    import torch

    with torch.inference_mode():
        _bare_forward(visual, [processor(images=[decoded(image)], return_tensors="pt")])


def max_rel_diff(a: list[Any], b: list[Any]) -> float:
    """Largest |a-b| / max|b| over items (bf16 batches of other shapes differ a little).

    NaN when any output is not finite, so a broken comparison cannot read as 0.
    """
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        x, y = x.float(), y.float()
        if x.shape != y.shape or not (x.isfinite().all() and y.isfinite().all()):
            return math.nan
        worst = max(worst, float((x - y).abs().max() / y.abs().max().clamp_min(1e-12)))
    return worst


# ---- report -----------------------------------------------------------------
COLUMNS = ("config", "C", "max_bs", "cap tok", "avg_bs", "engine img/s", "bare fwd img/s",
           "bare pre+fwd img/s", "engine/bare(pre+fwd)", "engine/bare(fwd)",
           "bare bs1 img/s", "bare bsmax img/s", "engine/best bare", "1st pass/best bare",
           "fixed/best bare")


@dataclass(frozen=True)
class Measured:
    """One concurrency's kept runs (the fastest of each kind over the repetitions)."""

    first: EngineRun  # the engine's first pass: learning the cap
    engine: EngineRun  # its second pass, with what it learned
    bare: BareRun  # the bare loop on the second pass's batch sizes
    fixed_bare: dict[int, BareRun]  # the bare loop at batch 1 and at max_bs
    fixed_engine: EngineRun | None  # the engine with adaptive_batch=False; None: skipped


def table_row(config: str, c: int, max_bs: int, m: Measured, n: int) -> tuple:
    """The engine against the bare loop on its own batch sizes, then against the *best* of the
    bare loop at batch 1 and at ``max_bs`` (pre+fwd, in turn) — its first pass and the fixed
    ceiling too — not only against the batch sizes it happened to run."""
    e, b = m.engine, m.bare
    eng, fwd, both = n / e.seconds, n / b.forward_seconds, n / b.seconds
    one, top = n / m.fixed_bare[1].seconds, n / m.fixed_bare[max_bs].seconds
    best = max(one, top)
    fixed = f"{n / m.fixed_engine.seconds / best:.3f}" if m.fixed_engine is not None else "-"
    cap = "off" if e.cap_tokens is None else str(e.cap_tokens)
    return (config, c, max_bs, cap, f"{e.avg_batch:.2f}", f"{eng:.2f}", f"{fwd:.2f}", f"{both:.2f}",
            f"{eng / both:.3f}", f"{eng / fwd:.3f}", f"{one:.2f}", f"{top:.2f}",
            f"{eng / best:.3f}", f"{n / m.first.seconds / best:.3f}", fixed)


def fixed_batches(n: int, size: int) -> list[int]:
    """``n`` images in batches of ``size`` (the last one smaller when it does not divide)."""
    return [size] * (n // size) + ([n % size] if n % size else [])


def print_table(rows: list[tuple]) -> None:
    cells = [COLUMNS, *[tuple(str(x) for x in r) for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    for r in cells:
        print("  ".join(x.rjust(w) if i else x.ljust(w) for i, (x, w) in enumerate(zip(r, widths))))


def _runs(sizes: list[int]) -> str:
    """``[1, 7, 1, 7]`` → ``(1,7)x2``: the batch pattern at a glance."""
    for period in range(1, len(sizes) // 2 + 1):
        if len(sizes) % period == 0 and sizes == sizes[:period] * (len(sizes) // period):
            return f"({','.join(map(str, sizes[:period]))})x{len(sizes) // period}"
    return ",".join(map(str, sizes))


def cpu_share(cpu_seconds: float, seconds: float) -> float:
    """Fraction of all cores this process used: well under 1 means other load."""
    return cpu_seconds / seconds / (os.cpu_count() or 1)


def describe(c: int, rep: int, e: EngineRun, b: BareRun) -> str:
    first = "bare first" if rep % 2 else "engine first"
    return (f"C={c} rep {rep} ({first}): engine {e.seconds:.2f}s, batches {_runs(e.batch_sizes)}, "
            f"cap {e.cap_tokens} tokens, "
            f"forward busy {e.busy_seconds:.2f}s, cpu {cpu_share(e.cpu_seconds, e.seconds):.0%} | "
            f"bare {_runs(b.batch_sizes)} pre {b.preprocess_seconds:.2f}s fwd {b.forward_seconds:.2f}s, "
            f"cpu {cpu_share(b.cpu_seconds, b.seconds):.0%} | "
            f"max rel diff {max_rel_diff(e.outputs, b.outputs):.3g} | "
            f"load {os.getloadavg()[0]:.1f}")


# ---- main -------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small vision tower (minutes on 2 cores)")
    p.add_argument("--images", type=int, default=None,
                   help="images per measurement (default: 32)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 16])
    p.add_argument("--max-batch-size", type=int, default=None, help="default: C")
    p.add_argument("--repeat", type=int, default=None,
                   help="engine/bare pairs per C, best kept (default: 3 quick, 1 full)")
    p.add_argument("--format", default="jpeg", choices=("pil", "png", "jpeg"),
                   help="items as decoded PIL images or encoded bytes (decoding is preprocessing)")
    p.add_argument("--coalesce-delay", type=float, default=0.0,
                   help="EngineConfig.coalesce_delay in seconds (engine default 0)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    p.add_argument("--sizes", type=int, nargs="+", default=None,
                   help="side lengths to draw from (default: 224..448 step 56 quick, 448 full)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch threads of the bare loop and of the engine's forward "
                   "(EngineConfig.cpu_threads; default: the cores this process may use)")
    p.add_argument("--preprocess-threads", type=int, default=None,
                   help="EngineConfig.preprocess_threads (default: the engine's, 1)")
    p.add_argument("--preprocess-workers", type=int, default=None,
                   help="EngineConfig.preprocess_workers (default: the engine's)")
    p.add_argument("--bare-in-main-thread", action="store_true",
                   help="run the bare loop on the main thread (default: a worker thread, like the engine)")
    p.add_argument("--checkpoint-dir", type=Path, default=None,
                   help="build (or reuse) the checkpoint here instead of a temp dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="torch device of the engine and the bare loop "
                   "(cpu, cuda, cuda:1)")
    p.add_argument("--malloc-tuned", action="store_true",
                   help="on a CPU device, have malloc keep freed memory, for the engine and the "
                   "bare loop alike, as epd-trio encoder does (default: glibc's own, as in a "
                   "program that embeds the engine)")
    p.add_argument("--skip-fixed", action="store_true",
                   help="leave out the engine with adaptive_batch=False (the fixed/best bare column)")
    bench_results.add_argument(p)
    return p.parse_args(argv)


def prepare_checkpoint(args: argparse.Namespace, spec: VisionSpec, tmp: str) -> Path:
    from epd_trio.model.tiny import TINY_MARKER

    directory = args.checkpoint_dir or Path(tmp) / spec.name
    marker = directory / f"{TINY_MARKER}.json"
    wanted = json.loads(json.dumps(asdict(spec)))
    if marker.exists() and json.loads(marker.read_text()).get("spec") == wanted:
        print(f"reusing checkpoint {directory}")
        return directory
    t0 = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    build_checkpoint(directory, spec, args.dtype, args.seed)
    print(f"built checkpoint {directory} in {time.perf_counter() - t0:.1f}s")
    return directory


def measure(c: int, model_dir: Path, bare: tuple[Any, Any], images: list[Any],
            args: argparse.Namespace, repeat: int) -> Measured:
    """``repeat`` engine/bare pairs, bare loops at batch 1 and max, and the fixed-cap engine;
    the fastest of each kept.

    The bare loop batches as the engine's learned pass did (batch size is an
    outcome of the closed loop, not a knob). Pairs alternate their order
    against load drift: an odd pair runs the bare loop first, on the previous
    pair's batch sizes.
    """
    import functools

    import trio

    max_bs = args.max_batch_size or c
    firsts: list[EngineRun] = []
    fixed_engines: list[EngineRun] = []

    def engine() -> EngineRun:
        first, learned = trio.run(functools.partial(run_engine, passes=2), model_dir, images, c,
                                  max_bs, args)
        firsts.append(first)
        return learned

    def bare_run(sizes: list[int]) -> BareRun:
        if args.bare_in_main_thread:
            return run_bare(*bare, images, sizes, args.torch_threads)
        return in_worker_thread(run_bare, *bare, images, sizes, args.torch_threads)

    engines: list[EngineRun] = []
    bares: list[BareRun] = []
    fixed: dict[int, list[BareRun]] = {1: [], max_bs: []}
    for rep in range(repeat):
        if rep % 2:
            bares.append(bare_run(engines[-1].batch_sizes))
            engines.append(engine())
        else:
            engines.append(engine())
            bares.append(bare_run(engines[-1].batch_sizes))
        for size in fixed:  # the fixed-batch bare loops, between the pairs
            fixed[size].append(bare_run(fixed_batches(len(images), size)))
        if not args.skip_fixed:
            fixed_engines.extend(trio.run(functools.partial(run_engine, adaptive=False), model_dir,
                                          images, c, max_bs, args))
        print(describe(c, rep, engines[-1], bares[-1]) + f" | 1st pass {firsts[-1].seconds:.2f}s, "
              f"batches {_runs(firsts[-1].batch_sizes)} | bare fixed " + ", ".join(
                  f"bs{size} {runs[-1].seconds:.2f}s" for size, runs in fixed.items())
              + (f" | engine fixed {fixed_engines[-1].seconds:.2f}s" if fixed_engines else ""),
              flush=True)

    def fastest(runs: list[Any]) -> Any:
        return min(runs, key=lambda r: r.seconds)

    return Measured(fastest(firsts), fastest(engines), fastest(bares),
                    {size: fastest(runs) for size, runs in fixed.items()},
                    fastest(fixed_engines) if fixed_engines else None)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    with bench_results.recording("bench_engine", args.results, argv):
        measure_and_report(args)


def measure_and_report(args: argparse.Namespace) -> None:
    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    spec = QUICK if args.quick else QWEN25_VL_7B
    n = args.images or 32
    repeat = args.repeat or (3 if args.quick else 1)
    sizes = args.sizes or (list(range(224, 449, 56)) if args.quick else [448])
    images = make_images(n, sizes, args.seed, args.format)
    pixels = sum(im.width * im.height for im in map(decoded, images))
    print(f"{spec}\ntorch {torch.__version__}, threads={torch.get_num_threads()} "
          f"(interop {torch.get_num_interop_threads()}), dtype={args.dtype}, "
          f"device={args.device}, cpu_count={os.cpu_count()}, "
          f"preprocess_workers={args.preprocess_workers or 'default'}, "
          f"coalesce_delay={args.coalesce_delay}, "
          f"bare loop on {'the main' if args.bare_in_main_thread else 'a worker'} thread, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}\n"
          f"{n} {args.format} images, sides from {sizes}, {pixels / n / 1e3:.0f} kpx/image, best of {repeat}")
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        model_dir = prepare_checkpoint(args, spec, tmp)
        bare = load_bare(model_dir, args.dtype, args.device)
        print(f"processor {type(bare[1]).__name__}, attention {bare[0].config._attn_implementation}")
        if args.device.split(":")[0] == "cpu":  # process-wide: both sides run under it
            from epd_trio.engine.heap import keep_freed_memory

            kept = args.malloc_tuned and keep_freed_memory()
            print("malloc: " + ("keeps freed memory (epd_trio.engine.heap)" if kept
                                else "glibc's default, as in a program that embeds the engine"))
        warm_bare(*bare, images[0])
        in_worker_thread(warm_bare, *bare, images[0])
        rows, starved = [], False
        for c in args.concurrency:
            m = measure(c, model_dir, bare, images, args, repeat)
            rows.append(table_row(spec.name, c, args.max_batch_size or c, m, n))
            starved = starved or min(cpu_share(m.engine.cpu_seconds, m.engine.seconds),
                                     cpu_share(m.bare.cpu_seconds, m.bare.seconds)) < 0.8
    print()
    print_table(rows)
    note = f"{n} {args.format} images, {args.dtype}, device {args.device}, best of {repeat}"
    if starved:
        note += ("; a kept run used under 80% of the cores: other load on the machine; "
                 "treat the ratios as noisy (raise --repeat)")
        print("note: " + note.split("; ", 1)[1])
    bench_results.record("engine against the bare transformers loop (img/s)", COLUMNS, rows, note)


if __name__ == "__main__":
    main()
