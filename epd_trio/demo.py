"""The demo the README runs: encoders and a client in one program, and what happened."""

from __future__ import annotations

import io
import time
from typing import Any

from epd_trio.config import EngineConfig
from epd_trio.engine import open_engine

__all__ = ["run_demo", "sample_images"]

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


async def run_demo(engine_config: EngineConfig, encoders: int = 2) -> str:
    """Two (or more) encoders and a client in one trio program: encode, check, report.

    The client splits the sample images over the encoders, the parts come back
    over ZMQ and are stitched in one pool slot; the result is checked against
    a local engine encode of the same images.
    """
    from contextlib import AsyncExitStack

    from epd_trio.client import ClientConfig, open_encoder_client
    from epd_trio.config import EncoderConfig
    from epd_trio.encoder.server import serve_encoder

    images = sample_images()
    async with AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(
            serve_encoder(EncoderConfig(port=0, engine=engine_config))) for _ in range(encoders)]
        local = await stack.enter_async_context(open_engine(engine_config))
        client = await stack.enter_async_context(open_encoder_client(
            ClientConfig(encoder_urls=tuple(s.url for s in servers))))
        started = time.perf_counter()
        async with await client.encode({"image": images}) as result:
            total = time.perf_counter() - started
            expected = await local.encode(images, "image")
            stitched = result.embeddings["image"]
            err = ((stitched - expected.embedding).norm() / expected.embedding.norm()).item()
            ok = stitched.shape == expected.embedding.shape and err < 1e-4
            encoder_of = {i: p for p in result.parts for i in p.item_indices}
            rows = [{"item": i, "image": "x".join(map(str, SAMPLE_SIZES[i])),
                     "encoder": encoder_of[i].encoder_url.removeprefix("http://"),
                     "part": encoder_of[i].part_idx, "tokens": item.token_count,
                     "grid_thw": "x".join(map(str, item.grid_thw or ())),
                     "part ms": f"{encoder_of[i].seconds * 1000:.1f}"}
                    for i, item in enumerate(result.items)]
            info = local.model_info
            del stitched
    title = (f"{encoders} encoders of {info.model_type} "
             f"({'RANDOM tiny weights' if info.random_weights else 'checkpoint'}), dim {info.dim}, "
             f"{info.dtype} on {info.device}; delivery over ZMQ")
    total_tokens = sum(r["tokens"] for r in rows)
    summary = (f"total: {len(rows)} images, {total_tokens} tokens in {len(result.parts)} parts, "
               f"{total * 1000:.1f} ms end to end; stitched result equals a local engine encode: "
               f"{'yes' if ok else 'NO'} (relative error {err:.1e})")
    if not ok:
        raise RuntimeError(summary)
    return f"{title}\n{_table(rows)}\n{summary}"
