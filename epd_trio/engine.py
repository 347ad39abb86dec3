"""The in-process encoder engine: media → preprocessing → batched forward.

``open_engine`` loads the encoder (in a thread), owns the HTTP client that
fetches media URLs and runs the scheduler loop in its nursery; leaving the
block stops the loop and fails whatever still waits (nothing hangs).
``encode`` is a batch of one: concurrent callers are batched by the scheduler,
and there is no second code path for single requests.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import trio

from epd_trio.config import EngineConfig
from epd_trio.errors import RequestError
from epd_trio.model.adapters import PreprocessResult
from epd_trio.model.loader import LoadedEncoder, load_encoder
from epd_trio.model.media import MediaLimits, MediaLoader
from epd_trio.model.preprocess import EncoderPreprocessor
from epd_trio.model.tiny import ensure_default_model
from epd_trio.scheduling.policy import BatchPolicy
from epd_trio.scheduling.scheduler import RunSync, Scheduler
from epd_trio.scheduling.worker import EncoderWorker

if TYPE_CHECKING:
    from epd_trio.testing import FaultPlan

__all__ = ["EncodeOutput", "Engine", "EngineStatistics", "ModelInfo", "open_engine"]

log = logging.getLogger(__name__)

MODALITIES = ("image", "video", "audio")


@dataclass(frozen=True)
class EncodeOutput:
    """Embeddings of one request's items, concatenated in item order."""

    modality: str
    embedding: Any  # torch.Tensor [sum(token_counts), dim]
    token_counts: list[int]
    grid_thw: list[tuple[int, int, int]]
    # Per-item values the language side needs (each list has one entry per
    # item), e.g. ``second_per_grid_ts`` for Qwen2.5-VL videos; often empty.
    extras: dict[str, list[Any]] = dataclasses.field(default_factory=dict)

    def item(self, index: int) -> Any:
        """The rows of item ``index`` (a view, no copy)."""
        start = sum(self.token_counts[:index])
        return self.embedding[start:start + self.token_counts[index]]


@dataclass(frozen=True)
class ModelInfo:
    model_type: str
    modalities: tuple[str, ...]
    dim: int
    dtype: str
    device: str
    max_batch_size: int
    random_weights: bool
    # What one output row holds: named column blocks ``(name, width)`` in
    # order (Qwen3-VL: the embedding, then each deepstack level), and a line
    # saying so.
    embedding_layout: tuple[tuple[str, int], ...] = ()
    embedding_description: str = ""


@dataclass(frozen=True)
class EngineStatistics:
    admitted: int
    preprocessing: int
    queued: int
    running: int
    requests_done: int
    requests_failed: int
    requests_dropped: int
    batches_run: int
    batches_retried: int


def normalize_modality(modality: str) -> str:
    if not isinstance(modality, str) or modality.lower() not in MODALITIES:
        raise RequestError(f"unknown modality {modality!r}; expected one of {', '.join(MODALITIES)}")
    return modality.lower()


