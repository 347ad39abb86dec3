"""The batching policy: a pure function of the queue and the time.

No trio and no clock here: the scheduler loop passes ``now`` in, so the policy
is tested with plain tables and the loop with ``MockClock``.

Rules (DESIGN §4): take the oldest request; then, in arrival order, up to
``max_batch_size - 1`` more of the same modality while the tokens stay within
``max_batch_tokens`` (the oldest is always taken, even alone over budget, so a
large request cannot starve). Modalities in ``solo_modalities`` (video: its
processor arguments differ per request) always run alone. With a
``coalesce_delay``, a batch that is not full waits until its oldest request has
been queued that long, to gather more company; a batch is full when the count
is reached or another request the size of the oldest would not fit its tokens.

``token_caps`` (modality → tokens) lowers the token budget of a modality's
batches below ``max_batch_tokens``: that is where the adaptive cap
(``batch_cap``), learned per device and modality, applies. Being a token
budget, it keeps the budget's guarantees: the oldest request always runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Batch", "BatchPolicy", "QueuedRequest", "Wait", "next_batch"]


@dataclass(frozen=True)
class QueuedRequest:
    """What the policy needs to know of a queued request."""

    key: int
    modality: str
    tokens: int
    enqueued_at: float


@dataclass(frozen=True)
class BatchPolicy:
    max_batch_size: int = 8
    max_batch_tokens: int = 65536
    coalesce_delay: float = 0.0
    solo_modalities: frozenset[str] = field(default_factory=lambda: frozenset({"video"}))

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_batch_tokens < 1 or self.coalesce_delay < 0:
            raise ValueError(f"invalid batch policy {self}")


@dataclass(frozen=True)
class Batch:
    """Requests to run in one forward, in the order their outputs are split."""

    keys: tuple[int, ...]
    modality: str
    tokens: int


@dataclass(frozen=True)
class Wait:
    """Nothing to run before ``until`` (unless more requests arrive)."""

    until: float


def next_batch(
    queue: Sequence[QueuedRequest], now: float, policy: BatchPolicy,
    token_caps: Mapping[str, int] | None = None,
) -> Batch | Wait | None:
    """Decide what to run next; ``None`` when the queue is empty."""
    if not queue:
        return None
    oldest = queue[0]
    budget = policy.max_batch_tokens
    if token_caps and oldest.modality in token_caps:
        budget = min(budget, token_caps[oldest.modality])
    chosen, tokens = [oldest.key], oldest.tokens
    if oldest.modality not in policy.solo_modalities:
        for req in queue[1:]:
            if len(chosen) == policy.max_batch_size:
                break
            if req.modality == oldest.modality and tokens + req.tokens <= budget:
                chosen.append(req.key)
                tokens += req.tokens
    full = (len(chosen) == policy.max_batch_size or oldest.modality in policy.solo_modalities
            or tokens + oldest.tokens > budget)
    ready_at = oldest.enqueued_at + policy.coalesce_delay
    if not full and now < ready_at:
        return Wait(until=ready_at)
    return Batch(keys=tuple(chosen), modality=oldest.modality, tokens=tokens)
