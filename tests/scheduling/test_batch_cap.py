"""The adaptive batch cap (pure): simulated devices, exact traces of the batch sizes it allows."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from epd_trio.scheduling.batch_cap import (
    BatchCapLearner,
    BatchCapSettings,
    token_bucket,
)

Cost = Callable[[int, int], float]  # (requests, tokens) → seconds of one forward
ITEM = 256  # tokens of one 448×448 image (Qwen2.5-VL: 32 × 32 patches, merged 2 × 2)


def cpu(n: int, tokens: int) -> float:
    """As measured on a CPU: per image 0.2025 s alone, 0.251 s in a batch of 8 (a pair: -3.3%)."""
    return tokens / ITEM * 0.2025 * (1 + 0.0343 * (n - 1))


def gpu(n: int, tokens: int) -> float:
    """Fixed 20 ms until the device saturates at ~2000 tokens, then linear."""
    return max(0.02, tokens * 1e-5)


def slower_in_pairs(n: int, tokens: int) -> float:
    """A batch of two costs 20% more per token than one request alone."""
    return tokens * 1e-3 * (1.2 if n > 1 else 1.0)


def simulate(learner: BatchCapLearner, cost: Cost, forwards: int, *, item: int = ITEM,
             max_size: int = 16, depth: int = 1000) -> list[int]:
    """Requests per forward, as the policy forms them from ``depth`` queued requests of ``item`` tokens."""
    sizes = []
    for _ in range(forwards):
        n = max(1, min(max_size, depth, learner.limit // item))
        learner.observe(n, n * item, cost(n, n * item))
        sizes.append(n)
    return sizes


def learner(max_tokens: int = 65536, **settings: float) -> BatchCapLearner:
    return BatchCapLearner(max_tokens, BatchCapSettings(**settings))  # type: ignore[arg-type]


CLIMBS = [
    # (name, cost, max_size, depth, first forwards, settled size, cap tokens)
    ("cpu: one probe of pairs, then each request alone", cpu, 8, 1000,
     [1, 1, 1, 2, 2, 2, 1, 1], 1, 256),
    ("gpu: climbs one doubling at a time, keeps the smallest that saturates", gpu, 16, 1000,
     [1, 1, 1, 2, 2, 2, 4, 4, 4, 8, 8, 8, 16, 16, 16, 8, 8], 8, 2048),
    ("gpu: max_batch_size stops the climb (the probe past it ends unreached)", gpu, 4, 1000,
     [1, 1, 1, 2, 2, 2, 4, 4, 4] + [4] * 8 + [4], 4, 1024),
    ("gpu: a shallow queue stops it too (three requests: 768 tokens, the 1024 bucket)", gpu, 16, 3,
     [1, 1, 1, 2, 2, 2, 3, 3, 3] + [3] * 8 + [3], 3, 1024),
]


@pytest.mark.parametrize(("name", "cost", "max_size", "depth", "first", "settled", "cap"), CLIMBS,
                         ids=[c[0] for c in CLIMBS])
def test_the_cap_climbs_while_throughput_grows(name: str, cost: Cost, max_size: int, depth: int,
                                               first: list[int], settled: int, cap: int) -> None:
    one = learner()
    sizes = simulate(one, cost, 60, max_size=max_size, depth=depth)
    assert sizes[:len(first)] == first
    assert sizes[-20:] == [settled] * 20
    assert one.statistics().cap_tokens == cap and one.statistics().probing is None


def test_what_statistics_show() -> None:
    one = learner()
    assert one.limit == 0 and one.statistics().cap_tokens == 0  # nothing measured: one request each
    simulate(one, cpu, 30)
    stats = one.statistics()
    assert (stats.cap_tokens, stats.probing, stats.forwards, stats.probes, stats.reprobes) == (256, None, 30, 1, 0)
    assert [b for b, _ in stats.tokens_per_second] == [256, 512]
    rates = dict(stats.tokens_per_second)
    assert rates[256] == pytest.approx(ITEM / 0.2025) and rates[512] < rates[256]
    assert stats.batch_size == 1.0  # the last 16 forwards: each request alone


def test_reprobes_are_bounded_and_regular() -> None:
    """Steady state on the CPU: after every 64 forwards alone, one probe of three pairs, and back."""
    one = learner()
    sizes = simulate(one, cpu, 6 + 5 * 67)
    pairs = [i for i, n in enumerate(sizes) if n == 2]
    assert pairs == [3, 4, 5, *(i for k in range(1, 6) for i in range(6 + 67 * k - 3, 6 + 67 * k))]
    assert (one.statistics().reprobes, one.statistics().probes) == (5, 6)


CHANGES = [
    # (name, before, forwards, cap before, after, forwards, settled size, cap after)
    ("a device that gets free: noticed at the next re-probe", cpu, 70, 256, gpu, 200, 8, 2048),
    ("a device that gets busy: the cap's own bucket sees it, the re-probes walk down",
     gpu, 30, 2048, cpu, 300, 1, 256),
]


@pytest.mark.parametrize(("name", "before", "n_before", "cap_before", "after", "n_after", "size", "cap"),
                         CHANGES, ids=[c[0] for c in CHANGES])
def test_a_changed_device_is_noticed(name: str, before: Cost, n_before: int, cap_before: int,
                                     after: Cost, n_after: int, size: int, cap: int) -> None:
    one = learner()
    simulate(one, before, n_before)
    assert one.statistics().cap_tokens == cap_before
    assert simulate(one, after, n_after)[-10:] == [size] * 10
    assert one.statistics().cap_tokens == cap


def test_one_slow_forward_does_not_move_the_cap() -> None:
    one = learner()
    simulate(one, gpu, 30)
    slow_once = iter([True])
    simulate(one, lambda n, t: gpu(n, t) * (8 if next(slow_once, False) else 1), 5)
    assert one.statistics().cap_tokens == 2048


def test_tiny_forwards_keep_to_their_own_bucket() -> None:
    """Health probes (a few tokens, slow per token) do not drag a real batch size's estimate."""
    one = learner()
    simulate(one, gpu, 30)
    for _ in range(10):
        one.observe(1, 4, 0.02)
    assert one.statistics().cap_tokens == 2048
    assert dict(one.statistics().tokens_per_second)[4] == pytest.approx(200)


