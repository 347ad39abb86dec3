"""Tiny, seeded, random-weight checkpoints of the real architectures.

They are written with ``save_pretrained``, so they have exactly the layout of a
user's download (config.json, safetensors, preprocessor_config.json and, for
the vision families, video_preprocessor_config.json) and go through the same
loading code. The weights are random: embeddings from them mean nothing, but
every code path (processors, window attention, deepstack, merger, audio
masking, batching) runs for real.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epd_trio.errors import ModelLoadError

__all__ = ["TINY_ARCHES", "TinySpec", "make_tiny_model", "servable_spec"]

TINY_MARKER = "epd_trio_tiny_random_weights"


@dataclass(frozen=True)
class TinySpec:
    """Dimensions of a generated checkpoint; tests vary them.

    ``vision_*`` size the encoder: the vision tower, or for ``qwen2_audio`` the
    audio tower (d_model, layers, heads). ``out_hidden`` is the language
    model's width, i.e. the embedding width (per block for Qwen3-VL).
    """

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
    # Video processor: size["longest_edge"] (per frame for Qwen2/2.5-VL, per
    # video for Qwen3-VL).
    video_max_pixels: int = 256 * 28 * 28
    # Qwen3-VL: patch side, learned position grid (a square), deepstack layers.
    patch_size: int = 16
    position_embeddings: int = 64
    deepstack_indexes: tuple[int, ...] = (0,)
    # Qwen2-Audio: mel bins, sample rate and window (seconds) of the feature
    # extractor; the tower's positions follow from them (hop of 160 samples).
    # Whisper's mel filters reach 8 kHz, so keep the rate at 16 kHz.
    mel_bins: int = 128
    sampling_rate: int = 16000
    window_seconds: int = 30
    # The language model's attention heads. A language server's kernels need
    # a real head size (vLLM's CPU attention: 32 or more), so a checkpoint
    # meant to be served uses fewer, wider heads (``servable_spec``).
    text_heads: int = 4
    text_kv_heads: int = 2
    # Also write a tokenizer and a chat template (``epd_trio.model.tiny_text``),
    # so that a language server can load and serve the checkpoint.
    tokenizer: bool = False


def _text_config(spec: TinySpec) -> dict[str, Any]:
    heads = spec.text_heads
    head_dim = spec.out_hidden // heads
    half = head_dim // 2
    # mrope_section (temporal, height, width) must sum to half the text head size.
    mrope = [half - 2 * (half // 3), half // 3, half // 3]
    return {
        "hidden_size": spec.out_hidden,
        "intermediate_size": spec.text_intermediate,
        "num_hidden_layers": spec.text_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": spec.text_kv_heads,
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

    if spec.arch == "qwen2_audio":
        return _audio_config(spec)
    text = _text_config(spec)
    special: dict[str, Any] = {"image_token_id": 3, "video_token_id": 4, "vision_start_token_id": 5,
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
    if spec.arch == "qwen3_vl":
        heads = text["num_attention_heads"]
        text = {**text, "head_dim": spec.out_hidden // heads}
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_interleaved": True}
        vision = {
            "depth": spec.vision_depth, "hidden_size": spec.vision_hidden,
            "num_heads": spec.vision_heads, "intermediate_size": spec.vision_hidden * 2,
            "out_hidden_size": spec.out_hidden, "patch_size": spec.patch_size,
            "num_position_embeddings": spec.position_embeddings,
            "deepstack_visual_indexes": list(spec.deepstack_indexes),
        }
        return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **special)
    raise ModelLoadError(f"no tiny model for arch {spec.arch!r}; choose one of {TINY_ARCHES}")


def _audio_config(spec: TinySpec) -> Any:
    import transformers

    hop = 160
    frames = spec.window_seconds * spec.sampling_rate // hop
    audio = {
        "num_mel_bins": spec.mel_bins, "encoder_layers": spec.vision_depth,
        "encoder_attention_heads": spec.vision_heads, "encoder_ffn_dim": spec.vision_hidden * 2,
        "d_model": spec.vision_hidden, "max_source_positions": frames // 2,
    }
    text = {
        "model_type": "qwen2", "hidden_size": spec.out_hidden,
        "intermediate_size": spec.text_intermediate, "num_hidden_layers": spec.text_layers,
        "num_attention_heads": spec.text_heads, "num_key_value_heads": spec.text_kv_heads,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": 4096, "bos_token_id": 0, "eos_token_id": 1,
        "pad_token_id": 2, **spec.extra_text,
    }
    return transformers.Qwen2AudioConfig(audio_config=audio, text_config=text,
                                         audio_token_index=7)


def _processors(spec: TinySpec) -> list[Any]:
    """The processors a user's download of ``spec.arch`` would carry."""
    import transformers

    if spec.arch == "qwen2_audio":
        return [transformers.WhisperFeatureExtractor(
            feature_size=spec.mel_bins, sampling_rate=spec.sampling_rate,
            chunk_length=spec.window_seconds, hop_length=160)]
    if spec.arch == "qwen3_vl":
        half = [0.5, 0.5, 0.5]
        factor = spec.patch_size * 2
        return [
            transformers.Qwen2VLImageProcessor(
                patch_size=spec.patch_size, image_mean=half, image_std=half,
                min_pixels=factor * factor, max_pixels=spec.max_pixels),
            transformers.Qwen3VLVideoProcessor(
                patch_size=spec.patch_size, image_mean=half, image_std=half,
                size={"shortest_edge": 4 * factor * factor, "longest_edge": spec.video_max_pixels},
                cap_pixels_per_frame=True),
        ]
    return [
        transformers.Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=spec.max_pixels),
        transformers.Qwen2VLVideoProcessor(min_pixels=56 * 56, max_pixels=spec.video_max_pixels,
                                           cap_pixels_per_frame=True),
    ]


