"""Routing is a pure plan: table-driven, no trio."""

from __future__ import annotations

import pytest

from epd_trio.client.routing import Part, least_loaded, pick_fallback, plan_parts, split_evenly
from epd_trio.errors import RequestError

A, B, C = "http://a", "http://b", "http://c"


@pytest.mark.parametrize(
    ("count", "ways", "runs"),
    [
        (5, 2, [(0, 1, 2), (3, 4)]),
        (4, 2, [(0, 1), (2, 3)]),
        (7, 3, [(0, 1, 2), (3, 4), (5, 6)]),
        (1, 1, [(0,)]),
        (2, 3, [(0,), (1,), ()]),
        (0, 2, [(), ()]),
    ],
)
def test_split_evenly(count: int, ways: int, runs: list[tuple[int, ...]]) -> None:
    assert [tuple(r) for r in split_evenly(count, ways)] == runs


def test_split_evenly_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        split_evenly(3, 0)
    with pytest.raises(ValueError):
        split_evenly(-1, 2)


# (item counts, encoders, outstanding before, expected parts as (modality, url, items))
PLANS = [
    pytest.param({"image": 5}, [A, B], {}, [("image", A, (0, 1, 2)), ("image", B, (3, 4))],
                 id="five images over two idle encoders"),
    pytest.param({"image": 1}, [A, B], {}, [("image", A, (0,))],
                 id="one item: one part, first encoder on a tie"),
    pytest.param({"image": 1}, [A, B], {A: 2, B: 1}, [("image", B, (0,))],
                 id="one item goes to the least loaded"),
    pytest.param({"image": 2}, [A, B, C], {A: 0, B: 5, C: 0},
                 [("image", A, (0,)), ("image", C, (1,))],
                 id="busiest encoder skipped, parts in encoder order"),
    pytest.param({"image": 4}, [A, B, C], {A: 0, B: 5, C: 0},
                 [("image", A, (0, 1)), ("image", B, (2,)), ("image", C, (3,))],
                 id="as many parts as encoders when items allow, whatever their load"),
    pytest.param({"image": 2}, [A, B, C], {A: 3, B: 0, C: 0},
                 [("image", B, (0,)), ("image", C, (1,))], id="two least loaded of three"),
    pytest.param({"audio": 1, "image": 1, "video": 1}, [A, B], {},
                 [("image", A, (0,)), ("video", B, (0,)), ("audio", A, (0,))],
                 id="modality-major whatever the dict order; this plan's parts count as load"),
    pytest.param({"image": 3, "video": 2}, [A, B], {},
                 [("image", A, (0, 1)), ("image", B, (2,)), ("video", A, (0,)), ("video", B, (1,))],
                 id="each modality split over both"),
    pytest.param({"image": 4, "video": 0}, [A], {A: 9}, [("image", A, (0, 1, 2, 3))],
                 id="a single encoder takes everything; empty modality skipped"),
    pytest.param({"video": 2}, [A, B, C], {"http://gone": 4, B: 1},
                 [("video", A, (0,)), ("video", C, (1,))],
                 id="load of unknown encoders ignored"),
]


@pytest.mark.parametrize(("counts", "encoders", "outstanding", "expected"), PLANS)
def test_plan_parts(counts: dict[str, int], encoders: list[str], outstanding: dict[str, int],
                    expected: list[tuple[str, str, tuple[int, ...]]]) -> None:
    before = dict(outstanding)
    plan = plan_parts(counts, encoders, outstanding)
    assert plan == [Part(i, m, url, items) for i, (m, url, items) in enumerate(expected)]
    assert outstanding == before  # the caller's counts are not changed


@pytest.mark.parametrize(
    ("counts", "encoders", "error"),
    [
        ({"text": 1}, [A], RequestError),
        ({}, [A], RequestError),
        ({"image": 0}, [A], RequestError),
        ({"image": 1}, [], ValueError),
        ({"image": 1}, [A, A], ValueError),
        ({"image": -1}, [A], ValueError),
    ],
)
def test_plan_parts_refuses(counts: dict[str, int], encoders: list[str], error: type) -> None:
    with pytest.raises(error):
        plan_parts(counts, encoders)


@pytest.mark.parametrize(
    ("outstanding", "k", "exclude", "chosen"),
    [
        ({}, 2, (), [A, B]),
        ({A: 1}, 2, (), [B, C]),
        ({A: 1, B: 1, C: 1}, 1, (), [A]),
        ({C: 0, A: 2, B: 1}, 2, (), [B, C]),
        ({}, 3, (A,), [B, C]),
        ({}, 1, (A, B, C), []),
    ],
)
def test_least_loaded(outstanding: dict[str, int], k: int, exclude: tuple[str, ...],
                      chosen: list[str]) -> None:
    assert least_loaded([A, B, C], outstanding, k, exclude) == chosen


@pytest.mark.parametrize(
    ("outstanding", "tried", "choice"),
    [
        ({}, [A], B),
        ({B: 3, C: 1}, [A], C),
        ({}, [A, B], C),
        ({}, [A, B, C], None),
    ],
)
def test_pick_fallback(outstanding: dict[str, int], tried: list[str], choice: str | None) -> None:
    assert pick_fallback([A, B, C], outstanding, tried) == choice