def test_the_tolerance_prefers_the_smaller_cap() -> None:
    """Pairs 3% faster per token: at 5% that is "not growing" (alone); at 2% pairs pay."""
    for tolerance in (0.05, 0.02):
        one = learner(tolerance=tolerance)
        simulate(one, lambda n, t: cpu(1, t) * (0.97 if n > 1 else 1), 20)  # pairs 3% faster
        assert one.statistics().cap_tokens == (256 if tolerance >= 0.05 else 512), tolerance


def test_running_out_of_memory_sets_a_ceiling() -> None:
    one = learner()
    simulate(one, gpu, 30)
    one.out_of_memory(2048)
    stats = one.statistics()
    assert (stats.cap_tokens, stats.ceiling) == (1024, 2048)
    sizes = simulate(one, gpu, 300)
    assert max(sizes) == 4  # never probed at or past the ceiling again


def test_a_probe_out_of_memory_ends_it() -> None:
    one = learner()
    simulate(one, gpu, 9)  # singles, pairs, fours measured: probing 2048
    assert one.statistics().probing == 2048
    one.out_of_memory(2048)
    assert one.statistics().probing is None and one.limit == 1024


def test_max_tokens_is_the_hard_ceiling() -> None:
    one = learner(max_tokens=700)
    sizes = simulate(one, gpu, 40)
    assert max(sizes) == 2 and one.limit <= 700  # 512 measured; 1024 allowed 700 at most (2 images)


def test_clocks_that_did_not_move_say_nothing() -> None:
    one = learner()
    one.observe(2, 512, 0.0)
    one.observe(0, 0, 1.0)
    assert one.statistics().forwards == 0


@pytest.mark.parametrize(("tokens", "bucket"), [(1, 1), (2, 2), (3, 4), (256, 256), (257, 512), (0, 1)])
def test_token_bucket(tokens: int, bucket: int) -> None:
    assert token_bucket(tokens) == bucket


@pytest.mark.parametrize("bad", [{"tolerance": 1.0}, {"tolerance": -0.1}, {"min_samples": 0},
                                 {"min_samples": 6, "window": 5}, {"probe_batches": 2},
                                 {"reprobe_every": 0}])
def test_invalid_settings(bad: dict) -> None:
    with pytest.raises(ValueError):
        BatchCapSettings(**bad)


def test_slower_pairs_are_left_at_once() -> None:
    assert simulate(learner(), slower_in_pairs, 10, item=100) == [1, 1, 1, 2, 2, 2, 1, 1, 1, 1]
