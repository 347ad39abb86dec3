"""SGLang 0.5.23's ZMQ embedding message, written without importing sglang.

An SGLang language server (``--language-only``) PULLs two-frame messages from
its encoders: frame 0 is a pickle of
``sglang.srt.disaggregation.encoder.receiver.EmbeddingData`` that it reads
with its allow-listing ``safe_pickle_loads``; frame 1 is the embedding's raw
C-contiguous bytes (native order: little-endian on every host we run on). An
error, and the completion notice after a Mooncake write, is frame 0 alone.

Sans-IO: no trio, no sockets. ``pickle._Pickler`` (the pure-Python pickler,
whose ``save_global`` can be overridden) writes two local stand-in classes
under SGLang's class paths, so the receiver rebuilds its own classes; nothing
here ever *unpickles*. The state mirrors ``EmbeddingData.copy_without_embedding``
on SGLang's encoder, in the same order: ``req_id, num_parts, part_idx,
grid_dim, modality, embedding (None), send_time (None), dtype, shape,
_mr_ptr (None), error_msg, error_code`` and, for embeddings,
``video_timestamps, second_per_grid_ts``. Every global it names is on
SafeUnpickler's allow-list; tensors go through torch's own reducer, as
SGLang's encoder sends them.
"""

from __future__ import annotations

import enum
import io
import math
import pickle
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

import torch

from epd_trio.errors import error_body, http_status
from epd_trio.protocol.codec import TORCH_DTYPES, FrameLike
from epd_trio.protocol.payload import tensor_bytes
from epd_trio.protocol.requests import EncodeMeta

__all__ = [
    "EMBEDDING_DATA_CLASS",
    "MODALITY_CLASS",
    "MODALITY_VALUES",
    "embedding_frame",
    "embedding_message",
    "error_frame",
    "error_message",
    "meta_fields",
]

EMBEDDING_DATA_CLASS: Final = ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData")
MODALITY_CLASS: Final = ("sglang.srt.multimodal.modality", "Modality")
# SGLang's ``Modality(Enum)`` numbers its members with auto(): IMAGE=1, VIDEO=2, AUDIO=3.
MODALITY_VALUES: Final[Mapping[str, int]] = MappingProxyType({"image": 1, "video": 2, "audio": 3})
PICKLE_PROTOCOL: Final = 4  # pickle.dumps' default on the Pythons SGLang supports
MAX_ERROR_MESSAGE: Final = 4096


class _EmbeddingData:
    """Stand-in pickled under SGLang's class path: only its ``__dict__`` travels."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class _Modality(enum.Enum):
    """Stand-in for SGLang's ``Modality``; an Enum pickles as ``Modality(value)``."""

    IMAGE = 1
    VIDEO = 2
    AUDIO = 3


_GLOBAL_NAMES: Final[Mapping[object, tuple[str, str]]] = MappingProxyType({
    _EmbeddingData: EMBEDDING_DATA_CLASS,
    _Modality: MODALITY_CLASS,
})
# torch.dtype reduces to its bare name; name the module ourselves instead of
# letting pickle search sys.modules for one that happens to hold it.
_DTYPE_NAMES: Final[Mapping[torch.dtype, str]] = MappingProxyType(
    {dtype: name for name, dtype in TORCH_DTYPES.items()})


class _SGLangPickler(pickle._Pickler):
    """The C pickler looks every global up by importing it; this one writes the
    stand-ins under SGLang's names, so neither sglang nor a fake of it is imported."""

    if TYPE_CHECKING:  # the pure-Python pickler's internals, which typeshed does not list
        save: Callable[[object], None]
        write: Callable[[bytes], None]
        memoize: Callable[[object], None]

    def save_global(self, obj: object, name: str | None = None) -> None:
        target = _GLOBAL_NAMES.get(obj) if isinstance(obj, type) else None
        if isinstance(obj, torch.dtype) and obj in _DTYPE_NAMES:
            target = ("torch", _DTYPE_NAMES[obj])
        if target is None:
            super().save_global(obj, name)  # type: ignore[misc]  # an internal typeshed does not list
            return
        self.save(target[0])
        self.save(target[1])
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)