class Engine:
    """Encodes media; build it with ``open_engine``."""

    def __init__(self, config: EngineConfig, encoder: LoadedEncoder, media: MediaLoader) -> None:
        self.config = config
        self.encoder = encoder
        self.media = media
        self.worker = EncoderWorker(encoder)
        self.preprocessor = EncoderPreprocessor(
            encoder.adapter, encoder.processors, media.limits, video_fps=config.video_fps,
            video_min_frames=config.video_min_frames, video_max_frames=config.video_max_frames)
        self.scheduler = Scheduler(
            self.worker.forward,
            BatchPolicy(config.max_batch_size, config.max_batch_tokens, config.coalesce_delay),
            max_pending=config.max_pending,
        )
        self._preprocess_limiter = trio.CapacityLimiter(config.preprocess_workers)
        self._preprocessing = 0
        self.faults: FaultPlan | None = None  # epd_trio.testing installs one; never the network
        # How blocking work reaches a thread; epd_trio.testing can run it inline so
        # that MockClock tests stay deterministic.
        self.run_sync: RunSync = trio.to_thread.run_sync

    @property
    def model_info(self) -> ModelInfo:
        adapter = self.encoder.adapter
        return ModelInfo(
            model_type=adapter.family, modalities=tuple(sorted(adapter.modalities)),
            dim=adapter.embedding_dim, dtype=str(self.encoder.dtype).removeprefix("torch."),
            device=self.encoder.device, max_batch_size=self.config.max_batch_size,
            random_weights=self.encoder.random_weights,
            embedding_layout=tuple(adapter.embedding_layout),
            embedding_description=adapter.embedding_description,
        )

    async def encode(self, items: Sequence[Any], modality: str = "image", *,
                     bypass_admission: bool = False,
                     on_preprocessed: Callable[[PreprocessResult], None] | None = None) -> EncodeOutput:
        """Encode one request's items (all of one modality), batched with others.

        ``on_preprocessed`` is called once the output's size is known, before
        the forward (Mooncake receivers reserve memory that early).
        """
        if self.faults is not None:
            await self.faults.inject("admission")
        with self.scheduler.admit(bypass=bypass_admission):
            pre = await self.preprocess(items, modality)
            if on_preprocessed is not None:
                on_preprocessed(pre)
            embedding = await self.scheduler.submit(pre)
        return EncodeOutput(pre.modality, embedding, list(pre.token_counts), list(pre.grid_thw),
                            {key: list(values) for key, values in pre.extras.items()})

    async def preprocess(self, items: Sequence[Any], modality: str) -> PreprocessResult:
        """Fetch and preprocess; callers hold an admission slot (``scheduler.admit``)."""
        modality = normalize_modality(modality)
        self.encoder.adapter.check_modality(modality)
        self._preprocessing += 1
        try:
            if self.faults is not None:
                await self.faults.inject("media_load")
            loaded = await self.media.load(items)
            if self.faults is not None:
                await self.faults.inject("preprocess")
            return await self.run_sync(
                self.preprocessor.preprocess, loaded, modality, limiter=self._preprocess_limiter
            )
        finally:
            self._preprocessing -= 1

    def statistics(self) -> EngineStatistics:
        s = self.scheduler.statistics()
        return EngineStatistics(
            admitted=s.admitted, preprocessing=self._preprocessing, queued=s.queued,
            running=s.running, requests_done=s.requests_done, requests_failed=s.requests_failed,
            requests_dropped=s.requests_dropped, batches_run=s.batches_run,
            batches_retried=s.batches_retried,
        )

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<Engine {self.encoder.family} on {self.encoder.device}: {s.admitted} admitted, "
                f"{s.queued} queued, {s.requests_done} done, {s.batches_run} batches>")


async def resolve_model_path(config: EngineConfig) -> Path:
    if config.model_path:
        return Path(config.model_path)
    return await trio.to_thread.run_sync(ensure_default_model, config.resolved_cache_dir())


@asynccontextmanager
async def open_engine(config: EngineConfig | None = None, **overrides: Any) -> AsyncIterator[Engine]:
    """Load the encoder and run its scheduler for the duration of the block.

    ``open_engine(model_path=..., device="cpu", max_batch_size=8)`` is the same
    as passing ``EngineConfig(...)``; keyword overrides win over ``config``.
    """
    config = dataclasses.replace(config or EngineConfig(), **overrides)
    model_dir = await resolve_model_path(config)
    encoder = await trio.to_thread.run_sync(
        lambda: load_encoder(model_dir, device=config.device, dtype=config.dtype)
    )
    limits = MediaLimits(
        max_item_bytes=config.max_item_bytes, max_image_pixels=config.max_image_pixels,
        fetch_timeout=config.fetch_timeout,
        media_root=Path(config.media_root) if config.media_root else None,
        max_video_seconds=config.max_video_seconds, max_video_frames=config.max_video_frames,
        max_video_pixels=config.max_video_pixels, max_audio_seconds=config.max_audio_seconds,
    )
    # Redirects are not followed: a URL is fetched from where it says.
    async with httpx.AsyncClient(follow_redirects=False) as http, trio.open_nursery() as nursery:
        engine = Engine(config, encoder, MediaLoader(limits, http))
        await nursery.start(engine.scheduler.run)
        try:
            yield engine
        finally:
            nursery.cancel_scope.cancel()
