"""The demo the README runs: encode sample images and print what happened."""

from __future__ import annotations

import io
import time
from typing import Any

import trio

from epd_trio.config import EngineConfig
from epd_trio.engine import open_engine

__all__ = ["run_engine_demo", "sample_images"]

SAMPLE_SIZES = ((224, 224), (640, 360), (300, 800), (28, 28), (1024, 768))


def sample_images(sizes: tuple[tuple[int, int], ...] = SAMPLE_SIZES) -> list[bytes]:
    """Deterministic PNG images (gradients and stripes), so the demo needs no assets."""
    import numpy as np
    from PIL import Image

    images = []
    for i, (w, h) in enumerate(sizes):
        y, x = np.mgrid[0:h, 0:w]
        rgb = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)),
                        ((x // 16 + y // 16 + i) % 2) * 255], axis=-1).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, format="PNG")
        images.append(buf.getvalue())
    return images


def _table(rows: list[dict[str, Any]]) -> str:
    heads = list(rows[0])
    widths = [max(len(h), *(len(str(r[h])) for r in rows)) for h in heads]
    line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(heads), line("-" * w for w in widths), *(line(r.values()) for r in rows)])


async def run_engine_demo(config: EngineConfig) -> str:
    """Encode the sample images concurrently through one engine; return the report."""
    images = sample_images()
    rows: list[dict[str, Any]] = [{}] * len(images)
    async with open_engine(config) as engine:
        info = engine.model_info

        async def one(i: int) -> None:
            started = time.perf_counter()
            out = await engine.encode([images[i]], "image")
            w, h = SAMPLE_SIZES[i]
            rows[i] = {"image": f"{w}x{h}", "grid_thw": "x".join(map(str, out.grid_thw[0])),
                       "tokens": out.token_counts[0],
                       "embedding": "x".join(map(str, out.embedding.shape)),
                       "ms": f"{(time.perf_counter() - started) * 1000:.1f}"}

        async with trio.open_nursery() as nursery:
            for i in range(len(images)):
                nursery.start_soon(one, i)
        stats = engine.statistics()
    title = (f"model {info.model_type} ({'RANDOM tiny weights' if info.random_weights else 'checkpoint'}), "
             f"dim {info.dim}, {info.dtype} on {info.device}: {stats.requests_done} requests in "
             f"{stats.batches_run} batches")
    return f"{title}\n{_table(rows)}"
