"""Load only the encoder of a full multimodal checkpoint.

A Qwen2.5-VL-72B checkpoint is ~140 GB, of which the vision tower is ~1.3 GB.
We read ``config.json``, pick the family's adapter, build the encoder module
with initialisation skipped, and read from the safetensors files (single or
sharded) only the tensors under the encoder's key prefixes (``visual.*``, or
``audio_tower.*`` and ``multi_modal_projector.*``). The language model's bytes
are never touched: safetensors maps the files and we index only the keys we
need. The checkpoint's own processors are loaded beside it, one per modality.

``load_encoders`` is the async face: each load and replica copy runs in a
worker thread that a cancellation abandons (Ctrl-C during a minutes-long load
exits at once). The thread holds nothing we free afterwards: its half-built
module is dropped when it ends.
"""

from __future__ import annotations

import functools
import json
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from epd_trio.config import DTYPES
from epd_trio.errors import ModelLoadError
from epd_trio.model.adapters import ModelAdapter, adapter_for
from epd_trio.model.tiny import is_tiny_model

__all__ = [
    "DTYPES", "LoadedEncoder", "encoder_weight_names", "load_encoder", "load_encoders",
    "load_processors", "replicate_encoder", "replicate_encoders", "resolve_dtype",
]

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass
class LoadedEncoder:
    """An encoder module ready for forwards, with what it needs to be fed."""

    adapter: ModelAdapter
    module: Any  # torch.nn.Module
    # The checkpoint's own Hugging Face processors, by modality: an image
    # processor, a video processor, an audio feature extractor.
    processors: dict[str, Any]
    model_dir: Path
    device: str
    dtype: Any  # torch.dtype
    random_weights: bool

    @property
    def family(self) -> str:
        return self.adapter.family

    @property
    def processor(self) -> Any:
        """The image processor (``None`` for a family without images)."""
        return self.processors.get("image")


def resolve_dtype(name: str, config: Any) -> Any:
    """``auto`` is the checkpoint's own dtype (float32 when it names none)."""
    import torch

    if name not in DTYPES:
        raise ModelLoadError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    if name == "auto":
        found = getattr(config, "dtype", None) or "float32"
        return found if isinstance(found, torch.dtype) else getattr(torch, str(found))
    return getattr(torch, name)


def _weight_files(model_dir: Path) -> dict[str, str]:
    """Map each tensor name to the file holding it (sharded or single-file)."""
    index = model_dir / INDEX_FILE
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    single = model_dir / SINGLE_FILE
    if not single.exists():
        raise ModelLoadError(f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), SINGLE_FILE)


def encoder_weight_names(adapter: ModelAdapter, weight_map: dict[str, str]) -> dict[str, str]:
    """Checkpoint names of the encoder's tensors, mapped to module names."""
    names = adapter.encoder_weight_names(weight_map)
    if names:
        return names
    raise ModelLoadError(
        f"no encoder weights in the checkpoint: no tensor name starts with any of "
        f"{adapter.weight_prefixes}"
    )


def _read_tensors(model_dir: Path, wanted: dict[str, str], files: dict[str, str]) -> dict:
    from safetensors import safe_open

    by_file: dict[str, list[str]] = defaultdict(list)
    for name in wanted:
        by_file[files[name]].append(name)
    state = {}
    for filename, names in sorted(by_file.items()):
        with safe_open(model_dir / filename, framework="pt") as f:
            for name in names:
                state[wanted[name]] = f.get_tensor(name)
    return state


def _load_config(model_dir: Path) -> Any:
    if not (model_dir / "config.json").exists():
        raise ModelLoadError(f"{model_dir} is not a model checkpoint: no config.json")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"cannot read {model_dir}/config.json: {exc}") from exc


