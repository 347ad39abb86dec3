"""make_tiny_model is seeded by its spec and leaves the caller's random state alone."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from epd_trio import TinySpec, make_tiny_model


def weights(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_weights_follow_the_seed_and_the_callers_rng_is_untouched(tmp_path: Path) -> None:
    spec = TinySpec(vision_depth=1, text_layers=1)
    torch.manual_seed(1234)
    expected_next = torch.rand(4)
    torch.manual_seed(1234)
    first = weights(make_tiny_model(tmp_path / "a", spec))
    assert torch.equal(torch.rand(4), expected_next)  # as if make_tiny_model had not run

    torch.manual_seed(99)  # a different caller state: same weights, they depend on spec.seed only
    second = weights(make_tiny_model(tmp_path / "b", spec))
    other = weights(make_tiny_model(tmp_path / "c", TinySpec(vision_depth=1, text_layers=1, seed=1)))
    assert first.keys() == second.keys() == other.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert any(not torch.equal(first[k], other[k]) for k in first)
