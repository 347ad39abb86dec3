"""The pure batching policy, table-driven."""

from __future__ import annotations

import pytest

from epd_trio.scheduling.policy import Batch, BatchPolicy, QueuedRequest, Wait, next_batch


def q(*specs: tuple[str, int, float]) -> list[QueuedRequest]:
    return [QueuedRequest(i, m, t, at) for i, (m, t, at) in enumerate(specs)]


P = BatchPolicy(max_batch_size=3, max_batch_tokens=100)
IMG = ("image", 10, 0.0)

CASES = [
    # (name, queue, now, policy, expected)
    ("empty", [], 0.0, P, None),
    ("one", q(IMG), 0.0, P, Batch((0,), "image", 10)),
    ("size cap", q(IMG, IMG, IMG, IMG), 0.0, P, Batch((0, 1, 2), "image", 30)),
    ("same modality only", q(IMG, ("audio", 5, 0), IMG), 0.0, P, Batch((0, 2), "image", 20)),
    ("oldest decides modality", q(("audio", 5, 0), IMG, ("audio", 5, 0)), 0.0, P,
     Batch((0, 2), "audio", 10)),
    ("token budget skips big, takes later small", q(("image", 60, 0), ("image", 50, 0), IMG), 0.0, P,
     Batch((0, 2), "image", 70)),
    ("oldest runs alone even over budget", q(("image", 500, 0), IMG), 0.0, P,
     Batch((0,), "image", 500)),
    ("video alone", q(("video", 10, 0), ("video", 10, 0)), 0.0, P, Batch((0,), "video", 10)),
    ("video is not batched behind an image", q(IMG, ("video", 1, 0)), 0.0, P, Batch((0,), "image", 10)),
    ("coalesce waits", q(IMG), 0.0, BatchPolicy(3, 100, coalesce_delay=0.5), Wait(0.5)),
    ("coalesce done", q(IMG), 0.5, BatchPolicy(3, 100, coalesce_delay=0.5), Batch((0,), "image", 10)),
    ("coalesce skipped when full", q(IMG, IMG, IMG), 0.1, BatchPolicy(3, 100, coalesce_delay=0.5),
     Batch((0, 1, 2), "image", 30)),
    ("coalesce counts from the oldest", q(("image", 10, 1.0), ("image", 10, 1.4)), 1.2,
     BatchPolicy(3, 100, coalesce_delay=0.5), Wait(1.5)),
    ("video never waits", q(("video", 10, 0)), 0.0, BatchPolicy(3, 100, coalesce_delay=0.5),
     Batch((0,), "video", 10)),
]


@pytest.mark.parametrize(("name", "queue", "now", "policy", "expected"), CASES, ids=[c[0] for c in CASES])
def test_next_batch(name: str, queue: list, now: float, policy: BatchPolicy, expected: object) -> None:
    assert next_batch(queue, now, policy) == expected


CAPPED = [
    # (name, queue, now, policy, token_caps, expected)
    ("a cap of 0: the oldest alone", q(IMG, IMG, IMG), 0.0, P, {"image": 0}, Batch((0,), "image", 10)),
    ("a cap takes in order while it fits", q(IMG, IMG, IMG), 0.0, P, {"image": 25},
     Batch((0, 1), "image", 20)),
    ("the oldest runs even over the cap", q(("image", 40, 0), IMG), 0.0, P, {"image": 25},
     Batch((0,), "image", 40)),
    ("the cap of the oldest's modality applies", q(("audio", 5, 0), IMG, ("audio", 5, 0)), 0.0, P,
     {"image": 0}, Batch((0, 2), "audio", 10)),
    ("another modality's cap does not", q(IMG, IMG), 0.0, P, {"audio": 0}, Batch((0, 1), "image", 20)),
    ("max_batch_tokens stays the ceiling over a larger cap", q(("image", 60, 0), ("image", 50, 0)), 0.0, P,
     {"image": 1000}, Batch((0,), "image", 60)),
    ("max_batch_size stays the ceiling", q(IMG, IMG, IMG, IMG), 0.0, P, {"image": 1000},
     Batch((0, 1, 2), "image", 30)),
    ("no coalescing wait once no company fits", q(IMG), 0.0, BatchPolicy(3, 100, coalesce_delay=0.5),
     {"image": 15}, Batch((0,), "image", 10)),
    ("coalescing waits while company fits", q(IMG), 0.0, BatchPolicy(3, 100, coalesce_delay=0.5),
     {"image": 20}, Wait(0.5)),
    ("no coalescing wait at max_batch_tokens either", q(("image", 60, 0)), 0.0,
     BatchPolicy(3, 100, coalesce_delay=0.5), None, Batch((0,), "image", 60)),
]


@pytest.mark.parametrize(("name", "queue", "now", "policy", "caps", "expected"), CAPPED,
                         ids=[c[0] for c in CAPPED])
def test_next_batch_under_a_token_cap(name: str, queue: list, now: float, policy: BatchPolicy,
                                      caps: dict | None, expected: object) -> None:
    assert next_batch(queue, now, policy, caps) == expected


@pytest.mark.parametrize("bad", [dict(max_batch_size=0), dict(max_batch_tokens=0), dict(coalesce_delay=-1)])
def test_invalid_policy(bad: dict) -> None:
    with pytest.raises(ValueError):
        BatchPolicy(**bad)


def test_policy_module_is_pure() -> None:
    import ast
    from pathlib import Path

    import epd_trio.scheduling.batch_cap as batch_cap
    import epd_trio.scheduling.policy as policy

    for module in (policy, batch_cap):
        tree = ast.parse(Path(module.__file__).read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                    if isinstance(node, (ast.Import, ast.ImportFrom))
                    for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])}
        assert not imported & {"trio", "time", "anyio", "asyncio"}, (module.__name__, imported)
