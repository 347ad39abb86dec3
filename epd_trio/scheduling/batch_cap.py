"""The adaptive batch cap: how much work per forward pays on this device, learned as it runs.

Pure like ``policy`` (no trio, no clock): the scheduler reports each forward's
requests, tokens and seconds; ``limit`` answers with the most tokens the next
forward may hold, which the policy applies as a token budget.

**Keyed by tokens, not by requests.** What a device delivers is a function of
the work in one forward — rows through the tower — not of how many requests
carry it: eight 64-token images cost about what two 256-token ones do.
Estimates are therefore kept per *token bucket* (the powers of two: a forward
of 300 tokens counts in the 512 bucket) and compared as tokens per second, so
they stay comparable when item sizes mix (a table keyed by request count would
set a batch of small images against one large image), and a health probe's tiny
forward lands in a bucket of its own instead of dragging down the estimate of a
real batch size. The cap then lands in the policy's token budget, whose rule
already holds: the oldest request always runs, alone if it is over the cap, so
no request starves and the order of a modality's requests is what the budget
makes it.

**The cap.** Each forward's tokens per second is recorded in its bucket; the
last ``window`` are kept and a bucket's estimate is their median (one slow
forward — a page-fault storm, a neighbour's burst — does not move it). Among
buckets with at least ``min_samples``, the cap is the smallest whose estimate
is within ``tolerance`` of the best: past it, more tokens per forward add
latency, not throughput. Before anything is measured the cap is 0: every
request runs alone.

**Probing.** Larger forwards are measured only by running them. When the cap is
the largest bucket measured (throughput was still growing up to it), the
learner probes the next bucket up, twice the tokens: for up to
``probe_batches`` forwards the policy may fill forwards that far, and the
bucket's samples are taken afresh. It is kept if it pays. So the cap climbs one
doubling at a time from one request's tokens: on a CPU, where a larger batch
costs throughput, it stops after one probe; on a GPU it climbs until the device
saturates or the ceilings (``max_batch_size``, ``max_batch_tokens``) stop it.
A probe no forward reaches (too few requests queued) ends after those forwards
and is not retried until the next re-probe.

**Re-probing.** Every ``reprobe_every`` forwards the learner forgets all but the
cap's own bucket and measures its neighbours again: the bucket below (when
forwards have landed there before) and the one above, so a device that got
busier or freer, or a load that changed shape, is noticed. The cost is bounded:
while the cap holds, two probes of at most ``probe_batches`` forwards per
``reprobe_every``, each losing only its few forwards' difference; a probe that
wins moves the cap, and the next one starts from there.

A forward of several requests that runs out of device memory makes its bucket a
ceiling for the learner's life: the cap drops below it and is never probed there
again.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

__all__ = ["BatchCapLearner", "BatchCapSettings", "BatchCapStatistics", "token_bucket"]


@dataclass(frozen=True)
class BatchCapSettings:
    """How the learner weighs its measurements (the defaults suit CPUs and GPUs alike)."""

    tolerance: float = 0.05  # throughput within this share of the best counts as "no longer growing"
    window: int = 5  # recent forwards kept per bucket (their median is the estimate)
    min_samples: int = 3  # forwards before a bucket's estimate is trusted
    probe_batches: int = 8  # forwards a probe may take to measure its bucket
    reprobe_every: int = 64  # forwards between re-probes of the cap's neighbours

    def __post_init__(self) -> None:
        if not (0 <= self.tolerance < 1 and 1 <= self.min_samples <= self.window
                and self.probe_batches >= self.min_samples and self.reprobe_every >= 1):
            raise ValueError(f"invalid batch cap settings {self}")


@dataclass(frozen=True)
class BatchCapStatistics:
    cap_tokens: int  # the learned cap: most tokens in one forward (0: each request runs alone)
    probing: int | None  # the bucket being probed (forwards may hold that many tokens meanwhile)
    tokens_per_second: tuple[tuple[int, float], ...]  # (bucket, median) of each trusted bucket
    batch_size: float  # mean requests per forward over the last 16 forwards
    forwards: int  # forwards observed
    probes: int  # probes started
    reprobes: int  # times the neighbours' estimates were forgotten to be measured again
    ceiling: int | None  # a bucket that ran out of device memory (never probed again)


def token_bucket(tokens: int) -> int:
    """The smallest power of two holding ``tokens`` (a forward's estimates are kept there)."""
    return 1 << max(0, tokens - 1).bit_length()


class BatchCapLearner:
    """One device's, one modality's cap; ``max_tokens`` is the hard ceiling (``max_batch_tokens``)."""

    def __init__(self, max_tokens: int, settings: BatchCapSettings | None = None) -> None:
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        self.settings = settings or BatchCapSettings()
        self._top = token_bucket(max_tokens)  # no bucket above it can be filled
        self._max_tokens = max_tokens
        self._samples: dict[int, deque[float]] = {}
        self._reached: set[int] = set()  # buckets forwards have landed in
        self._unreachable: set[int] = set()  # probed, and no forward got there; until a re-probe
        self._cap = 0
        self._probe: int | None = None
        self._probe_left = 0
        self._ceiling: int | None = None
        self._since_reprobe = 0
        self._sizes: deque[int] = deque(maxlen=16)
        self._forwards = self._probes = self._reprobes = 0

    @property
    def limit(self) -> int:
        """Most tokens the next forward may hold: the probe's bucket while probing, else the cap."""
        return min(self._max_tokens, self._cap if self._probe is None else self._probe)

    def observe(self, size: int, tokens: int, seconds: float) -> None:
        """A forward of ``size`` requests and ``tokens`` output rows took ``seconds``."""
        if size < 1 or tokens < 1 or seconds <= 0:  # a clock that did not move says nothing
            return
        bucket = token_bucket(tokens)
        self._samples.setdefault(bucket, deque(maxlen=self.settings.window)).append(tokens / seconds)
        self._reached.add(bucket)
        self._sizes.append(size)
        self._forwards += 1
        if self._probe is not None:
            self._probe_left -= 1
            if not self._trusted(self._probe) and self._probe_left > 0:
                return
            self._end_probe()
        else:
            self._since_reprobe += 1
            if self._since_reprobe >= self.settings.reprobe_every:
                self._forget_neighbours()
        self._decide()

    def out_of_memory(self, tokens: int) -> None:
        """A forward of several requests and ``tokens`` rows ran out of device memory."""
        bucket = token_bucket(tokens)
        self._ceiling = bucket if self._ceiling is None else min(self._ceiling, bucket)
        for b in [b for b in self._samples if b >= self._ceiling]:
            del self._samples[b]
        if self._probe is not None and self._probe >= self._ceiling:
            self._end_probe()
        if self._cap >= self._ceiling:
            self._cap = self._ceiling // 2
        self._decide()

    def statistics(self) -> BatchCapStatistics:
        return BatchCapStatistics(
            cap_tokens=min(self._cap, self._max_tokens), probing=self._probe,
            tokens_per_second=tuple(sorted(self._estimates().items())),
            batch_size=sum(self._sizes) / len(self._sizes) if self._sizes else 0.0,
            forwards=self._forwards, probes=self._probes, reprobes=self._reprobes,
            ceiling=self._ceiling)

    def __repr__(self) -> str:
        probing = f", probing {self._probe}" if self._probe is not None else ""
        return f"<BatchCapLearner cap {self._cap} tokens{probing}, {self._forwards} forwards>"

    # ---- deciding -----------------------------------------------------------
    def _trusted(self, bucket: int) -> bool:
        return len(self._samples.get(bucket, ())) >= self.settings.min_samples

    def _estimates(self) -> dict[int, float]:
        """Medians of the trusted buckets under the ceiling (a lone request may still land above it)."""
        return {b: statistics.median(s) for b, s in self._samples.items()
                if self._trusted(b) and (self._ceiling is None or b < self._ceiling)}

    def _decide(self) -> None:
        """Settle the cap on what is measured; then start the probe that is due, if any."""
        estimates = self._estimates()
        if not estimates:
            return
        best = max(estimates.values())
        self._cap = min(b for b, v in estimates.items() if v >= (1 - self.settings.tolerance) * best)
        if self._probe is None:
            target = self._next_probe(estimates)
            if target is not None:
                self._start_probe(target)

    def _next_probe(self, estimates: dict[int, float]) -> int | None:
        """The bucket below the cap when it is due again, else the one above while still growing."""
        below, above = self._cap // 2, self._cap * 2
        if below in self._reached and below not in estimates and self._may_probe(below):
            return below
        if self._cap == max(estimates) and above <= self._top and self._may_probe(above):
            return above
        return None

    def _may_probe(self, bucket: int) -> bool:
        return bucket not in self._unreachable and (self._ceiling is None or bucket < self._ceiling)

    def _start_probe(self, bucket: int) -> None:
        self._samples.pop(bucket, None)  # measured afresh
        self._probe, self._probe_left = bucket, self.settings.probe_batches
        self._probes += 1

    def _end_probe(self) -> None:
        if self._probe is not None and not self._trusted(self._probe):
            self._unreachable.add(self._probe)
        self._probe = None
        self._since_reprobe = 0

    def _forget_neighbours(self) -> None:
        """Keep only the cap's own estimate, so the neighbours are measured again."""
        self._samples = {b: s for b, s in self._samples.items() if b == self._cap}
        self._unreachable.clear()
        self._since_reprobe = 0
        self._reprobes += 1
