"""The in-process encoder engine: media → preprocessing → batched forward.

``open_engine`` loads the encoder (in a thread), owns the HTTP client that
fetches media URLs and runs one scheduler loop per device in its nursery;
leaving the block stops the loops and fails whatever still waits (nothing
hangs). ``encode`` is a batch of one: concurrent callers are batched by the
scheduler, and there is no second code path for single requests.

Data parallel: ``device="cuda:0,cuda:1"`` (or ``"cpu,cpu"``) loads the encoder
once per device; all devices share one admission bound, and each preprocessed
request goes to the live device with the fewest pending requests
(``scheduling.dispatch``). With ``cache_mb`` an ``EmbeddingCache`` answers
items it has seen (``epd_trio.cache``): a request's cached items skip
preprocessing and the forward, the others are encoded, and the answer is put
back together in item order.
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

from epd_trio.cache import (
    CacheEntry,
    CacheStatistics,
    EmbeddingCache,
    content_digest,
    given_names,
    item_key,
    item_parts,
    join_extras,
    join_rows,
    store_misses,
)
from epd_trio.config import EngineConfig
from epd_trio.errors import RequestError
from epd_trio.model.adapters import PreprocessResult
from epd_trio.model.loader import LoadedEncoder, load_encoders
from epd_trio.model.media import MediaLimits, MediaLoader
from epd_trio.model.preprocess import EncoderPreprocessor
from epd_trio.model.tiny import ensure_default_model
from epd_trio.scheduling.dispatch import Admission, Dispatcher, WorkerState
from epd_trio.scheduling.policy import BatchPolicy
from epd_trio.scheduling.scheduler import Observer, RunSync, Scheduler
from epd_trio.scheduling.worker import EncoderWorker

if TYPE_CHECKING:
    from epd_trio.testing import FaultPlan

__all__ = ["EncodeOutput", "Engine", "EngineStatistics", "ModelInfo", "open_engine"]

log = logging.getLogger(__name__)

MODALITIES = ("image", "video", "audio")

# Hashing a request's items for the cache (~1 GB/s) moves to a thread above this many bytes.
_HASH_IN_THREAD_BYTES = 1 << 20


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
    # Summed over the devices; ``workers_alive < workers`` once a device has failed.
    requests_redispatched: int = 0
    workers: int = 1
    workers_alive: int = 1
    cache: CacheStatistics | None = None  # None without ``cache_mb``


def normalize_modality(modality: str) -> str:
    if not isinstance(modality, str) or modality.lower() not in MODALITIES:
        raise RequestError(f"unknown modality {modality!r}; expected one of {', '.join(MODALITIES)}")
    return modality.lower()


def _output(pre: PreprocessResult, embedding: Any) -> EncodeOutput:
    return EncodeOutput(pre.modality, embedding, list(pre.token_counts), list(pre.grid_thw),
                        {key: list(values) for key, values in pre.extras.items()})


class Engine:
    """Encodes media; build it with ``open_engine``.

    ``workers`` and ``schedulers`` hold one per device (``worker`` and
    ``scheduler`` are the first device's); ``admission`` is their shared bound.
    """

    def __init__(self, config: EngineConfig, encoder: LoadedEncoder, media: MediaLoader,
                 replicas: Sequence[LoadedEncoder] = ()) -> None:
        self.config = config
        self.encoder = encoder
        self.media = media
        self.preprocessor = EncoderPreprocessor(
            encoder.adapter, encoder.processors, media.limits, video_fps=config.video_fps,
            video_min_frames=config.video_min_frames, video_max_frames=config.video_max_frames)
        policy = BatchPolicy(config.max_batch_size, config.max_batch_tokens, config.coalesce_delay)
        self.admission = Admission(config.max_pending)
        # Told of stages and batches (metrics, profiler); shared with every scheduler.
        self.observers: list[Observer] = []
        self.workers = tuple(EncoderWorker(e, compile=config.compile) for e in (encoder, *replicas))
        self.schedulers = tuple(
            Scheduler(w.forward, policy, max_pending=config.max_pending, admission=self.admission,
                      index=i, observers=self.observers)
            for i, w in enumerate(self.workers))
        self.dispatcher = Dispatcher(self.workers, self.schedulers)
        self.cache = EmbeddingCache(config.cache_mb << 20) if config.cache_mb else None
        self._fingerprint = "|".join(map(str, (
            encoder.family, encoder.model_dir.resolve(), encoder.dtype, config.video_fps,
            config.video_min_frames, config.video_max_frames)))
        self._preprocess_limiter = trio.CapacityLimiter(config.preprocess_workers)
        self._preprocessing = 0
        self.faults: FaultPlan | None = None  # epd_trio.testing installs one; never the network
        # How blocking work reaches a thread; epd_trio.testing can run it inline so
        # that MockClock tests stay deterministic.
        self.run_sync: RunSync = trio.to_thread.run_sync

    @property
    def worker(self) -> EncoderWorker:
        """The first device's worker."""
        return self.workers[0]

    @property
    def scheduler(self) -> Scheduler:
        """The first device's scheduler (its ``admit`` is the shared admission bound)."""
        return self.schedulers[0]

    @property
    def model_info(self) -> ModelInfo:
        adapter = self.encoder.adapter
        return ModelInfo(
            model_type=adapter.family, modalities=tuple(sorted(adapter.modalities)),
            dim=adapter.embedding_dim, dtype=str(self.encoder.dtype).removeprefix("torch."),
            device=self.config.device, max_batch_size=self.config.max_batch_size,
            random_weights=self.encoder.random_weights,
            embedding_layout=tuple(adapter.embedding_layout),
            embedding_description=adapter.embedding_description,
        )

    async def encode(self, items: Sequence[Any], modality: str = "image", *,
                     hashes: Sequence[str] | None = None, bypass_admission: bool = False,
                     use_cache: bool = True,
                     on_preprocessed: Callable[[PreprocessResult], None] | None = None) -> EncodeOutput:
        """Encode one request's items (all of one modality), batched with others.

        ``hashes`` (one per item) name the items for the cache; without them
        (or an item's ``content_hash``) the cache key is a digest of the
        item's bytes. ``use_cache=False`` (health probes) neither reads nor
        fills the cache. ``on_preprocessed`` is called once the output's size
        is known, before the forward (Mooncake receivers reserve memory that
        early); its ``inputs`` are only the items that need a forward.
        """
        if self.faults is not None:
            await self.faults.inject("admission")
        with self.admission.admit(bypass=bypass_admission):
            started = trio.current_time()
            if self.cache is not None and use_cache:
                return await self._encode_cached(self.cache, items, modality, hashes,
                                                 on_preprocessed, started)
            pre = await self.preprocess(items, modality)
            self._observe_stage("preprocess", trio.current_time() - started)
            if on_preprocessed is not None:
                on_preprocessed(pre)
            embedding = await self.dispatcher.submit(pre)
        return _output(pre, embedding)

    async def preprocess(self, items: Sequence[Any], modality: str) -> PreprocessResult:
        """Fetch and preprocess; callers hold an admission slot (``admission.admit``)."""
        modality = self._check_modality(modality)
        return await self._process(await self._load(items), modality)

    def _check_modality(self, modality: str) -> str:
        modality = normalize_modality(modality)
        self.encoder.adapter.check_modality(modality)
        return modality

    async def _load(self, items: Sequence[Any]) -> list[Any]:
        self._preprocessing += 1
        try:
            if self.faults is not None:
                await self.faults.inject("media_load")
            return await self.media.load(items)
        finally:
            self._preprocessing -= 1

    async def _process(self, loaded: Sequence[Any], modality: str,
                       indices: Sequence[int] | None = None) -> PreprocessResult:
        self._preprocessing += 1
        try:
            if self.faults is not None:
                await self.faults.inject("preprocess")
            return await self.run_sync(self.preprocessor.preprocess, loaded, modality, indices,
                                       limiter=self._preprocess_limiter)
        finally:
            self._preprocessing -= 1

    # ---- the embedding cache ----------------------------------------------
    async def _encode_cached(self, cache: EmbeddingCache, items: Sequence[Any], modality: str,
                             hashes: Sequence[str] | None,
                             on_preprocessed: Callable[[PreprocessResult], None] | None,
                             started: float) -> EncodeOutput:
        """Look every item up; encode only the misses; answer in item order."""
        modality = self._check_modality(modality)
        given = given_names(items, hashes)
        loaded: list[Any] | None = None
        if any(g is None for g in given):  # content keys need the bytes
            loaded = await self._load(items)
            digests = await self._digests(loaded, given)
        else:  # every item is named: a full hit never loads anything
            digests = [None] * len(items)
        keys = [item_key(self._fingerprint, modality, given=g) if g is not None
                else item_key(self._fingerprint, modality, digest=d) for g, d in zip(given, digests)]
        entries: list[CacheEntry | None] = [cache.get(key) for key in keys]
        misses = [i for i, entry in enumerate(entries) if entry is None]
        pre = None
        if misses:
            if loaded is None:
                loaded = await self._load(items)
            pre = await self._process([loaded[i] for i in misses], modality, misses)
            self._observe_stage("preprocess", trio.current_time() - started)
        if on_preprocessed is not None:
            on_preprocessed(_describe(modality, entries, pre))
        if pre is None:
            return _assemble(modality, entries, None, None)
        embedding = await self.dispatcher.submit(pre)
        store_misses(cache, keys, misses, pre, embedding)
        return _assemble(modality, entries, pre, embedding)

    async def _digests(self, loaded: Sequence[Any], given: Sequence[str | None]) -> list[bytes | None]:
        def digests() -> list[bytes | None]:
            return [content_digest(item) if g is None else None for item, g in zip(loaded, given)]

        size = sum(len(item) for item in loaded if isinstance(item, bytes))
        if size < _HASH_IN_THREAD_BYTES and all(isinstance(item, bytes) for item in loaded):
            return digests()
        return await self.run_sync(digests, limiter=self._preprocess_limiter)

    # ---- observability ------------------------------------------------------
    def _observe_stage(self, name: str, seconds: float) -> None:
        for observer in self.observers:
            try:
                observer.stage(name, seconds)
            except Exception:  # an observer's bug must not fail a request
                log.exception("observer %r failed", observer)

    def worker_states(self) -> list[WorkerState]:
        """Each device's worker: alive or dead (and why), its load and its work done."""
        return self.dispatcher.states()

    def statistics(self) -> EngineStatistics:
        stats = [s.statistics() for s in self.schedulers]
        return EngineStatistics(
            admitted=self.admission.admitted, preprocessing=self._preprocessing,
            queued=sum(s.queued for s in stats), running=sum(s.running for s in stats),
            requests_done=sum(s.requests_done for s in stats),
            requests_failed=sum(s.requests_failed for s in stats),
            requests_dropped=sum(s.requests_dropped for s in stats),
            batches_run=sum(s.batches_run for s in stats),
            batches_retried=sum(s.batches_retried for s in stats),
            requests_redispatched=sum(s.redispatched for s in stats),
            workers=len(stats), workers_alive=sum(not s.dead for s in stats),
            cache=self.cache.statistics() if self.cache is not None else None,
        )

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<Engine {self.encoder.family} on {self.config.device}: {s.admitted} admitted, "
                f"{s.queued} queued, {s.requests_done} done, {s.batches_run} batches, "
                f"{s.workers_alive}/{s.workers} workers alive>")


