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
items it has seen (``cache.py``): the request's plan (``plan.py``) says which
items skip preprocessing and the forward; the others go through the same path
as every request, and the plan puts the answer back together in item order.

Seams: the engine awaits its collaborators through small interfaces (the
media source, ``preprocess_step``, the admission gate; each scheduler's
``forward``), so tests wrap them (``epd_trio.testing``) rather than the engine
branching on a fault plan.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import trio

from epd_trio.config import EngineConfig
from epd_trio.engine.cache import CacheStatistics, EmbeddingCache, content_digest
from epd_trio.engine.cpu import StageCpu
from epd_trio.engine.plan import CachePlan, EncodeAll, EncodeOutput, EncodePlan, given_names
from epd_trio.engine.preprocess_pool import PoolSpec, PreprocessPool, open_preprocess_pool
from epd_trio.engine.threads import available_cores, thread_budget, with_torch_threads
from epd_trio.errors import ModelLoadError, RequestError
from epd_trio.model.adapters import PreprocessResult
from epd_trio.model.loader import LoadedEncoder, load_encoders
from epd_trio.model.media import MediaLimits, MediaLoader, media_http_client
from epd_trio.model.preprocess import EncoderPreprocessor, preprocess_device
from epd_trio.model.tiny import ensure_default_model
from epd_trio.scheduling.batch_cap import BatchCapSettings
from epd_trio.scheduling.dispatch import Admission, Dispatcher, WorkerState
from epd_trio.scheduling.lane import open_thread_lane
from epd_trio.scheduling.policy import BatchPolicy
from epd_trio.scheduling.scheduler import Observer, RunSync, Scheduler
from epd_trio.scheduling.worker import EncoderWorker, NullForwardWorker

__all__ = [
    "AdmissionGate", "EncodeOutput", "Engine", "EngineStatistics", "MediaSource", "ModelInfo",
    "PreprocessStep", "open_engine",
]

log = logging.getLogger(__name__)

MODALITIES = ("image", "video", "audio")

# Hashing a request's items for the cache (~1 GB/s) moves to a thread above this many bytes.
_HASH_IN_THREAD_BYTES = 1 << 20


class MediaSource(Protocol):
    """Where items' bytes come from (``MediaLoader``: URLs, files, inline data)."""

    async def load(self, items: Sequence[Any]) -> list[Any]: ...


class AdmissionGate(Protocol):
    """The shared admission bound, as the engine enters it (``Admission``)."""

    @property
    def admitted(self) -> int:
        """Requests inside the bound now."""

    def enter(self, *, bypass: bool = False) -> AbstractAsyncContextManager[None]: ...


# Preprocess loaded items (the places they have in the request, None: all of them, in order).
PreprocessStep = Callable[[Sequence[Any], str, Sequence[int] | None], Awaitable[PreprocessResult]]


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
    # The adaptive cap per device (one entry per worker): modality → most tokens per forward.
    batch_token_caps: tuple[dict[str, int], ...] = ()


def normalize_modality(modality: str) -> str:
    if not isinstance(modality, str) or modality.lower() not in MODALITIES:
        raise RequestError(f"unknown modality {modality!r}; expected one of {', '.join(MODALITIES)}")
    return modality.lower()


