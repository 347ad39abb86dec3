"""Tiny, seeded, random-weight checkpoints of the real architectures.

They are written with ``save_pretrained``, so they have exactly the layout of a
user's download (config.json, safetensors, preprocessor_config.json) and go
through the same loading code. The weights are random: embeddings from them
mean nothing, but every code path (processor, window attention, merger,
batching) runs for real.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epd_trio.errors import ModelLoadError

__all__ = ["TINY_ARCHES", "TinySpec", "make_tiny_model"]

TINY_MARKER = "epd_trio_tiny_random_weights"


@dataclass(frozen=True)
class TinySpec:
    """Dimensions of a generated checkpoint; tests vary them."""

    arch: str = "qwen2_5_vl"
    vision_hidden: int = 32
    vision_depth: int = 2
    vision_heads: int = 2
    out_hidden: int = 48
    text_layers: int = 1
    text_intermediate: int = 64
    vocab_size: int = 256
    seed: int = 0
    dtype: str = "float32"
    max_pixels: int = 1280 * 28 * 28
    extra_text: dict[str, Any] = field(default_factory=dict)


def _text_config(spec: TinySpec) -> dict[str, Any]:
    heads = 4
    head_dim = spec.out_hidden // heads
    half = head_dim // 2
    # mrope_section (temporal, height, width) must sum to half the text head size.
    mrope = [half - 2 * (half // 3), half // 3, half // 3]
    return {
        "hidden_size": spec.out_hidden,
        "intermediate_size": spec.text_intermediate,
        "num_hidden_layers": spec.text_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": 4096,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope},
        **spec.extra_text,
    }


def _config(spec: TinySpec) -> Any:
    import transformers

    text = _text_config(spec)
    special = {"image_token_id": 3, "video_token_id": 4, "vision_start_token_id": 5,
               "vision_end_token_id": 6}
    if spec.arch == "qwen2_5_vl":
        vision = {
            "depth": spec.vision_depth, "hidden_size": spec.vision_hidden,
            "num_heads": spec.vision_heads, "intermediate_size": spec.vision_hidden * 2,
            "out_hidden_size": spec.out_hidden, "window_size": 112,
            "fullatt_block_indexes": [spec.vision_depth - 1],
        }
        return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **special)
    if spec.arch == "qwen2_vl":
        vision = {
            "depth": spec.vision_depth, "embed_dim": spec.vision_hidden,
            "num_heads": spec.vision_heads, "hidden_size": spec.out_hidden, "mlp_ratio": 2,
        }
        return transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **special)
    raise ModelLoadError(f"no tiny model for arch {spec.arch!r}; choose one of {TINY_ARCHES}")


TINY_ARCHES = ("qwen2_5_vl", "qwen2_vl")


def make_tiny_model(directory: str | Path, spec: TinySpec | None = None) -> Path:
    """Write a tiny random-weight checkpoint of ``spec.arch`` into ``directory``."""
    import torch
    import transformers

    spec = spec or TinySpec()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = _config(spec)
    torch.manual_seed(spec.seed)
    model = transformers.AutoModelForImageTextToText.from_config(
        config, dtype=getattr(torch, spec.dtype)
    )
    model.save_pretrained(out)
    processor = transformers.Qwen2VLImageProcessor(
        min_pixels=56 * 56, max_pixels=spec.max_pixels
    )
    processor.save_pretrained(out)
    (out / f"{TINY_MARKER}.json").write_text(
        json.dumps({"warning": "random weights, for tests and demos only", "spec": _jsonable(spec)})
    )
    return out


def _jsonable(spec: TinySpec) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(spec)


def is_tiny_model(directory: str | Path) -> bool:
    return (Path(directory) / f"{TINY_MARKER}.json").exists()


DEFAULT_NAME = "tiny-qwen2_5_vl-v1"


def ensure_default_model(cache_dir: Path) -> Path:
    """The embedded default model, generated once into ``cache_dir``.

    Written to a temporary sibling and renamed into place, so concurrent first
    starts (several encoders on one host) never see half a checkpoint.
    """
    import logging
    import os
    import shutil
    import tempfile

    target = Path(cache_dir) / DEFAULT_NAME
    if is_tiny_model(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logging.getLogger(__name__).warning(
        "no --model-path: generating the embedded tiny qwen2_5_vl with RANDOM weights in %s "
        "(for tests and demos; its embeddings mean nothing)", target)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        make_tiny_model(tmp, TinySpec())
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race
            if not is_tiny_model(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