def _dumps(state: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    _SGLangPickler(buffer, protocol=PICKLE_PROTOCOL).dump(_EmbeddingData(state))
    return buffer.getvalue()


def _modality(modality: str) -> _Modality:
    try:
        return _Modality(MODALITY_VALUES[modality.lower()])
    except KeyError:
        raise ValueError(f"modality must be one of {list(MODALITY_VALUES)}, got {modality!r}") from None


def _grid(grid: torch.Tensor | Sequence[Any], modality: str) -> torch.Tensor:
    """int64 ``[n, 3]`` (image, video) or ``[n]`` mel lengths (audio), in its own storage:
    torch pickles a view's whole storage, so a slice of a batch would drag the batch along."""
    t = torch.as_tensor(grid, dtype=torch.int64).detach().cpu().clone(memory_format=torch.contiguous_format)
    want = 1 if modality.lower() == "audio" else 2
    if t.ndim != want or (want == 2 and t.shape[1] != 3) or t.shape[0] == 0:
        raise ValueError(f"{modality} grid must be {'[n]' if want == 1 else '[n, 3]'} with n >= 1,"
                         f" got shape {list(t.shape)}")
    return t


def _seconds(second_per_grid_ts: torch.Tensor | Sequence[float] | None) -> torch.Tensor | None:
    if second_per_grid_ts is None:
        return None
    t = torch.as_tensor(second_per_grid_ts, dtype=torch.float32).detach().cpu()
    return t.reshape(-1).clone()


def _timestamps(video_timestamps: Sequence[Sequence[float]] | None) -> list[list[float]] | None:
    if video_timestamps is None:
        return None
    out = [[float(x) for x in per_video] for per_video in video_timestamps]
    if not all(math.isfinite(x) for per_video in out for x in per_video):
        raise ValueError("video_timestamps must be finite")
    return out


def _head(req_id: str, part_idx: int, num_parts: int) -> dict[str, Any]:
    if not (0 <= part_idx < num_parts):
        raise ValueError(f"need 0 <= part_idx < num_parts, got {part_idx} of {num_parts}")
    return {"req_id": str(req_id), "num_parts": int(num_parts), "part_idx": int(part_idx)}


def embedding_frame(
    *,
    req_id: str,
    part_idx: int,
    num_parts: int,
    modality: str,
    dtype: torch.dtype,
    shape: Sequence[int],
    grid: torch.Tensor | Sequence[Any],
    video_timestamps: Sequence[Sequence[float]] | None = None,
    second_per_grid_ts: torch.Tensor | Sequence[float] | None = None,
) -> bytes:
    """Frame 0 describing a ``shape = [rows, dim]`` embedding of ``dtype``.

    Alone, it is the completion notice of a Mooncake write; with the bytes as
    frame 1 (``embedding_message``), the ZMQ message. ``grid`` is the part's
    grid rows, or for audio its mel-frame input lengths. Video extras: Qwen2.5-VL
    ``second_per_grid_ts`` (one float per video), Qwen3-VL ``video_timestamps``
    (a list of seconds per video).
    """
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {list(TORCH_DTYPES)}, got {dtype}")
    rows, dim = (int(n) for n in shape)
    if rows < 0 or dim <= 0:
        raise ValueError(f"shape must be [rows, dim] with dim > 0, got {list(shape)}")
    state = _head(req_id, part_idx, num_parts)
    state.update(
        grid_dim=_grid(grid, modality), modality=_modality(modality), embedding=None,
        send_time=None, dtype=dtype, shape=[rows, dim], _mr_ptr=None, error_msg=None,
        error_code=None, video_timestamps=_timestamps(video_timestamps),
        second_per_grid_ts=_seconds(second_per_grid_ts),
    )
    return _dumps(state)


def embedding_message(
    embedding: torch.Tensor,
    *,
    req_id: str,
    part_idx: int,
    num_parts: int,
    modality: str,
    grid: torch.Tensor | Sequence[Any],
    video_timestamps: Sequence[Sequence[float]] | None = None,
    second_per_grid_ts: torch.Tensor | Sequence[float] | None = None,
) -> list[FrameLike]:
    """``[frame 0, frame 1]``: frame 1 views the tensor's memory (copied only if
    not contiguous CPU), so its bytes must not change until the send is done."""
    if embedding.ndim != 2:
        raise ValueError(f"embedding must be [rows, dim], got shape {list(embedding.shape)}")
    frame0 = embedding_frame(
        req_id=req_id, part_idx=part_idx, num_parts=num_parts, modality=modality,
        dtype=embedding.dtype, shape=embedding.shape, grid=grid,
        video_timestamps=video_timestamps, second_per_grid_ts=second_per_grid_ts,
    )
    return [frame0, tensor_bytes(embedding)]


def error_frame(*, req_id: str, part_idx: int, num_parts: int, modality: str, message: str,
                status: int) -> bytes:
    """Frame 0 of an error notice; SGLang fails the request with ``message`` and ``status``."""
    if not (400 <= status <= 599):
        raise ValueError(f"status must be an HTTP error status, got {status}")
    state = _head(req_id, part_idx, num_parts)
    state.update(
        grid_dim=None, modality=_modality(modality), embedding=None, send_time=None,
        dtype=None, shape=None, _mr_ptr=None, error_msg=str(message)[:MAX_ERROR_MESSAGE],
        error_code=int(status),
    )
    return _dumps(state)


def error_message(req_id: str, part_idx: int, num_parts: int, modality: str,
                  exc: BaseException) -> list[FrameLike]:
    """The one-frame error message for ``exc``: the same safe text and status as
    the HTTP error body (never a traceback), like ``codec.error_message``."""
    message = str(error_body(exc)["error"]["message"])  # type: ignore[index]
    status = min(max(http_status(exc), 400), 599)
    return [error_frame(req_id=req_id, part_idx=part_idx, num_parts=num_parts,
                        modality=modality, message=message, status=status)]


def meta_fields(meta: EncodeMeta) -> dict[str, Any]:
    """``embedding_frame`` / ``embedding_message`` keywords for one part, from our meta.

    Images and videos: the part's grid rows. Audio: the items' mel-frame input
    lengths (the adapter's ``mel_frames`` extra), which SGLang's receiver takes
    as ``audio_feature_lens``. Video extras: Qwen2.5-VL ``second_per_grid_ts``,
    Qwen3-VL ``timestamps`` (SGLang's ``video_timestamps``).
    """
    extras = meta.extras or {}
    if meta.modality == "audio":
        if "mel_frames" not in extras:
            raise ValueError("an audio part needs its items' mel_frames for SGLang's grid")
        grid: Any = [int(n) for n in extras["mel_frames"]]
    else:
        grid = meta.grid_thw
    return {"req_id": meta.req_id, "part_idx": meta.part_idx, "num_parts": meta.num_parts,
            "modality": meta.modality, "grid": grid,
            "second_per_grid_ts": extras.get("second_per_grid_ts") or None,
            "video_timestamps": extras.get("timestamps") or None}
