"""Fault injection for the engine and its schedulers, by wrapping their seams.

An ``Engine`` gets its media source (``media_load``), its ``preprocess_step``
(``preprocess``) and its admission gate (``admission``) wrapped; a
``Scheduler`` gets its ``forward`` wrapped (``forward``, in the worker thread).
Each wrapper asks the plan at the same moment the request reaches that point,
so a seeded plan makes the same decisions in the same order. Installing again
replaces the plan; ``install(None, owner)`` puts the original seams back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from epd_trio.engine import Engine
from epd_trio.scheduling.scheduler import Scheduler

if TYPE_CHECKING:
    from epd_trio.engine.core import AdmissionGate, MediaSource, PreprocessStep
    from epd_trio.model.adapters import PreprocessResult
    from epd_trio.scheduling.scheduler import Forward
    from epd_trio.testing import FaultPlan

__all__ = ["install"]


class _FaultyMedia:
    """``media_load``: before the items are fetched."""

    def __init__(self, plan: FaultPlan, inner: MediaSource) -> None:
        self.plan, self.inner = plan, inner

    async def load(self, items: Sequence[Any]) -> list[Any]:
        await self.plan.inject("media_load")
        return await self.inner.load(items)

    def __getattr__(self, name: str) -> Any:  # everything else is the loader's own
        return getattr(self.inner, name)


class _FaultyPreprocess:
    """``preprocess``: in the trio thread, before the preprocessing thread starts."""

    def __init__(self, plan: FaultPlan, inner: PreprocessStep) -> None:
        self.plan, self.inner = plan, inner

    async def __call__(self, loaded: Sequence[Any], modality: str,
                       indices: Sequence[int] | None) -> PreprocessResult:
        await self.plan.inject("preprocess")
        return await self.inner(loaded, modality, indices)


class _FaultyAdmission:
    """``admission``: before the request asks for a slot (so a failure holds none)."""

    def __init__(self, plan: FaultPlan, inner: AdmissionGate) -> None:
        self.plan, self.inner = plan, inner

    @property
    def admitted(self) -> int:
        return self.inner.admitted

    @asynccontextmanager
    async def enter(self, *, bypass: bool = False) -> AsyncIterator[None]:
        await self.plan.inject("admission")
        async with self.inner.enter(bypass=bypass):
            yield

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _FaultyForward:
    """``forward``: in the device's worker thread, before the batch's forward."""

    def __init__(self, plan: FaultPlan, inner: Forward) -> None:
        self.plan, self.inner = plan, inner

    def __call__(self, payloads: Sequence[PreprocessResult]) -> list[Any]:
        self.plan.inject_sync("forward")
        return self.inner(payloads)


_WRAPPERS = (_FaultyMedia, _FaultyPreprocess, _FaultyAdmission, _FaultyForward)


def _unwrapped(seam: Any) -> Any:
    while isinstance(seam, _WRAPPERS):
        seam = seam.inner
    return seam


def install(plan: FaultPlan | None, owner: Any) -> bool:
    """Install ``plan`` on ``owner`` if it belongs to this part; False if it does not."""
    if isinstance(owner, Engine):
        media, step = _unwrapped(owner.media), _unwrapped(owner.preprocess_step)
        admission = _unwrapped(owner.admission)
        if plan is None:
            owner.media, owner.preprocess_step, owner.admission = media, step, admission
        else:
            owner.media = _FaultyMedia(plan, media)
            owner.preprocess_step = _FaultyPreprocess(plan, step)
            owner.admission = _FaultyAdmission(plan, admission)
        return True
    if isinstance(owner, Scheduler):
        forward = _unwrapped(owner.forward)
        owner.forward = forward if plan is None else _FaultyForward(plan, forward)
        return True
    return False
