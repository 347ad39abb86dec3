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


@pytest.mark.parametrize("bad", [dict(max_batch_size=0), dict(max_batch_tokens=0), dict(coalesce_delay=-1)])
def test_invalid_policy(bad: dict) -> None:
    with pytest.raises(ValueError):
        BatchPolicy(**bad)


def test_policy_module_is_pure() -> None:
    import ast

    import epd_trio.scheduling.policy as policy

    from pathlib import Path

    tree = ast.parse(Path(policy.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])}
    assert not imported & {"trio", "time", "anyio", "asyncio"}, imported