def _describe(modality: str, entries: Sequence[CacheEntry | None],
              pre: PreprocessResult | None) -> PreprocessResult:
    """The whole request's sizes (for ``on_preprocessed``), cached items included."""
    parts = item_parts(entries, pre)
    return PreprocessResult(modality, dict(pre.inputs) if pre is not None else {},
                            tuple(p.grid_thw for p in parts if p.grid_thw is not None),
                            tuple(p.token_count for p in parts), join_extras(parts))


def _assemble(modality: str, entries: Sequence[CacheEntry | None], pre: PreprocessResult | None,
              embedding: Any) -> EncodeOutput:
    parts = item_parts(entries, pre)
    return EncodeOutput(modality, join_rows(entries, pre, embedding), [p.token_count for p in parts],
                        [p.grid_thw for p in parts if p.grid_thw is not None], join_extras(parts))


async def resolve_model_path(config: EngineConfig) -> Path:
    if config.model_path:
        return Path(config.model_path)
    return await trio.to_thread.run_sync(ensure_default_model, config.resolved_cache_dir())


@asynccontextmanager
async def open_engine(config: EngineConfig | None = None, **overrides: Any) -> AsyncIterator[Engine]:
    """Load the encoder (once per device) and run its schedulers for the duration of the block.

    ``open_engine(model_path=..., device="cpu", max_batch_size=8)`` is the same
    as passing ``EngineConfig(...)``; keyword overrides win over ``config``.
    """
    config = dataclasses.replace(config or EngineConfig(), **overrides)
    model_dir = await resolve_model_path(config)
    # Each further device gets its own copy of the module (and so its own compile cache).
    encoder, *replicas = await load_encoders(model_dir, config.devices, config.dtype)
    limits = MediaLimits(
        max_item_bytes=config.max_item_bytes, max_image_pixels=config.max_image_pixels,
        fetch_timeout=config.fetch_timeout, max_request_pixels=config.max_request_pixels,
        fetch_allow_hosts=tuple(h.lower().rstrip(".") for h in config.fetch_allow_hosts),
        max_redirects=config.max_redirects,
        media_root=Path(config.media_root) if config.media_root else None,
        max_video_seconds=config.max_video_seconds, max_video_frames=config.max_video_frames,
        max_video_pixels=config.max_video_pixels, max_audio_seconds=config.max_audio_seconds,
    )
    # Redirects are not followed: a URL is fetched from where it says.
    async with httpx.AsyncClient(follow_redirects=False) as http, trio.open_nursery() as nursery:
        engine = Engine(config, encoder, MediaLoader(limits, http), replicas)
        for scheduler in engine.schedulers:
            await nursery.start(scheduler.run)
        try:
            yield engine
        finally:
            nursery.cancel_scope.cancel()