def load_processors(adapter: ModelAdapter, model_dir: Path) -> dict[str, Any]:
    """Each modality's processor, by the Auto class the family names.

    Checkpoints without a separate video processor config (Qwen2-VL and
    Qwen2.5-VL on the Hub) get one built from ``preprocessor_config.json``,
    as transformers itself does.
    """
    import transformers

    processors = {}
    for modality, class_name in sorted(adapter.processor_classes.items()):
        auto = getattr(transformers, class_name)
        try:
            processors[modality] = auto.from_pretrained(model_dir, local_files_only=True)
        except (ValueError, KeyError, OSError, ImportError) as exc:
            raise ModelLoadError(
                f"cannot load the {modality} processor of {model_dir} ({class_name}): {exc}"
            ) from exc
    return processors


def load_encoder(model_dir: str | Path, *, device: str = "cpu", dtype: str = "auto") -> LoadedEncoder:
    """Load the encoder of a local checkpoint; blocking (run it in a thread)."""
    from transformers.initialization import no_init_weights

    check_device(device)
    model_dir = Path(model_dir)
    config = _load_config(model_dir)
    adapter = adapter_for(config)
    torch_dtype = resolve_dtype(dtype, config)
    files = _weight_files(model_dir)
    wanted = encoder_weight_names(adapter, files)
    with no_init_weights():
        module = adapter.build_encoder(torch_dtype)
    state = _read_tensors(model_dir, wanted, files)
    state = {k: v.to(torch_dtype) for k, v in state.items()}
    try:
        module.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"encoder weights of {model_dir} do not fit the config: {exc}") from exc
    module.to(device).eval().requires_grad_(False)
    random = is_tiny_model(model_dir)
    log.info(
        "loaded %s encoder from %s: %d tensors, %.1f M params, %s on %s%s",
        adapter.family, model_dir, len(state), sum(p.numel() for p in module.parameters()) / 1e6,
        str(torch_dtype).removeprefix("torch."), device,
        " (RANDOM WEIGHTS: tiny test model)" if random else "",
    )
    return LoadedEncoder(
        adapter=adapter, module=module, processors=load_processors(adapter, model_dir),
        model_dir=model_dir, device=device, dtype=torch_dtype, random_weights=random,
    )


def check_device(device: str) -> None:
    """A CUDA device torch cannot use is a start-up error that names it, not torch's traceback."""
    import torch

    resolved = torch.device(device)
    if resolved.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} (--device): torch sees no CUDA device here")
    if resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ModelLoadError(f"device {device!r} (--device): torch sees "
                             f"{torch.cuda.device_count()} CUDA device(s) here")


def replicate_encoder(encoder: LoadedEncoder, device: str) -> LoadedEncoder:
    """The same encoder with its own copy of the module on ``device`` (data parallel).

    The adapter and the processors are shared: neither holds per-forward state.
    Blocking (run it in a thread).
    """
    import copy
    import dataclasses

    module = copy.deepcopy(encoder.module).to(device).eval().requires_grad_(False)
    return dataclasses.replace(encoder, module=module, device=device)


async def load_encoders(model_dir: str | Path, devices: Sequence[str], dtype: str = "auto") -> list[LoadedEncoder]:
    """The encoder loaded on ``devices[0]``, then a copy on each further device.

    Each step runs in a worker thread abandoned on cancellation, so a
    cancelled start-up returns at once while the thread finishes alone.
    """
    for device in devices:  # before the load, which may take minutes
        check_device(device)
    first, *others = devices
    log.info("loading the encoder of %s on %s", model_dir, first)
    encoder = await trio.to_thread.run_sync(
        functools.partial(load_encoder, model_dir, device=first, dtype=dtype), abandon_on_cancel=True)
    return [encoder, *await replicate_encoders(encoder, others)]


async def replicate_encoders(encoder: LoadedEncoder, devices: Sequence[str]) -> list[LoadedEncoder]:
    """A copy of ``encoder`` per device, one after the other, each in an abandonable thread."""
    return [await trio.to_thread.run_sync(replicate_encoder, encoder, device, abandon_on_cancel=True)
            for device in devices]