TINY_ARCHES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen2_audio")


def servable_spec(arch: str = "qwen2_5_vl", **overrides: Any) -> TinySpec:
    """A tiny spec a language server can serve: heads of 32 (vLLM's CPU attention
    needs at least that; ``mrope_section`` then sums to 16), a tokenizer and a
    chat template, a vocabulary that covers the tokenizer."""
    dims: dict[str, Any] = dict(arch=arch, vision_hidden=64, vision_heads=2, out_hidden=64,
                                text_heads=2, text_kv_heads=2, text_intermediate=128,
                                vocab_size=272, tokenizer=True)
    return TinySpec(**{**dims, **overrides})


def make_tiny_model(directory: str | Path, spec: TinySpec | None = None) -> Path:
    """Write a tiny random-weight checkpoint of ``spec.arch`` into ``directory``."""
    import torch
    import transformers

    spec = spec or TinySpec()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = _config(spec)
    dtype = getattr(torch, spec.dtype)
    # Weight init draws from torch's global CPU generator (from_config takes no
    # generator): seed it inside a fork, so the weights depend on spec.seed only
    # and the caller's random state is the same afterwards.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        if spec.arch == "qwen2_audio":  # no Auto class builds it from a config
            model = transformers.Qwen2AudioForConditionalGeneration._from_config(config, dtype=dtype)
        else:
            model = transformers.AutoModelForImageTextToText.from_config(config, dtype=dtype)
    model.save_pretrained(out)
    processors = _processors(spec)
    for processor in processors:
        processor.save_pretrained(out)
    if spec.tokenizer:
        from epd_trio.model.tiny_text import save_text_side

        save_text_side(out, spec, processors)
    (out / f"{TINY_MARKER}.json").write_text(
        json.dumps({"warning": "random weights, for tests and demos only", "spec": _jsonable(spec)})
    )
    return out


def _jsonable(spec: TinySpec) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(spec)


def is_tiny_model(directory: str | Path) -> bool:
    return (Path(directory) / f"{TINY_MARKER}.json").exists()


DEFAULT_NAME = "tiny-qwen2_5_vl-v2"  # v2: with a video processor


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
