"""Which encoder encodes which items: a pure plan (no trio, no clock, no I/O).

A client request's items are split per modality into *parts*, one ``/encode``
each. Each modality is spread evenly over the encoders with the fewest
outstanding parts, counting the parts this plan has already placed, so one
request's modalities land on different encoders when they can. Parts are
numbered modality-major (images, then videos, then audio) and, within a
modality, in encoder-list order over contiguous item ranges — so putting the
parts' embeddings end to end in ``part_idx`` order gives the items in their
original order.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from epd_trio.errors import RequestError
from epd_trio.protocol.messages import MODALITIES

__all__ = ["Part", "least_loaded", "pick_fallback", "plan_parts", "split_evenly"]


@dataclass(frozen=True)
class Part:
    """One ``/encode`` call: items ``item_indices`` of ``modality`` on ``encoder_url``."""

    part_idx: int
    modality: str
    encoder_url: str
    item_indices: tuple[int, ...]


def split_evenly(count: int, ways: int) -> list[range]:
    """``count`` indices in ``ways`` contiguous runs; the first runs get the extra one."""
    if count < 0 or ways < 1:
        raise ValueError(f"need count >= 0 and ways >= 1, got {count}, {ways}")
    base, extra = divmod(count, ways)
    runs, start = [], 0
    for i in range(ways):
        stop = start + base + (1 if i < extra else 0)
        runs.append(range(start, stop))
        start = stop
    return runs


def least_loaded(
    encoders: Sequence[str], outstanding: Mapping[str, int], k: int,
    exclude: Collection[str] = (),
) -> list[str]:
    """The ``k`` encoders with the fewest outstanding parts (ties: list order), in list order."""
    ranked = sorted(
        (outstanding.get(url, 0), i) for i, url in enumerate(encoders) if url not in exclude)
    return [encoders[i] for i in sorted(i for _, i in ranked[:k])]


def pick_fallback(
    encoders: Sequence[str], outstanding: Mapping[str, int], tried: Collection[str]
) -> str | None:
    """Where to retry a part whose encoder could not be reached; None when all were tried."""
    choice = least_loaded(encoders, outstanding, 1, exclude=tried)
    return choice[0] if choice else None


def plan_parts(
    item_counts: Mapping[str, int],
    encoders: Sequence[str],
    outstanding: Mapping[str, int] | None = None,
) -> list[Part]:
    """The parts of one request, numbered modality-major; see the module docstring.

    ``item_counts`` maps a modality to its number of items (0 = absent);
    ``outstanding`` is each encoder's parts in flight before this request.
    """
    if not encoders:
        raise ValueError("no encoders to plan over")
    if len(set(encoders)) != len(encoders):
        raise ValueError("encoder URLs must be unique")
    if unknown := set(item_counts) - set(MODALITIES):
        raise RequestError(f"unknown modality {sorted(unknown)}; use {', '.join(MODALITIES)}")
    load = {url: (outstanding or {}).get(url, 0) for url in encoders}
    parts: list[Part] = []
    for modality in MODALITIES:
        count = item_counts.get(modality, 0)
        if count < 0:
            raise ValueError(f"{modality}: negative item count {count}")
        if count == 0:
            continue
        chosen = least_loaded(encoders, load, min(count, len(encoders)))
        for url, run in zip(chosen, split_evenly(count, len(chosen))):
            parts.append(Part(len(parts), modality, url, tuple(run)))
            load[url] += 1
    if not parts:
        raise RequestError("a request needs at least one item")
    return parts
