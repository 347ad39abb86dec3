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


async def run_demo(engine_config: EngineConfig, encoders: int = 2, transfer_backend: str = "zmq") -> str:
    """A registry, encoders and a client in one trio program: discover, encode, check.

    The encoders register themselves with the registry; the client discovers
    them there, splits the sample images over them, gathers the parts over ZMQ
    and stitches them in one pool slot; the result is checked against a local
    engine encode of the same images.
    """
    from contextlib import AsyncExitStack

    from epd_trio.bootstrap.server import serve_bootstrap
    from epd_trio.client import open_encoder_client
    from epd_trio.config import BootstrapConfig, ClientConfig, EncoderConfig
    from epd_trio.encoder.server import serve_encoder

    images = sample_images()
    async with AsyncExitStack() as stack:
        registry = await stack.enter_async_context(serve_bootstrap(BootstrapConfig(port=0)))
        servers = [await stack.enter_async_context(serve_encoder(EncoderConfig(
            port=0, engine=engine_config, register_url=(registry.url,),
            transfer_backend=transfer_backend))) for _ in range(encoders)]
        await _until_registered(registry, encoders)
        local = await stack.enter_async_context(open_engine(engine_config))
        client = await stack.enter_async_context(open_encoder_client(
            ClientConfig(bootstrap_url=registry.url, transfer_backend=transfer_backend)))
        started = time.perf_counter()
        async with await client.encode({"image": images}) as result:
            total = time.perf_counter() - started
            expected = await local.encode(images, "image")
            stitched = result.embeddings["image"]
            err = ((stitched - expected.embedding).norm() / expected.embedding.norm()).item()
            ok = stitched.shape == expected.embedding.shape and err < 1e-4
            rows = _rows(result)
            info = local.model_info
            del stitched
    title = (f"registry + {len(servers)} encoders of {info.model_type} "
             f"({'RANDOM tiny weights' if info.random_weights else 'checkpoint'}), dim {info.dim}, "
             f"{info.dtype} on {info.device}; encoders discovered through the registry; "
             f"delivery over {'Mooncake (TCP)' if transfer_backend == 'mooncake' else 'ZMQ'}")
    summary = (f"total: {len(rows)} images, {sum(r['tokens'] for r in rows)} tokens in "
               f"{len(result.parts)} parts, {total * 1000:.1f} ms end to end; stitched result equals "
               f"a local engine encode: {'yes' if ok else 'NO'} (relative error {err:.1e})")
    if not ok:
        raise RuntimeError(summary)
    return f"{title}\n{_table(rows)}\n{summary}"


async def _until_registered(registry: Any, count: int, timeout: float = 30.0) -> None:
    """Registration runs in the encoders' background: wait until the registry lists them all."""
    import trio

    with trio.fail_after(timeout):
        while len(registry.registry.healthy_urls()) < count:  # noqa: ASYNC110 - no event says "count registered"
            await trio.sleep(0.01)


def _rows(result: Any) -> list[dict[str, Any]]:
    encoder_of = {i: p for p in result.parts for i in p.item_indices}
    return [{"item": i, "image": "x".join(map(str, SAMPLE_SIZES[i])),
             "encoder": encoder_of[i].encoder_url.removeprefix("http://"),
             "part": encoder_of[i].part_idx, "tokens": item.token_count,
             "grid_thw": "x".join(map(str, item.grid_thw or ())),
             "part ms": f"{encoder_of[i].seconds * 1000:.1f}"}
            for i, item in enumerate(result.items)]