class Engine:
    """Encodes media; build it with ``open_engine``.

    ``workers`` and ``schedulers`` hold one per device (``worker`` and
    ``scheduler`` are the first device's); ``admission`` is their shared bound.
    ``media``, ``preprocess_step`` and ``admission`` are the seams a test may
    wrap (``epd_trio.testing.engine_faults``).
    """

    def __init__(self, config: EngineConfig, encoder: LoadedEncoder, media: MediaLoader,
                 replicas: Sequence[LoadedEncoder] = ()) -> None:
        self.config = config
        self.encoder = encoder
        self.media: MediaSource = media
        self.preprocessor = EncoderPreprocessor(
            encoder.adapter, encoder.processors, media.limits, video_fps=config.video_fps,
            video_min_frames=config.video_min_frames, video_max_frames=config.video_max_frames,
            device=config.preprocess_device)
        policy = BatchPolicy(config.max_batch_size, config.max_batch_tokens, config.coalesce_delay)
        admission = Admission(config.max_pending)
        self.admission: AdmissionGate = admission
        # Told of stages and batches (metrics, profiler); shared with every scheduler.
        self.observers: list[Observer] = []
        # CPU seconds of the stages run in threads, each measured in its own thread.
        self.cpu = StageCpu()
        self.thread_budget = thread_budget(config.devices, available_cores(),
                                           cpu_threads=config.cpu_threads,
                                           preprocess_threads=config.preprocess_threads)
        worker_class = NullForwardWorker if config.null_forward else EncoderWorker
        self.workers = tuple(worker_class(e, compile=config.compile, threads=self.thread_budget.forward)
                             for e in (encoder, *replicas))
        learning = BatchCapSettings() if config.adaptive_batch else None
        self.schedulers = tuple(
            Scheduler(self.cpu.timed("forward", w.forward), policy, max_pending=config.max_pending, admission=admission,
                      index=i, observers=self.observers, batch_learning=learning)
            for i, w in enumerate(self.workers))
        self.dispatcher = Dispatcher(self.workers, self.schedulers)
        self.cache = EmbeddingCache(config.cache_mb << 20) if config.cache_mb else None
        self._fingerprint = "|".join(map(str, (
            encoder.family, encoder.model_dir.resolve(), encoder.dtype, config.video_fps,
            config.video_min_frames, config.video_max_frames)))
        self._preprocessing = 0
        # How blocking work reaches a thread (open_engine gives its preprocessing thread lane);
        # epd_trio.testing can run it inline so that MockClock tests stay deterministic.
        self.run_sync: RunSync = functools.partial(
            trio.to_thread.run_sync, limiter=trio.CapacityLimiter(config.preprocess_workers))
        self.preprocess_step: PreprocessStep = self._preprocess_in_thread
        # --preprocess-mode process: open_engine sets the pool and routes preprocess_step to it.
        self.preprocess_pool: PreprocessPool | None = None

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
        async with self.admission.enter(bypass=bypass_admission):
            started = trio.current_time()
            modality = self._check_modality(modality)
            plan = await self._plan(items, modality, hashes, use_cache=use_cache)
            pre = embedding = None
            if plan.needs_forward:
                loaded = plan.loaded if plan.loaded is not None else await self._load(items)
                chosen, indices = plan.select(loaded)
                pre = await self._process(chosen, modality, indices)
                self._observe_stage("preprocess", trio.current_time() - started)
            if on_preprocessed is not None:
                on_preprocessed(plan.describe(pre))
            if pre is not None:
                embedding = await self.dispatcher.submit(pre)
            return plan.finish(pre, embedding)

    def _check_modality(self, modality: str) -> str:
        modality = normalize_modality(modality)
        self.encoder.adapter.check_modality(modality)
        return modality

    async def _load(self, items: Sequence[Any]) -> list[Any]:
        self._preprocessing += 1
        try:
            return await self.media.load(items)
        finally:
            self._preprocessing -= 1

    async def _process(self, loaded: Sequence[Any], modality: str,
                       indices: Sequence[int] | None = None) -> PreprocessResult:
        self._preprocessing += 1
        try:
            return await self.preprocess_step(loaded, modality, indices)
        finally:
            self._preprocessing -= 1

    async def _preprocess_in_thread(self, loaded: Sequence[Any], modality: str,
                                    indices: Sequence[int] | None) -> PreprocessResult:
        return await self.run_sync(self.cpu.timed("preprocess", with_torch_threads),
                                   self.thread_budget.preprocess, self.preprocessor.preprocess,
                                   loaded, modality, indices)

    # ---- the plan: which items need a forward (the embedding cache) -------
    async def _plan(self, items: Sequence[Any], modality: str, hashes: Sequence[str] | None, *,
                    use_cache: bool) -> EncodePlan:
        """Without a cache, encode everything; with one, look every item up first."""
        if self.cache is None or not use_cache:
            return EncodeAll()
        given = given_names(items, hashes)
        loaded: list[Any] | None = None
        digests: list[bytes | None] = [None] * len(items)
        if any(g is None for g in given):  # content keys need the bytes
            loaded = await self._load(items)
            digests = await self._digests(loaded, given)
        # else every item is named: a full hit never loads anything
        return CachePlan.look_up(self.cache, self._fingerprint, modality, given, digests, loaded)

    async def _digests(self, loaded: Sequence[Any], given: Sequence[str | None]) -> list[bytes | None]:
        def digests() -> list[bytes | None]:
            return [content_digest(item) if g is None else None for item, g in zip(loaded, given)]

        size = sum(len(item) for item in loaded if isinstance(item, bytes))
        if size < _HASH_IN_THREAD_BYTES and all(isinstance(item, bytes) for item in loaded):
            return digests()
        return await self.run_sync(digests)

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
            batch_token_caps=tuple(s.batch_token_caps for s in stats),
        )

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<Engine {self.encoder.family} on {self.config.device}: {s.admitted} admitted, "
                f"{s.queued} queued, {s.requests_done} done, {s.batches_run} batches, "
                f"{s.workers_alive}/{s.workers} workers alive>")


async def resolve_model_path(config: EngineConfig) -> Path:
    if config.model_path:
        return Path(config.model_path)
    cache_dir = config.resolved_cache_dir()
    try:
        return await trio.to_thread.run_sync(ensure_default_model, cache_dir)
    except OSError as exc:  # a start-up error that names the flag, not a traceback
        raise ModelLoadError(f"cannot generate the embedded tiny model in {str(cache_dir)!r} "
                             f"(--cache-dir): {exc.strerror or exc}") from None


@asynccontextmanager
async def open_engine(config: EngineConfig | None = None, **overrides: Any) -> AsyncIterator[Engine]:
    """Load the encoder (once per device) and run its schedulers for the duration of the block.

    ``open_engine(model_path=..., device="cpu", max_batch_size=8)`` is the same
    as passing ``EngineConfig(...)``; keyword overrides win over ``config``.
    """
    config = dataclasses.replace(config or EngineConfig(), **overrides)
    preprocess_device(config.preprocess_device)  # refused before minutes of loading
    model_dir = await resolve_model_path(config)
    # Each further device gets its own copy of the module (and so its own compile cache).
    encoder, *replicas = await load_encoders(model_dir, config.devices, config.dtype)
    limits = MediaLimits(
        max_item_bytes=config.max_item_bytes, max_image_pixels=config.max_image_pixels,
        fetch_timeout=config.fetch_timeout, max_request_pixels=config.max_request_pixels,
        fetch_allow_hosts=tuple(h.lower().rstrip(".") for h in config.fetch_allow_hosts),
        fetch_deny_private=config.fetch_deny_private, max_redirects=config.max_redirects,
        media_root=Path(config.media_root) if config.media_root else None,
        max_video_seconds=config.max_video_seconds, max_video_frames=config.max_video_frames,
        max_video_pixels=config.max_video_pixels, max_audio_seconds=config.max_audio_seconds,
    )
    async with (media_http_client() as http, _preprocess_pool(config, encoder, limits) as pool,
                AsyncExitStack() as lanes, trio.open_nursery() as nursery):
        engine = Engine(config, encoder, MediaLoader(limits, http), replicas)
        await _give_thread_lanes(engine, lanes)
        if pool is not None:
            engine.preprocess_pool = pool
            engine.preprocess_step = pool.preprocess
        log.info("engine on %s, %s", config.device,
                 engine.thread_budget.describe(config.preprocess_workers))
        for scheduler in engine.schedulers:
            await nursery.start(scheduler.run)
        try:
            yield engine
        finally:
            nursery.cancel_scope.cancel()


async def _give_thread_lanes(engine: Engine, lanes: AsyncExitStack) -> None:
    """The engine's blocking work on threads of its own: ``preprocess_workers`` threads for
    preprocessing, one per device for its forwards (``scheduling.lane``: cheaper per call
    for the trio thread than ``trio.to_thread``). In process mode the children preprocess,
    and the lane only hashes large items for the cache: one thread."""
    threads = 1 if engine.config.preprocess_mode == "process" else engine.config.preprocess_workers
    preprocess = await lanes.enter_async_context(open_thread_lane("epd-preprocess", threads))
    engine.run_sync = preprocess.run_sync
    for scheduler in engine.schedulers:
        device = await lanes.enter_async_context(open_thread_lane(f"epd-device{scheduler.index}", 1))
        scheduler.run_sync = device.run_sync


@asynccontextmanager
async def _preprocess_pool(config: EngineConfig, encoder: LoadedEncoder,
                           limits: MediaLimits) -> AsyncIterator[PreprocessPool | None]:
    """``--preprocess-mode process``: the pool of preprocessing processes; else None (threads)."""
    if config.preprocess_mode != "process":
        yield None
        return
    spec = PoolSpec(str(encoder.model_dir), limits, video_fps=config.video_fps,
                    video_min_frames=config.video_min_frames, video_max_frames=config.video_max_frames,
                    torch_threads=config.preprocess_threads)
    async with open_preprocess_pool(spec, config.preprocess_workers) as pool:
        yield pool
